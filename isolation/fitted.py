"""An answer that already fits the inventory (channels.py), decoded and held to it in one pass of compiled code.

Nearly every event an engine sends fits: pruning it field by field in Python (`channels.prune`) cost ~36 k
instructions an event, more than parsing it. Here the inventory's levels become msgspec types, built from the same
field tables, that reject whatever pruning would change: a name not listed, a value of the wrong type, a string
outside its closed set. Such an answer decodes to None, and the caller takes the general path (orjson, then
`prune`), which removes what does not fit and hands it to the guard. An answer that fits decodes to the dicts orjson
would give, but for the fields vLLM is known to send as null, which are taken out as `prune` takes them out; logprobs
(whose tokens' bytes are rewritten) are left to `channels.prune_logprobs`. Either way the dict that goes to the guard
is the one that goes out, so a difference between the two decoders (a key given twice, say) changes what is read and
sent alike, never one without the other.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from isolation.channels import (
    CHOICE,
    CHOICE_NULLS,
    FUNCTION,
    MESSAGE,
    MESSAGE_NULLS,
    PROMPT_DETAILS,
    TOOL_CALL,
    TOP,
    TOP_NULLS,
    USAGE,
    USAGE_NULLS,
    Fields,
    Removed,
    prune_logprobs,
)

_ANY: Any = object  # a level's own code reads it (logprobs): decoded as orjson would
# orjson reads an integer past 64 bits as a float: such an answer (and any past int64) goes its way, so both agree.
_INT64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def _kind(kind: tuple[type, ...] | frozenset[str] | None, nested: Any) -> Any:
    if kind is None:
        return nested
    if isinstance(kind, frozenset):
        return Literal[tuple(sorted(kind))]
    return Union[tuple(_INT64 if t is int else t for t in kind)]  # noqa: UP007 (a union of a tuple of types, made at run time)


def _level(name: str, fields: Fields, nested: dict[str, Any], nulls: frozenset[str] = frozenset()) -> Any:
    """One level of the inventory as a type: each listed field optional and nullable, each known null only null, no
    other name. A field absent stays absent (UNSET is never encoded)."""
    listed = [
        (key, _kind(kind, nested.get(key)) | None | msgspec.UnsetType, msgspec.UNSET) for key, kind in fields.items()
    ]
    known_nulls = [(key, None | msgspec.UnsetType, msgspec.UNSET) for key in sorted(nulls - fields.keys())]
    return msgspec.defstruct(name, listed + known_nulls, forbid_unknown_fields=True)


_FUNCTION = _level("Function", FUNCTION, {})
_TOOL_CALL = _level("ToolCall", TOOL_CALL, {"function": _FUNCTION})
_MESSAGE = _level("Message", MESSAGE, {"tool_calls": list[_TOOL_CALL]}, MESSAGE_NULLS)  # type: ignore[valid-type]
_CHOICE = _level("Choice", CHOICE, {"message": _MESSAGE, "delta": _MESSAGE, "logprobs": _ANY}, CHOICE_NULLS)
_DETAILS = _level("PromptDetails", PROMPT_DETAILS, {})
_USAGE = _level("Usage", USAGE, {"prompt_tokens_details": _DETAILS}, USAGE_NULLS)
_ANSWER = _level("Answer", TOP, {"choices": list[_CHOICE], "usage": _USAGE}, TOP_NULLS)  # type: ignore[valid-type]
_decoder = msgspec.json.Decoder(_ANSWER)


def fitted(raw: bytes | memoryview) -> tuple[dict[str, Any], Removed] | None:
    """The answer, when it fits the inventory as it stands (the known nulls taken out), and what pruning its
    logprobs removed; None when it must go the general way (orjson, `channels.prune`)."""
    try:
        answer: dict[str, Any] = msgspec.to_builtins(_decoder.decode(raw))
    except msgspec.DecodeError:  # (its ValidationError too: what does not fit)
        return None
    _drop(answer, TOP_NULLS)
    removed: Removed = []
    for choice in answer.get("choices") or ():
        _drop(choice, CHOICE_NULLS)
        for name in ("delta", "message"):
            message = choice.get(name)
            if message is not None:
                _drop(message, MESSAGE_NULLS)
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            if type(logprobs) is not dict:
                return None
            prune_logprobs(logprobs, removed)
    usage = answer.get("usage")
    if usage is not None:
        _drop(usage, USAGE_NULLS)
    return answer, removed


def _drop(level: dict[str, Any], nulls: frozenset[str]) -> None:
    # Only the names listed as known nulls reach here with null: a listed field's null stays, as in `prune`.
    for name in nulls:
        if name in level and level[name] is None:
            del level[name]
