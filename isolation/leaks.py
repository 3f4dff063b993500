"""What happens when another tenant's marker shows up in an answer: the policy.

block (default): the answer is withheld (non-stream 502, stream: an error event and close). redact: the marker is
replaced and the answer goes on. alert: the answer goes out unchanged. Every detection, whatever the policy, is
an isolation event (the operators' webhook tells of it: gateway/webhooks); the recipient never learns whose marker it
was, and no marker is ever logged or sent.
"""

from __future__ import annotations

from enum import StrEnum

REDACTED = "[redacted]"


class LeakPolicy(StrEnum):
    BLOCK = "block"
    REDACT = "redact"
    ALERT = "alert"
