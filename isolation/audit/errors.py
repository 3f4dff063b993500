"""Why an audit could not run, or could not finish.

    AuditError
     ├── CannotRun          the endpoint cannot be audited as asked (exit code 2)
     │    ├── Unreachable   no connection, or no answer in time
     │    ├── AuthFailed    401/403 for a given key (or for no key)
     │    ├── ModelMissing  the endpoint does not serve the model
     │    ├── LimitUnknown  no --limit, and the endpoint does not say its context window
     │    └── StageUnreadable  a --stage that does not say how much KV cache it holds, or cannot be reached
     └── BudgetExhausted    the request or time budget ran out part-way; the probes so far still count

Transport errors (httpx) are mapped to these where they enter the audit, in endpoint.py. A failure of one probe
request is not an error at all: it is recorded as that request's outcome, because a refusal is often the
right answer to a probe.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base of the audit's own errors."""


class CannotRun(AuditError):
    """The audit cannot start against this endpoint; the message says what to fix."""


class Unreachable(CannotRun):
    pass


class AuthFailed(CannotRun):
    pass


class ModelMissing(CannotRun):
    pass


class LimitUnknown(CannotRun):
    pass


class StageUnreadable(CannotRun):
    pass


class BudgetExhausted(AuditError):
    """--max-requests or --timeout was reached; the audit stops where it is."""
