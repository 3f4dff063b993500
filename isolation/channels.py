"""What an OpenAI-style answer may carry to a tenant, field by field, and the pruning that holds answers to it.

docs/channels.md is the inventory in prose. Every field an engine can fill is a channel: texts are scanned by the
guard (guard.py); a field outside the inventory may be absent or null, and any other value of it is removed before
the answer goes out, since it could carry text, token ids or bytes that no scan looks at (vLLM's prompt_token_ids,
prompt_logprobs, token_ids, prompt_text, kv_transfer_params, routed_experts... and whatever a later version adds).
Numbers must be numbers. A logprob's `bytes` is rewritten from the token text it stands for (vLLM derives it the
same way), so it carries nothing the scan did not see.

Pruning leaves an answer that already fits untouched, so the relay only re-serializes what changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

TOP = frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier"})
CHOICE = frozenset({"index", "message", "delta", "text", "logprobs", "finish_reason", "stop_reason"})
MESSAGE = frozenset({"role", "content", "reasoning", "reasoning_content", "refusal", "tool_calls"})
TOOL_CALL = frozenset({"index", "id", "type", "function"})
FUNCTION = frozenset({"name", "arguments"})
CHAT_LOGPROBS = frozenset({"content"})
ENTRY = frozenset({"token", "logprob", "bytes", "top_logprobs"})
ALTERNATIVE = frozenset({"token", "logprob", "bytes"})
COMPLETION_LOGPROBS = frozenset({"text_offset", "token_logprobs", "tokens", "top_logprobs"})
USAGE = frozenset({"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"})
PROMPT_DETAILS = frozenset({"cached_tokens"})

# Texts that grow over a stream, by where they sit: a choice's message or delta, or the choice itself.
MESSAGE_TEXTS = ("content", "reasoning", "reasoning_content", "refusal")
CHOICE_TEXTS = ("text",)
# Strings that stand alone (ids, names of things, reasons): scanned whole wherever they appear.
TOP_STRINGS = ("id", "object", "model", "system_fingerprint", "service_tier")
CHOICE_STRINGS = ("finish_reason", "stop_reason")


# Every helper below removes what does not fit and appends what it removed to `removed`: the guard scans that too,
# so an engine that leaks through a field the gateway drops is still an isolation event.


def _prune(holder: dict[str, Any], allowed: frozenset[str], removed: list[Any]) -> None:
    for key in holder.keys() - allowed:
        if holder[key] is not None:
            removed.append(holder.pop(key))


def _typed(holder: dict[str, Any], kinds: tuple[type, ...], removed: list[Any], *names: str) -> None:
    """Null every named field whose value is not of one of these types (nor null)."""
    for name in names:
        value = holder.get(name)
        if value is not None and type(value) not in kinds:
            removed.append(value)
            holder[name] = None


NUMBER = (int, float)
TEXT = (str,)


def _objects(holder: dict[str, Any], name: str, removed: list[Any]) -> list[dict[str, Any]]:
    """The objects listed under `name`; anything else there (a non-list, a non-object item) is removed."""
    value = holder.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        removed.append(value)
        holder[name] = []
        return []
    kept = [item for item in value if isinstance(item, dict)]
    if len(kept) != len(value):
        removed.extend(item for item in value if not isinstance(item, dict))
        holder[name] = kept
    return kept


def prune(answer: dict[str, Any]) -> list[Any]:
    """Remove, in place, everything the inventory does not allow; returns what was removed (empty: untouched)."""
    removed: list[Any] = []
    _prune(answer, TOP, removed)
    _typed(answer, NUMBER, removed, "created")
    _typed(answer, TEXT, removed, *TOP_STRINGS)
    usage = answer.get("usage")
    if usage is not None:
        _prune_usage(answer, usage, removed)
    for choice in _objects(answer, "choices", removed):
        _prune_choice(choice, removed)
    return removed


def _prune_usage(answer: dict[str, Any], usage: Any, removed: list[Any]) -> None:
    if not isinstance(usage, dict):
        removed.append(answer.pop("usage"))
        return
    _prune(usage, USAGE, removed)
    _typed(usage, (int,), removed, "prompt_tokens", "completion_tokens", "total_tokens")
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        _prune(details, PROMPT_DETAILS, removed)
        _typed(details, (int,), removed, "cached_tokens")
    else:
        _typed(usage, (dict,), removed, "prompt_tokens_details")


def _prune_choice(choice: dict[str, Any], removed: list[Any]) -> None:
    _prune(choice, CHOICE, removed)
    _typed(choice, (int,), removed, "index")
    _typed(choice, TEXT, removed, "finish_reason", "text")
    _typed(choice, (int, str), removed, "stop_reason")
    for name in ("message", "delta"):
        _typed(choice, (dict,), removed, name)
        if isinstance(message := choice.get(name), dict):
            _prune_message(message, removed)
    _typed(choice, (dict,), removed, "logprobs")
    if isinstance(logprobs := choice.get("logprobs"), dict):
        _prune_logprobs(logprobs, removed)


def _prune_message(message: dict[str, Any], removed: list[Any]) -> None:
    _prune(message, MESSAGE, removed)
    _typed(message, TEXT, removed, "role", *MESSAGE_TEXTS)
    for call in _objects(message, "tool_calls", removed):
        _prune(call, TOOL_CALL, removed)
        _typed(call, (int,), removed, "index")
        _typed(call, TEXT, removed, "id", "type")
        _typed(call, (dict,), removed, "function")
        if isinstance(function := call.get("function"), dict):
            _prune(function, FUNCTION, removed)
            _typed(function, TEXT, removed, *FUNCTION)


def _prune_logprobs(logprobs: dict[str, Any], removed: list[Any]) -> None:
    if "tokens" in logprobs:
        _prune_completion_logprobs(logprobs, removed)
        return
    _prune(logprobs, CHAT_LOGPROBS, removed)
    for entry in _objects(logprobs, "content", removed):
        _prune_entry(entry, ENTRY, removed)
        for alternative in _objects(entry, "top_logprobs", removed):
            _prune_entry(alternative, ALTERNATIVE, removed)


def _prune_entry(entry: dict[str, Any], allowed: frozenset[str], removed: list[Any]) -> None:
    _prune(entry, allowed, removed)
    _typed(entry, NUMBER, removed, "logprob")
    token = entry.get("token")
    if not isinstance(token, str):
        removed.append(token)
        entry["token"] = token = ""
    if entry.get("bytes") is not None:
        # Rewritten, not trusted: the token's own bytes, as vLLM computes them (a partial UTF-8 token is U+FFFD).
        encoded = list(token.encode("utf-8", errors="replace"))
        if entry["bytes"] != encoded:
            removed.append(entry["bytes"])
            entry["bytes"] = encoded


def _prune_completion_logprobs(logprobs: dict[str, Any], removed: list[Any]) -> None:
    _prune(logprobs, COMPLETION_LOGPROBS, removed)
    for name, kinds in (("tokens", TEXT), ("text_offset", NUMBER), ("token_logprobs", NUMBER)):
        values = logprobs.get(name)
        if values is None:
            continue
        if not isinstance(values, list):
            removed.append(values)
            logprobs[name] = values = []
        for position, value in enumerate(values):
            if type(value) not in kinds and (value is not None or kinds is TEXT):
                removed.append(value)
                values[position] = "" if kinds is TEXT else None
    if logprobs.get("top_logprobs") is not None and not isinstance(logprobs["top_logprobs"], list):
        removed.append(logprobs.pop("top_logprobs"))
    steps = _list(logprobs.get("top_logprobs"))
    for position, step in enumerate(steps):
        if step is not None and not (isinstance(step, dict) and all(type(v) in NUMBER for v in step.values())):
            removed.append(step)
            steps[position] = None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def texts(choice: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(stream key, the dict holding a text, the text's key) for every growing text of one (pruned) choice."""
    for name in CHOICE_TEXTS:
        if isinstance(choice.get(name), str):
            yield name, choice, name
    for holder in (choice.get("delta"), choice.get("message")):
        if not isinstance(holder, dict):
            continue
        for name in MESSAGE_TEXTS:
            if isinstance(holder.get(name), str):
                yield name, holder, name
        for position, call in enumerate(holder.get("tool_calls") or ()):
            function = call.get("function")
            if isinstance(function, dict):
                slot = f"tool:{call.get('index', position)}"
                for name in FUNCTION:
                    if isinstance(function.get(name), str):
                        yield f"{slot}:{name}", function, name


