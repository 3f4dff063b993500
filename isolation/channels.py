"""What an OpenAI-style answer may carry to a tenant, field by field, and the pruning that holds answers to it.

docs/channels.md is the inventory in prose. Every field an engine can fill is a channel:
- a field outside the inventory may be absent; null, when vLLM is known to send it so, it is taken out silently (a
  client reading the answer by the SDKs' types meets no field they do not declare); any other value of it is
  removed before the answer goes out, since it could carry text, token ids or bytes that no scan looks at (vLLM's
  prompt_token_ids, prompt_logprobs, token_ids, prompt_text, kv_transfer_params, routed_experts... and whatever a
  later version adds); a name the inventory does not know goes even with a null value, its name scanned;
- a field with a closed set of values (object, role, finish_reason, a tool call's type, service_tier) carries one
  of them, or is removed: it is no channel at all;
- numbers must be numbers, texts must be strings;
- a logprob's `bytes` is rewritten from the token text it stands for (vLLM derives it the same way).
Whatever is removed is handed back with where it was (`Removed`), for the guard to scan anyway: an engine that
leaks through a field the gateway drops is still an isolation event. What stays is scanned by the guard.

Pruning leaves an answer that already fits untouched but for those null fields.
"""

from __future__ import annotations

from typing import Any, Final

OBJECTS = frozenset({"chat.completion", "chat.completion.chunk", "text_completion"})
ROLES = frozenset({"assistant", "user", "system", "developer", "tool"})
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call", "abort", "error"})
SERVICE_TIERS = frozenset({"auto", "default", "flex", "scale", "priority"})
TOOL_TYPES = frozenset({"function"})

NUMBER = (int, float)
TEXT = (str,)
INTEGER = (int,)

# What each level of an answer may hold, field by field: the types its value may have, the closed set of strings it
# may be, or None for an object or a list that the level's own code checks. A name a level does not list goes.
Fields = dict[str, tuple[type, ...] | frozenset[str] | None]
TOP: Fields = {
    "id": TEXT,
    "object": OBJECTS,
    "created": NUMBER,
    "model": TEXT,
    "choices": None,
    "usage": None,
    "system_fingerprint": TEXT,
    "service_tier": SERVICE_TIERS,
}
CHOICE: Fields = {
    "index": INTEGER,
    "message": None,
    "delta": None,
    "text": TEXT,
    "logprobs": None,
    "finish_reason": FINISH_REASONS,
    "stop_reason": (int, str),
}
MESSAGE: Fields = {
    "role": ROLES,
    "content": TEXT,
    "reasoning": TEXT,
    "reasoning_content": TEXT,
    "refusal": TEXT,
    "tool_calls": None,
}
TOOL_CALL: Fields = {"index": INTEGER, "id": TEXT, "type": TOOL_TYPES, "function": None}
FUNCTION: Fields = {"name": TEXT, "arguments": TEXT}
USAGE: Fields = {
    "prompt_tokens": INTEGER,
    "completion_tokens": INTEGER,
    "total_tokens": INTEGER,
    "prompt_tokens_details": None,
}
PROMPT_DETAILS: Fields = {"cached_tokens": INTEGER}
CHAT_LOGPROBS: Fields = {"content": None}
# A logprob entry's fields are checked in one loop over the entries (_prune_entries), not here.
ENTRY: Fields = dict.fromkeys(("token", "logprob", "bytes", "top_logprobs"))
ALTERNATIVE: Fields = dict.fromkeys(("token", "logprob", "bytes"))
COMPLETION_LOGPROBS: Fields = dict.fromkeys(("text_offset", "token_logprobs", "tokens", "top_logprobs"))
# Dropped fields that vLLM 0.32 sends as null (docs/channels.md): null, they are taken out and nothing is reported.
# (`service_tier` too: OpenAI's completions have none, and vLLM never sets it.)
TOP_NULLS = frozenset(
    {
        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
        "service_tier",
    }
)  # fmt: skip
CHOICE_NULLS = frozenset({"token_ids", "routed_experts", "prompt_token_ids", "prompt_logprobs"})
MESSAGE_NULLS = frozenset({"annotations", "audio", "function_call"})
USAGE_NULLS = frozenset({"completion_tokens_details"})

# Texts that grow over a stream, by where they sit: a choice's message or delta, or the choice itself. In the order
# clients show them (reasoning, then the text, as Messages and Responses put their blocks and items), which is the
# order the guard reads them and the order they go out in (`in_order`).
MESSAGE_TEXTS = ("reasoning", "reasoning_content", "content", "refusal")
_SHOWN = {name: rank for rank, name in enumerate(("role", *MESSAGE_TEXTS, "tool_calls"))}
# Strings that stand alone: the same value on every chunk of a stream (the guard holds them to it).
ENVELOPE = ("id", "model", "system_fingerprint")

# (where it was, e.g. "choice.token_ids", and the value) for everything pruning removed.
Removed = list[tuple[str, Any]]


