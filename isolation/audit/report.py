"""The audit's result: verdict, exit code, and the JSON report (with any key an endpoint echoed redacted).

Exit codes: 0 clean (every probe ran, nothing found), 1 findings (whatever else happened), 2 could not run
(discovery failed) or could not finish (the budget ran out, the endpoint stopped answering, a probe had to be
skipped) without a finding: an audit that did not finish is not a clean bill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from isolation.audit.discovery import EndpointFacts
from isolation.audit.findings import Finding, ProbeResult

REPORT_VERSION = 1
Verdict = Literal["clean", "findings", "could not run", "incomplete"]
REDACTED = "[redacted key]"


@dataclass
class Report:
    endpoint: str
    model: str
    identities: str  # how A and B differ, in words
    seed: int
    started_at: str  # ISO 8601, UTC
    secrets: tuple[str, ...] = field(repr=False, default=())
    duration_s: float = 0.0
    requests: int = 0
    facts: EndpointFacts | None = None
    probes: list[ProbeResult] = field(default_factory=list)
    error: str | None = None

    @property
    def findings(self) -> list[Finding]:
        return [finding for probe in self.probes for finding in probe.findings]

    @property
    def verdict(self) -> Verdict:
        if self.findings:
            return "findings"
        if self.error is not None:
            return "could not run" if self.facts is None else "incomplete"
        if any(probe.incomplete or probe.skipped for probe in self.probes):
            return "incomplete"
        return "clean"

    @property
    def exit_code(self) -> int:
        return {"clean": 0, "findings": 1}.get(self.verdict, 2)

    def to_json(self) -> dict[str, Any]:
        facts = self.facts
        report = {
            "report_version": REPORT_VERSION,
            "endpoint": self.endpoint,
            "model": self.model,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "error": self.error,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "requests": self.requests,
            "seed": self.seed,
            "identities": self.identities,
            "endpoint_facts": None
            if facts is None
            else {
                "limit": facts.limit,
                "limit_source": facts.limit_source,
                "kv_capacity": facts.kv_capacity,
                "kv_capacity_source": facts.kv_capacity_source,
                "effective_limit": facts.effective_limit,
                "decode_limit": facts.decode_bound.kv_capacity if facts.decode_bound else None,
                "stages": [
                    {
                        "name": held.stage.name,
                        "role": held.stage.role,
                        "url": held.stage.url,
                        "kv_capacity": held.kv_capacity,
                        "kv_capacity_source": held.source,
                        "context_length": held.context_length,
                        "statement": facts.stage_statement(held),
                    }
                    for held in facts.stages
                ],
                "token_counts": "exact (/tokenize)" if facts.exact_counts else "estimated (lower bounds)",
                "notes": list(facts.notes),
            },
            "probes": [probe.to_json() for probe in self.probes],
            "findings": [finding.to_json() for finding in self.findings],
        }
        redacted: dict[str, Any] = self._redact(report)
        return redacted

    def _redact(self, value: Any) -> Any:
        """An endpoint may echo a key in an error message; no key ever leaves through the report."""
        if isinstance(value, str):
            for secret in self.secrets:
                value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, dict):
            return {key: self._redact(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self._redact(item) for item in value]
        return value
