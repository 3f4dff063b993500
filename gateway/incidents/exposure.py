"""An incident's blast radius: every answer the replica served in its exposure window, by the tenant it went to.

Every tenant listed had its prompts on the faulty replica (a possible victim of a leak not detected) and received
its answers (a possible recipient): the report says which answers went out whole, in part, or were withheld, which
carried isolation events, and how many characters of suspect text (another tenant's data a check found) reached each
tenant. The victims named by events are listed apart. No text is kept, so none is shown.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gateway.incidents.incident import PROBE, Incident
from gateway.incidents.ledger import VERDICTS, Ledger, Served
from gateway.incidents.reporting import LEAKS
from gateway.settings import Settings


@dataclass(frozen=True)
class Window:
    """A replica and a time range: an incident's exposure window, or one an operator names."""

    replica: str
    since: float
    until: float
    starts: str  # at the last clean probe, the ledger's horizon, or where the operator said
    ends: str  # when the replica left rotation, the incident closed, now, or where the operator said

    @classmethod
    def of(cls, incident: Incident, now: float, slack: float = 0.0) -> Window:
        if incident.contained_at is not None:
            ends = "left rotation"
        elif incident.closed_at is not None:
            ends = "incident closed"
        else:
            ends = "now (the replica is still in rotation)"
        starts = "last clean probe" if incident.window_from == PROBE else "ledger retention horizon (no clean probe)"
        return cls(incident.replica, incident.window_start, incident.window_end(now, slack), starts, ends)


def slack_s(settings: Settings) -> float:
    """How long after a replica left rotation it may still have been sent requests: until every instance synced (a
    health interval), and the ledger's last records flushed."""
    return settings.upstream.health_interval_s + settings.isolation.ledger.flush_interval_s


def carried_leak(served: Served) -> bool:
    """Whether the answer carried another tenant's data, as a check found (a marker or a fragment of a prompt)."""
    return any(kind in LEAKS for kind in served.kinds.split(",")) if served.kinds else False


def _suspect_chars(answers: list[Served]) -> int | None:
    """The suspect characters these answers delivered; None when one that carried a leak has no count (not placed,
    or recorded before it was counted). An answer without a leak carried none that a check found."""
    if any(s.suspect_chars is None and carried_leak(s) for s in answers):
        return None
    return sum(s.suspect_chars or 0 for s in answers)


@dataclass(frozen=True)
class Exposure:
    """What the replica served in the window (the newest answers, when `truncated`), for the report and the console's
    timeline alike."""

    window: Window
    incident: Incident | None
    served: list[Served]
    truncated: bool

    @classmethod
    async def read(cls, ledger: Ledger, window: Window, incident: Incident | None, limit: int) -> Exposure:
        """At most `limit` answers are read (`truncated` says when there were more)."""
        served, truncated = await ledger.served(window.replica, window.since, window.until, limit)
        return cls(window, incident, served, truncated)

    def by_recipient(self) -> list[tuple[str, list[Served]]]:
        """The answers by the tenant each went to, the tenant with the most first."""
        by_tenant: dict[str, list[Served]] = {}
        for s in self.served:
            by_tenant.setdefault(s.tenant, []).append(s)
        return sorted(by_tenant.items(), key=lambda item: -len(item[1]))

    def view(self) -> dict[str, object]:
        """The report, as JSON."""
        window, incident, served = self.window, self.incident, self.served
        totals = Counter(s.verdict for s in served)
        recipients = []
        for tenant, answers in self.by_recipient():
            verdicts = Counter(s.verdict for s in answers)
            recipients.append(
                {
                    "tenant": tenant,
                    "answers": len(answers),
                    **{verdict: verdicts[verdict] for verdict in VERDICTS},
                    "with_leaks": sum(map(carried_leak, answers)),
                    "suspect_chars": _suspect_chars(answers),
                    "requests": [s.view() for s in answers],
                }
            )
        return {
            "incident": incident.view() if incident is not None else None,
            "replica": window.replica,
            "window": {"since": window.since, "until": window.until, "starts": window.starts, "ends": window.ends},
            "answers": len(served),
            "truncated": self.truncated,
            **{verdict: totals[verdict] for verdict in VERDICTS},
            "suspect_chars": _suspect_chars(served),
            "victims": sorted(incident.victims) if incident is not None else [],
            "recipients": recipients,
        }