def strings(answer: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """(holder, key) of every string that stands alone in a (pruned) answer: ids, model, roles, reasons."""
    for name in TOP_STRINGS:
        if isinstance(answer.get(name), str):
            yield answer, name
    for choice in answer.get("choices") or ():
        for name in CHOICE_STRINGS:
            if isinstance(choice.get(name), str):
                yield choice, name
        for holder in (choice.get("delta"), choice.get("message")):
            if not isinstance(holder, dict):
                continue
            if isinstance(holder.get("role"), str):
                yield holder, "role"
            for call in holder.get("tool_calls") or ():
                for name in ("id", "type"):
                    if isinstance(call.get(name), str):
                        yield call, name


# Token-level fields: per position, the chosen token and its alternatives (chat: logprobs.content[]; completions:
# the parallel lists of logprobs). Each sequence is a stream of its own for the scanner: "lp" the chosen tokens,
# "lp<r>" the alternatives of rank r.


def token_streams(logprobs: dict[str, Any]) -> dict[str, list[str]]:
    """For each token-level stream, one text per position of these (pruned) logprobs."""
    if "tokens" in logprobs:
        chosen: list[str] = logprobs["tokens"]
        steps = [list(step) if step else [] for step in _list(logprobs.get("top_logprobs"))]
    else:
        entries = logprobs.get("content") or []
        chosen = [entry["token"] for entry in entries]
        steps = [[alt["token"] for alt in entry.get("top_logprobs") or ()] for entry in entries]
    streams = {"lp": chosen}
    for position, alternatives in enumerate(steps):
        for rank, token in enumerate(alternatives):
            streams.setdefault(f"lp{rank}", [""] * len(chosen))[position] = token
    return streams


def positions(logprobs: dict[str, Any]) -> int:
    return len(logprobs["tokens"] if "tokens" in logprobs else logprobs.get("content") or ())


def _parallel(logprobs: dict[str, Any]) -> tuple[str, ...]:
    return tuple(k for k in COMPLETION_LOGPROBS if k in logprobs) if "tokens" in logprobs else ("content",)


def join(earlier: dict[str, Any], later: dict[str, Any] | None) -> dict[str, Any]:
    """One event's logprobs followed by a later one's (positions in order)."""
    if later is None:
        return earlier
    return {**later, **{k: _list(earlier.get(k)) + _list(later.get(k)) for k in _parallel(later)}}


def drop(logprobs: dict[str, Any], dropped: set[int]) -> None:
    """Remove these positions, in place."""
    if dropped:
        for key in _parallel(logprobs):
            logprobs[key] = [item for at, item in enumerate(_list(logprobs.get(key))) if at not in dropped]
