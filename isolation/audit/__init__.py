"""`bulkhead audit`: does an OpenAI-compatible endpoint keep one request's data out of another's answers?

Probes (one module each): overlength, accounting, canary, interleaving. Around them: config (what to run,
identities A and B, --stage), budget (requests, rate, time), endpoint (HTTP), discovery (limit, KV capacity,
/tokenize), stages (the KV caches of the engines behind a disaggregated router), prompts (exact-size prompts),
canaries (whose markers an answer holds), findings and report (results, JSON, exit code), render (rich tables
and progress), runner (order of work), command (the CLI).
"""

from isolation.audit.config import AuditConfig, Identity, make_identities
from isolation.audit.errors import (
    AuditError,
    AuthFailed,
    BudgetExhausted,
    CannotRun,
    LimitUnknown,
    ModelMissing,
    StageUnreadable,
    Unreachable,
)
from isolation.audit.findings import Finding, ProbeResult
from isolation.audit.report import Report
from isolation.audit.runner import probe_replica, run_audit

__all__ = [
    "AuditConfig",
    "AuditError",
    "AuthFailed",
    "BudgetExhausted",
    "CannotRun",
    "Finding",
    "Identity",
    "LimitUnknown",
    "ModelMissing",
    "ProbeResult",
    "Report",
    "StageUnreadable",
    "Unreachable",
    "make_identities",
    "probe_replica",
    "run_audit",
]
