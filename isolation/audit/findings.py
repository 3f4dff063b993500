"""What a probe concludes: findings (exit code 1) and notes (context that changes nothing), with trimmed evidence.

Evidence is what was sent and what came back, cut to a few hundred characters. It never includes request
headers, so API keys cannot reach a report through it; report.py also redacts any key an endpoint echoes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from isolation.audit.exchange import Exchange

Severity = Literal["critical", "warning"]
ProbeStatus = Literal["passed", "findings", "skipped", "incomplete"]

EXCERPT = 240


def trim(text: str, limit: int = EXCERPT) -> str:
    """Head and tail of a long text, with how much was cut in between."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} …[{len(text) - 2 * half} chars]… {text[-half:]}"


def around(text: str, start: int, end: int, context: int = 80) -> str:
    """The part of an answer around a sighting, so the report shows the leaked marker in place."""
    lead = "…" if start > context else ""
    tail = "…" if end + context < len(text) else ""
    return f"{lead}{text[max(0, start - context) : end + context]}{tail}"


def sent(exchange: Exchange) -> dict[str, Any]:
    prompt = exchange.prompt
    return {
        "identity": exchange.identity,
        "request": "POST /v1/chat/completions",
        "stream": exchange.stream,
        "max_tokens": exchange.max_tokens,
        "prompt": prompt.label,
        "prompt_tokens": prompt.tokens,
        "prompt_tokens_counted": "exact (/tokenize)" if prompt.exact else "at least (estimated)",
        "prompt_excerpt": trim(prompt.content, 120),
    }


def received(exchange: Exchange, excerpt: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"status": exchange.status or None}
    if exchange.usage is not None:
        out["usage"] = {k: v for k, v in exchange.usage.items() if k in ("prompt_tokens", "completion_tokens")}
    if exchange.error:
        out["error"] = trim(exchange.error)
    if exchange.text or excerpt:
        out["answer_excerpt"] = excerpt if excerpt is not None else trim(exchange.text)
    return out


@dataclass(frozen=True)
class Finding:
    probe: str
    severity: Severity
    title: str  # one line, for the table
    detail: str
    sent: dict[str, Any]
    received: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "severity": self.severity,
            "title": self.title,
            "detail": self.detail,
            "sent": self.sent,
            "received": self.received,
        }


@dataclass
class ProbeResult:
    """One probe's outcome. A probe that ran out of budget keeps what it found before."""

    name: str
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    requests: int = 0
    skipped: str | None = None  # why the probe did not run
    incomplete: str | None = None  # why it stopped early

    def note(self, text: str) -> None:
        """Context for the report; the same note twice (a stream and a non-stream refusal) is kept once."""
        if text not in self.notes:
            self.notes.append(text)

    def find(self, severity: Severity, title: str, detail: str, exchange: Exchange, excerpt: str | None = None) -> None:
        self.findings.append(Finding(self.name, severity, title, detail, sent(exchange), received(exchange, excerpt)))

    @property
    def status(self) -> ProbeStatus:
        if self.findings:
            return "findings"
        if self.incomplete:
            return "incomplete"
        return "skipped" if self.skipped else "passed"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "requests": self.requests,
            "findings": len(self.findings),
            "notes": self.notes,
            "skipped": self.skipped,
            "incomplete": self.incomplete,
        }
