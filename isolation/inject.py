"""Where a tenant's canary marker goes in a request.

More than once by default: a leak returns fragments of cache blocks, and only a whole marker inside a fragment
can be recognised, so the marker stands at both ends of the system text and at the start of every user turn.
The marker is stable within an epoch, so the tenant's own prefix caching keeps working.
"""

from __future__ import annotations

from typing import Any, Literal

Placement = Literal["both", "system", "user"]


def _wrap(content: Any, before: str, after: str | None) -> Any:
    if isinstance(content, str):
        return f"{before}\n{content}" + (f"\n{after}" if after else "")
    if isinstance(content, list):
        parts = [{"type": "text", "text": before}, *content]
        return parts + [{"type": "text", "text": after}] if after else parts
    return content


def inject_chat(payload: dict[str, Any], marker: str, placement: Placement) -> None:
    messages: list[dict[str, Any]] = [dict(m) for m in payload["messages"]]
    if placement in ("both", "system"):
        system = next((m for m in messages if m.get("role") in ("system", "developer")), None)
        if system is None:
            messages.insert(0, {"role": "system", "content": marker})
        else:
            system["content"] = _wrap(system.get("content"), marker, marker)
    if placement in ("both", "user"):
        for message in messages:
            if message.get("role") == "user":
                message["content"] = _wrap(message.get("content"), marker, None)
    payload["messages"] = messages


def inject_completion(payload: dict[str, Any], marker: str) -> None:
    # Only in front: text after the prompt would change what the model continues. Token-id prompts are left as
    # they are (the gateway would have to tokenize the marker in the backend's vocabulary).
    if isinstance(payload.get("prompt"), str):
        payload["prompt"] = f"{marker}\n{payload['prompt']}"