_UNLISTED: Final = frozenset[str]()  # what `fields` gives for a name it does not list


def _fit(
    holder: dict[str, Any], fields: Fields, where: str, removed: Removed, nulls: frozenset[str] = frozenset()
) -> None:
    """Hold one level of an answer to its fields, in place. A listed field of the wrong type, or outside its closed
    set, is nulled. A name not listed goes, even with a null value, and is scanned itself (a field's name is a
    channel as much as its value) — except a field the engine is known to send as null (`nulls`): null, it goes
    unreported. One pass over what the level holds: this runs for every event of every stream."""
    wrong = []
    for key, value in holder.items():
        kind = fields.get(key, _UNLISTED)
        if value is None:
            if kind is _UNLISTED or key in nulls:
                wrong.append(key)
        elif kind is None:
            continue
        elif kind is _UNLISTED:
            wrong.append(key)
        elif type(kind) is frozenset:
            if type(value) is not str or value not in kind:
                wrong.append(key)
        elif type(value) not in kind:
            wrong.append(key)
    for key in wrong:  # in order: a text spread over names is read whole
        value = holder[key]
        if value is None and key in nulls:
            del holder[key]
            continue
        if key in fields:
            removed.append((f"{where}.{key}", value))
            holder[key] = None
            continue
        if key not in nulls:
            removed.append((f"{where}.<name>", key))
        del holder[key]
        if value is not None:
            removed.append((f"{where}.{key}", value))


def _objects(holder: dict[str, Any], name: str, where: str, removed: Removed) -> list[dict[str, Any]]:
    """The objects listed under `name`; anything else there (a non-list, a non-object item) is removed."""
    value = holder.get(name)
    if value is None:
        return []
    if type(value) is not list:
        removed.append((f"{where}.{name}", value))
        holder[name] = []
        return []
    if all(type(item) is dict for item in value):
        return value
    removed.extend((f"{where}.{name}", item) for item in value if type(item) is not dict)
    holder[name] = kept = [item for item in value if type(item) is dict]
    return kept


def prune(answer: dict[str, Any]) -> Removed:
    """Remove, in place, everything the inventory does not allow; returns what was removed (empty: untouched)."""
    removed: Removed = []
    _fit(answer, TOP, "answer", removed, TOP_NULLS)
    usage = answer.get("usage")
    if usage is not None:
        _prune_usage(answer, usage, removed)
    for choice in _objects(answer, "choices", "answer", removed):
        _prune_choice(choice, removed)
    return removed


def _prune_usage(answer: dict[str, Any], usage: Any, removed: Removed) -> None:
    if type(usage) is not dict:
        removed.append(("answer.usage", answer.pop("usage")))
        return
    _fit(usage, USAGE, "usage", removed, USAGE_NULLS)
    details = usage.get("prompt_tokens_details")
    if type(details) is dict:
        _fit(details, PROMPT_DETAILS, "usage.details", removed)
    elif details is not None:
        removed.append(("usage.prompt_tokens_details", details))
        usage["prompt_tokens_details"] = None


def _prune_choice(choice: dict[str, Any], removed: Removed) -> None:
    _fit(choice, CHOICE, "choice", removed, CHOICE_NULLS)
    for name in ("message", "delta"):
        message = choice.get(name)
        if type(message) is dict:
            _prune_message(message, removed)
        elif message is not None:
            removed.append((f"choice.{name}", choice.pop(name)))
    logprobs = choice.get("logprobs")
    if type(logprobs) is dict:
        prune_logprobs(logprobs, removed)
    elif logprobs is not None:
        removed.append(("choice.logprobs", logprobs))
        choice["logprobs"] = None


def _prune_message(message: dict[str, Any], removed: Removed) -> None:
    _fit(message, MESSAGE, "message", removed, MESSAGE_NULLS)
    for call in _objects(message, "tool_calls", "message", removed):
        _fit(call, TOOL_CALL, "tool", removed)
        function = call.get("function")
        if type(function) is dict:
            _fit(function, FUNCTION, "tool.function", removed)
        elif function is not None:
            removed.append(("tool.function", call.pop("function")))


def prune_logprobs(logprobs: dict[str, Any], removed: Removed) -> None:
    if "tokens" in logprobs:
        _prune_completion_logprobs(logprobs, removed)
        return
    _fit(logprobs, CHAT_LOGPROBS, "logprobs", removed)
    _prune_entries(_objects(logprobs, "content", "logprobs", removed), ENTRY, "entry", removed)


