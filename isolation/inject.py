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


def inject_completion(payload: dict[str, Any], marker: str) -> bool:
    """Put the marker in front of a text prompt; False when nothing was injected.

    Only in front: text after the prompt would change what the model continues. Token-id prompts are left as
    they are (the gateway would have to tokenize the marker in the backend's vocabulary).
    """
    if not isinstance(payload.get("prompt"), str):
        return False
    payload["prompt"] = completion_prefix(marker) + payload["prompt"]
    return True


def completion_prefix(marker: str) -> str:
    """What inject_completion puts in front of a text prompt: an echo of the prompt starts with it."""
    return f"{marker}\n"


def hide_injected(usage: dict[str, Any], injected: int) -> None:
    """Take the injected tokens out of an answer's usage, in place: the tenant neither sees nor pays for them.

    Cached prompt tokens are a prefix of the sent prompt, which holds the system text's marker (and the markers of
    earlier turns): they are taken out of the cached count too, and it never exceeds the tenant's prompt.
    """
    prompt = usage.get("prompt_tokens")
    if not injected or not isinstance(prompt, int):
        return
    usage["prompt_tokens"] = own = max(0, prompt - injected)
    if isinstance(usage.get("total_tokens"), int):
        usage["total_tokens"] -= prompt - own
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        details["cached_tokens"] = min(own, max(0, details["cached_tokens"] - injected))
