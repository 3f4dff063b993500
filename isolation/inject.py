"""Where a tenant's canary marker goes in a request.

A leak returns fragments of cache blocks, and only a whole marker inside a fragment can be recognised; prompt
fingerprints recognise the rest of a prompt's text (fingerprints.py). Placements:
- `start`: once, at the start of the conversation: the system text's, or without one (or where the model's chat
  template writes the system text later, in front of the last user turn, as Mistral's do) the first user turn's.
  Where fingerprints see least: the first blocks are template and system text, which tenants share.
- `turns` (the default): there, and at the start of every later user turn, where a conversation's short turns
  stand between template and tool-call JSON that fingerprints see little of.
- `system`: at both ends of the system text (a system message of its own when there is none); `user`: at the start of
  every user turn; `both`: the two (what the gateway did before markers were measured).
Every placement depends only on a turn's role and place, never on which turn is last, and the marker is stable
within an epoch: the prompt of a conversation's next request starts with this one's, so the tenant's own prefix
caching keeps working.
"""

from __future__ import annotations

from typing import Any, Literal

from isolation.tokens import ChatTemplateError, ModelTokenizer

MarkerPlacement = Literal["start", "turns", "system", "user", "both"]


def _wrap(content: Any, before: str, after: str | None) -> Any:
    if isinstance(content, str):
        return f"{before}\n{content}" + (f"\n{after}" if after else "")
    if isinstance(content, list):
        parts = [{"type": "text", "text": before}, *content]
        return parts + [{"type": "text", "text": after}] if after else parts
    return content


def system_leads(tokenizer: ModelTokenizer) -> bool:
    """Whether the model's chat template writes the system text before the first user turn (most do; Mistral's write
    it in front of the last user turn, where a marker would move every turn). True when it cannot tell."""
    probe = [
        {"role": "system", "content": "probe0system"},
        {"role": "user", "content": "probe1user"},
        {"role": "assistant", "content": "probe2assistant"},
        {"role": "user", "content": "probe3user"},
    ]
    try:
        rendered = tokenizer.render_chat(probe)
    except ChatTemplateError:
        return True
    system, user = rendered.find("probe0system"), rendered.find("probe1user")
    return user < 0 or 0 <= system < user


def inject_chat(payload: dict[str, Any], marker: str, placement: MarkerPlacement, system_first: bool = True) -> None:
    """Plant the marker in a chat request, in place; `system_first` as system_leads says of the model's template."""
    messages: list[dict[str, Any]] = [dict(m) for m in payload["messages"]]
    system = next((m for m in messages if m.get("role") in ("system", "developer")), None)
    users = [m for m in messages if m.get("role") == "user"]
    if placement in ("both", "system"):
        if system is None:
            messages.insert(0, {"role": "system", "content": marker})
        else:
            system["content"] = _wrap(system.get("content"), marker, marker)
    elif placement in ("start", "turns"):
        if system is not None and (system_first or not users):
            system["content"] = _wrap(system.get("content"), marker, None)
        elif users:
            users[0]["content"] = _wrap(users[0].get("content"), marker, None)
        else:
            messages.insert(0, {"role": "system", "content": marker})
    marked = users if placement in ("both", "user") else users[1:] if placement == "turns" else []
    for message in marked:
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