def _prune_entries(entries: list[dict[str, Any]], allowed: Fields, where: str, removed: Removed) -> None:
    # One loop, no call per entry: with top_logprobs this runs for every alternative of every token.
    for entry in entries:
        if not entry.keys() <= allowed.keys():
            _fit(entry, allowed, where, removed)
        logprob = entry.get("logprob")
        if logprob is not None and type(logprob) is not float and type(logprob) is not int:
            removed.append((f"{where}.logprob", logprob))
            entry["logprob"] = None
        token = entry.get("token")
        if type(token) is not str:
            removed.append((f"{where}.token", token))
            entry["token"] = token = ""
        raw = entry.get("bytes")
        if raw is not None:
            # Rewritten, not trusted: the token's own bytes, as vLLM computes them (a partial UTF-8 token is U+FFFD).
            encoded = token.encode("utf-8", errors="replace")
            try:
                same = bytes(raw) == encoded
            except (TypeError, ValueError):
                same = False
            if not same:
                removed.append((f"{where}.bytes", raw))
                entry["bytes"] = list(encoded)
        if entry.get("top_logprobs"):
            _prune_entries(_objects(entry, "top_logprobs", "entry", removed), ALTERNATIVE, "alternative", removed)


def _prune_completion_logprobs(logprobs: dict[str, Any], removed: Removed) -> None:
    _fit(logprobs, COMPLETION_LOGPROBS, "logprobs", removed)
    for name, kinds in (("tokens", TEXT), ("text_offset", NUMBER), ("token_logprobs", NUMBER)):
        values = logprobs.get(name)
        if values is None:
            continue
        if type(values) is not list:
            removed.append((f"logprobs.{name}", values))
            logprobs[name] = values = []
        for position, value in enumerate(values):
            if type(value) not in kinds and (value is not None or kinds is TEXT):
                removed.append((f"logprobs.{name}", value))
                values[position] = "" if kinds is TEXT else None
    if logprobs.get("top_logprobs") is not None and type(logprobs["top_logprobs"]) is not list:
        removed.append(("logprobs.top_logprobs", logprobs.pop("top_logprobs")))
    steps = _list(logprobs.get("top_logprobs"))
    for position, step in enumerate(steps):
        if step is not None and not (type(step) is dict and all(type(v) in NUMBER for v in step.values())):
            removed.append(("logprobs.top_logprobs", step))
            steps[position] = None


def _list(value: Any) -> list[Any]:
    return value if type(value) is list else []


def texts(choice: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(stream key, the dict holding a text, the text's key) for every growing text of one (pruned) choice."""
    # A list, not a generator: this runs for every event of every stream, and its one caller wants them all.
    found = [("text", choice, "text")] if type(choice.get("text")) is str else []
    for holder in (choice.get("delta"), choice.get("message")):
        if holder is None:
            continue
        found += [(name, holder, name) for name in MESSAGE_TEXTS if type(holder.get(name)) is str]
        for position, call in enumerate(holder.get("tool_calls") or ()):
            function = call.get("function")
            if function is not None:
                # A whole answer's calls have no index (their position is theirs); an index pruning nulled is one
                # stream for every such call, as a client reading them as one call would join them.
                index = call.get("index", position)
                slot = f"tool:{index if type(index) is int else 'null'}"
                for name in ("name", "arguments"):
                    if type(function.get(name)) is str:
                        found.append((f"{slot}:{name}", function, name))
    return found


def in_order(holder: dict[str, Any]) -> None:
    """A message's (or delta's) fields put, in place, in the order its texts are read and shown: what is joined across
    them is joined in the order it goes out."""
    keys = list(holder)
    ranked = sorted(keys, key=lambda name: _SHOWN.get(name, len(_SHOWN)))
    if ranked != keys:
        items = [(name, holder[name]) for name in ranked]
        holder.clear()
        holder.update(items)


# Token-level fields: per position, the chosen token and its alternatives (chat: logprobs.content[]; completions:
# the parallel lists of logprobs). Each sequence is a stream of its own for the scanner: "lp" the chosen tokens,
# "lp<r>" the alternatives of rank r.


_RANKS = tuple(f"lp{rank}" for rank in range(64))


def token_streams(logprobs: dict[str, Any]) -> dict[str, list[str]]:
    """For each token-level stream, one text per position of these (pruned) logprobs."""
    if "tokens" in logprobs:
        chosen: list[str] = logprobs["tokens"]
        steps = [list(step) if step else [] for step in _list(logprobs.get("top_logprobs"))]
        steps += [[]] * (len(chosen) - len(steps))  # a completion's top_logprobs may be shorter than its tokens
    else:
        entries = logprobs.get("content") or []
        chosen = [entry["token"] for entry in entries]
        steps = [[alt["token"] for alt in entry.get("top_logprobs") or ()] for entry in entries]
    streams = {"lp": chosen}
    if len(steps) == 1:  # a streamed chunk: one position
        for rank, token in enumerate(steps[0]):
            streams[_RANKS[rank] if rank < len(_RANKS) else f"lp{rank}"] = [token]
        return streams
    for rank in range(max(map(len, steps), default=0)):
        key = _RANKS[rank] if rank < len(_RANKS) else f"lp{rank}"
        streams[key] = [alternatives[rank] if rank < len(alternatives) else "" for alternatives in steps]
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
