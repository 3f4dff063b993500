"""The answer's inventory (isolation/channels.py) and the guard on every channel of it, without HTTP: what pruning
keeps and removes, and that logprobs, alternatives, tool calls and stray fields are scanned and held like
content."""

from __future__ import annotations

import copy
import unicodedata
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolation import channels
from isolation.channels import prune, token_streams
from isolation.guard import Leak, LeakBlocked, OutputGuard
from isolation.leaks import LeakPolicy
from isolation.markers import MarkerRegistry
from isolation.scanner import normalize
from tests.unit.test_scanner import EPOCH, Leaks, registry_at

Chunk = dict[str, Any]


@pytest.fixture
def registry() -> MarkerRegistry:
    return registry_at(tenants=("alice", "bob"))


def guard_for(
    registry: MarkerRegistry, policy: LeakPolicy = LeakPolicy.BLOCK, decode: Any = None
) -> tuple[OutputGuard, Leaks]:
    leaks = Leaks()
    return OutputGuard(registry, "alice", policy, leaks, decode=decode), leaks


def entry(token: str, alternatives: list[str] | None = None) -> dict[str, Any]:
    alts = [{"token": t, "logprob": -1.0 - n, "bytes": list(t.encode())} for n, t in enumerate(alternatives or [])]
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": alts}


def chat_chunk(content: str | None, tokens: list[str], alternatives: list[list[str]] | None = None) -> Chunk:
    entries = [entry(t, (alternatives or [[]] * len(tokens))[n]) for n, t in enumerate(tokens)]
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": {"content": entries}, "finish_reason": None}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}


def closing_chunk() -> Chunk:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}


async def relay(guard: OutputGuard, chunks: list[Chunk]) -> tuple[str, list[dict[str, Any]]]:
    """Run chunks through the guard as the relay does; (the content, the logprob entries) the tenant reads."""
    content, entries = "", []
    for chunk in chunks:
        await guard.check_removed(prune(chunk))
        await guard.check_chunk(chunk)
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            entries += (choice.get("logprobs") or {}).get("content") or []
    return content, entries


def tokens_of(entries: list[dict[str, Any]]) -> str:
    return "".join(e["token"] for e in entries)


# --- pruning ------------------------------------------------------------------------------------------------------


def vllm_chat_body() -> dict[str, Any]:
    message = {"role": "assistant", "content": "hi", "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "tool_calls": [], "reasoning": None}  # fmt: skip
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
              "token_ids": None}  # fmt: skip
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
            "service_tier": None, "system_fingerprint": None, "prompt_logprobs": None, "prompt_token_ids": None,
            "kv_transfer_params": None, "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
            "prompt_tokens_details": None}}  # fmt: skip


def test_an_answer_that_fits_the_inventory_loses_only_vllms_null_extras_and_reports_nothing() -> None:
    body = vllm_chat_body()
    before = copy.deepcopy(body)
    assert prune(body) == []
    for level, nulls in ((before, channels.TOP_NULLS), (before["choices"][0], channels.CHOICE_NULLS),
                         (before["choices"][0]["message"], channels.MESSAGE_NULLS)):  # fmt: skip
        for name in nulls & level.keys():
            del level[name]
    assert body == before
    assert "service_tier" not in body and "token_ids" not in body["choices"][0], "what the SDKs' types do not declare"


def test_fields_outside_the_inventory_are_removed_and_handed_over() -> None:
    body = vllm_chat_body()
    body["prompt_token_ids"] = [1, 2, 3]
    body["kv_transfer_params"] = {"remote_block_ids": [7]}
    body["brand_new_field"] = "text"
    body["choices"][0]["token_ids"] = [4]
    body["choices"][0]["message"]["audio"] = {"data": "x"}
    body["choices"][0]["message"]["content"] = 5  # a text field must be a string
    body["created"] = "yesterday"  # a number must be a number
    body["usage"]["completion_tokens_details"] = {"note": "x"}
    body["object"] = "chat.completion, and a story"  # a closed set of values: no channel
    removed = prune(body)
    assert sorted(map(str, removed)) == sorted(
        map(
            str,
            [
                ("answer.prompt_token_ids", [1, 2, 3]),
                ("answer.kv_transfer_params", {"remote_block_ids": [7]}),
                ("answer.<name>", "brand_new_field"),  # a name no table has: scanned too
                ("answer.brand_new_field", "text"),
                ("choice.token_ids", [4]),
                ("message.audio", {"data": "x"}),
                ("message.content", 5),
                ("answer.created", "yesterday"),
                ("usage.completion_tokens_details", {"note": "x"}),
                ("answer.object", "chat.completion, and a story"),
            ],
        )
    )
    assert "prompt_token_ids" not in body and "kv_transfer_params" not in body and "brand_new_field" not in body
    assert body["choices"][0]["message"]["content"] is None and body["created"] is None
    assert "completion_tokens_details" not in body["usage"]


# Every name the inventory knows, at any level (and the null fields vLLM sends): pruning keeps them, and only them.
KNOWN_NAMES = frozenset().union(
    channels.TOP,
    channels.CHOICE,
    channels.MESSAGE,
    channels.TOOL_CALL,
    channels.FUNCTION,
    channels.USAGE,
    channels.PROMPT_DETAILS,
    channels.ENTRY,
    channels.COMPLETION_LOGPROBS,
    channels.TOP_NULLS,
    channels.CHOICE_NULLS,
    channels.MESSAGE_NULLS,
    channels.USAGE_NULLS,
)
# Whatever JSON an engine sends: its field names drawn from the inventory and beyond, its values any JSON at all,
# nested anywhere.
NAMES = st.sampled_from(sorted(KNOWN_NAMES)) | st.text(max_size=6)
CLOSED = sorted(
    channels.OBJECTS | channels.ROLES | channels.FINISH_REASONS | channels.SERVICE_TIERS | channels.TOOL_TYPES
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.sampled_from(CLOSED) | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES, inner, max_size=6))


def strings(value: Any) -> set[str]:
    """Every string in a JSON value, its object keys included (but the inventory's own names)."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return {k for k in value if k not in KNOWN_NAMES}.union(*map(strings, value.values()))
    if isinstance(value, list):
        return set().union(*map(strings, value))
    return set()


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(NAMES, JSON, max_size=9), st.booleans())
async def test_any_answer_is_pruned_to_the_inventory_without_losing_a_text(answer: Chunk, streamed: bool) -> None:
    """No JSON an engine can send makes pruning or the guard fail (a list where a closed set of strings belongs once
    did); what pruning keeps fits the inventory, so a second pass removes nothing; and every text the engine sent,
    a field's name included, is either kept (the guard reads it) or handed over as removed (the guard scans it)."""
    sent = copy.deepcopy(answer)
    removed = prune(answer)
    assert prune(answer) == [], "what pruning keeps fits the inventory"
    assert strings(sent) <= strings(answer) | strings([[where, value] for where, value in removed])
    guard, _ = guard_for(registry_at(tenants=("alice", "bob")))
    await guard.check_removed(removed)
    await (guard.check_chunk(answer) if streamed else guard.check_body(answer))
    await guard.closing()


def test_logprob_bytes_are_derived_from_the_token() -> None:
    chunk = chat_chunk("é", ["é"], [["é", "e"]])
    chunk["choices"][0]["logprobs"]["content"][0]["bytes"] = list(b"CNRY secret")
    chunk["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["bytes"] = [1, 2]
    removed = prune(chunk)
    assert removed == [("entry.bytes", list(b"CNRY secret")), ("alternative.bytes", [1, 2])]
    first = chunk["choices"][0]["logprobs"]["content"][0]
    assert first["bytes"] == list("é".encode()) and first["top_logprobs"][1]["bytes"] == [ord("e")]


def test_completion_logprobs_are_typed() -> None:
    choice = {"index": 0, "text": "a", "logprobs": {"tokens": ["a", 7], "token_logprobs": [-1.0, "x"],
              "top_logprobs": [{"a": -1.0}, {"b": "high"}], "text_offset": [0, 1], "extra": "y"}}  # fmt: skip
    answer = {"choices": [choice]}
    removed = [value for _, value in prune(answer)]
    assert sorted(map(str, removed)) == sorted(map(str, [7, "x", {"b": "high"}, "y", "extra"]))  # "extra": the name
    assert choice["logprobs"] == {"tokens": ["a", ""], "token_logprobs": [-1.0, None],
                                  "top_logprobs": [{"a": -1.0}, None], "text_offset": [0, 1]}  # fmt: skip


def test_token_streams_are_the_chosen_tokens_and_each_rank() -> None:
    chat = chat_chunk(None, ["a", "b"], [["a", "x"], ["b"]])["choices"][0]["logprobs"]
    assert token_streams(chat) == {"lp": ["a", "b"], "lp0": ["a", "b"], "lp1": ["x", ""]}
    completion = {"tokens": ["a", "b"], "top_logprobs": [{"a": -1, "z": -2}, None]}
    assert token_streams(completion) == {"lp": ["a", "b"], "lp0": ["a", ""], "lp1": ["z", ""]}


# --- the guard on token-level channels ------------------------------------------------------------------------------


def pieces(text: str, size: int) -> list[str]:
    return [text[at : at + size] for at in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7])
async def test_a_marker_only_in_logprobs_is_blocked_before_any_of_it_goes_out(
    registry: MarkerRegistry, size: int
) -> None:
    guard, leaks = guard_for(registry)
    leaked = f"the plan {registry.marker('bob')} and more"
    released: list[dict[str, Any]] = []
    with pytest.raises(LeakBlocked):
        for piece in pieces(leaked, size):
            chunk = chat_chunk("fine ", [piece])
            await guard.check_chunk(chunk)
            released += (chunk["choices"][0]["logprobs"] or {}).get("content") or []
    assert b"cnry" not in normalize(tokens_of(released))
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


@pytest.mark.parametrize("rank", [0, 2])
async def test_a_marker_in_one_rank_of_alternatives_is_a_leak(registry: MarkerRegistry, rank: int) -> None:
    guard, leaks = guard_for(registry)
    with pytest.raises(LeakBlocked):
        for piece in pieces(f"x {registry.marker('bob')} y", 2):
            alternatives = ["p", "q", "r"]
            alternatives[rank] = piece
            await guard.check_chunk(chat_chunk("z", ["z"], [alternatives]))
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_logprobs_wait_with_the_content_they_mirror(registry: MarkerRegistry) -> None:
    guard, _ = guard_for(registry)
    first = chat_chunk("tic", ["tic"])
    await guard.check_chunk(first)
    # "c" could start a marker: it is held back, and so is the token that carries it.
    assert first["choices"][0]["delta"]["content"] == "ti"
    assert first["choices"][0]["logprobs"] is None
    second = chat_chunk(" tab", [" tab"])
    await guard.check_chunk(second)
    assert second["choices"][0]["delta"]["content"] == "c tab"
    assert tokens_of(second["choices"][0]["logprobs"]["content"]) == "tic tab"


async def test_held_logprobs_go_out_with_the_closing_chunk(registry: MarkerRegistry) -> None:
    guard, _ = guard_for(registry)
    content, entries = await relay(guard, [chat_chunk("etc", ["etc"]), closing_chunk()])
    assert content == "etc" and tokens_of(entries) == "etc"


@settings(max_examples=150, deadline=None)
@given(
    before=st.text(alphabet="abc xyz.\n", max_size=20),
    after=st.text(alphabet="abc xyz.\n", max_size=20),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40),
)
async def test_own_marker_leaves_neither_content_nor_logprobs(before: str, after: str, cuts: list[int]) -> None:
    registry = registry_at(tenants=("alice", "bob"))
    guard, leaks = guard_for(registry)
    mine = registry.marker("alice")
    # Tokens as an engine makes them: the marker is tokens of its own, cut anywhere inside.
    tokens = [*pieces(before, 3), *_cut(mine, cuts), *pieces(after, 3)]
    chunks = [chat_chunk(token, [token]) for token in tokens if token] + [closing_chunk()]
    content, entries = await relay(guard, chunks)
    assert content == before + after
    assert tokens_of(entries) == before + after, "the marker's positions are gone, the rest is in order"
    assert leaks.found == []


def _cut(text: str, cuts: list[int]) -> list[str]:
    out, at = [], 0
    for size in cuts:
        if at >= len(text):
            break
        out.append(text[at : at + size])
        at += size
    if at < len(text):
        out.append(text[at:])
    return out


async def test_completion_logprobs_and_echo(registry: MarkerRegistry) -> None:
    mine = registry.marker("alice")
    guard = OutputGuard(registry, "alice", LeakPolicy.BLOCK, Leaks(), echo_prefix=f"{mine}\n")
    logprobs = {"tokens": [mine[:9], mine[9:], "\nHi"], "token_logprobs": [-1, -1, -1], "text_offset": [0, 9, 25],
                "top_logprobs": [{mine[:9]: -1}, {mine[9:]: -1}, {"\nHi": -1}]}  # fmt: skip
    chunk = {"choices": [{"index": 0, "text": f"{mine}\nHi there", "logprobs": logprobs, "finish_reason": "stop"}]}
    await guard.check_chunk(chunk)
    choice = chunk["choices"][0]
    assert choice["text"] == "Hi there"
    assert choice["logprobs"]["tokens"] == ["\nHi"] and choice["logprobs"]["top_logprobs"] == [{"\nHi": -1}]
    assert choice["logprobs"]["text_offset"] == [25]


async def test_tool_call_names_and_stray_strings_are_scanned(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry)
    marker = registry.marker("bob")
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": marker[:10]}}
    await guard.check_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    with pytest.raises(LeakBlocked):
        call = {"index": 0, "function": {"name": marker[10:]}}
        await guard.check_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    for stray in ({"id": f"chatcmpl-{marker}"}, {"choices": [{"index": 0, "stop_reason": marker.lower()}]}):
        guard, leaks = guard_for(registry)
        with pytest.raises(LeakBlocked):
            await guard.check_chunk(stray)
        assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


@pytest.mark.parametrize("name", ["id", "model", "system_fingerprint"])
async def test_the_envelope_keeps_its_first_value_so_nothing_can_be_spread_over_it(
    registry: MarkerRegistry, name: str
) -> None:
    guard, leaks = guard_for(registry)
    marker = registry.marker("bob")
    first = {name: marker[:3], "choices": []}
    await guard.check_chunk(first)
    assert first[name] == marker[:3]  # "CNR": nothing yet
    with pytest.raises(LeakBlocked):
        for piece in pieces(marker[3:], 3):
            chunk = {name: piece, "choices": []}
            await guard.check_chunk(chunk)
            assert chunk[name] == marker[:3], "a value that changes mid-stream never goes out"
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_a_stop_reason_is_one_of_the_requests_stop_strings(registry: MarkerRegistry) -> None:
    guard = OutputGuard(registry, "alice", LeakPolicy.BLOCK, Leaks(), stops=frozenset({"END"}), choices=3)
    kept = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]}
    other = {"choices": [{"index": 1, "delta": {}, "finish_reason": "stop", "stop_reason": "something else"}]}
    token = {"choices": [{"index": 2, "delta": {}, "finish_reason": "stop", "stop_reason": 128009}]}
    for chunk in (kept, other, token):
        await guard.check_chunk(chunk)
    assert [c["choices"][0]["stop_reason"] for c in (kept, other, token)] == ["END", None, 128009]


async def test_what_pruning_removed_is_scanned_too(registry: MarkerRegistry) -> None:
    marker = registry.marker("bob")
    ids = {marker: [9, 9, 9]}

    async def decode(tokens: list[int]) -> str:
        return next(m for m, i in ids.items() if i == tokens)

    guard, leaks = guard_for(registry, decode=decode)
    body = vllm_chat_body()
    body["prompt_token_ids"] = [9, 9, 9]
    with pytest.raises(LeakBlocked):
        await guard.check_removed(prune(body))
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]
    guard, _ = guard_for(registry)
    with pytest.raises(LeakBlocked):
        await guard.check_removed([("x", {"nested": [list(f"..{marker}..".encode())]})])
    # A dropped field spread over the chunks of a stream is read as one stream: text, and bytes.
    for spread in ([("x", piece) for piece in pieces(marker, 2)], [("y", list(p.encode())) for p in pieces(marker, 5)]):
        guard, _ = guard_for(registry)
        with pytest.raises(LeakBlocked):
            for removed in spread:
                await guard.check_removed([removed])
    guard, _ = guard_for(registry)
    await guard.check_removed([("z", [1, 2, 300]), ("z", {"k": None}), ("z", 4.5)])  # nothing text-like


@pytest.mark.parametrize("form", ["NFKC-fullwidth", "mathematical", "accented"])
async def test_look_alike_letters_are_folded(registry: MarkerRegistry, form: str) -> None:
    marker = registry.marker("bob")
    if form == "NFKC-fullwidth":
        text = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in marker)
    elif form == "mathematical":
        text = "".join(chr(0x1D41A + ord(c) - ord("a")) if c.islower() else c for c in marker)
    else:
        text = "".join(unicodedata.normalize("NFC", c + "\u0301") if c.isalpha() else c for c in marker)
    assert text != marker and normalize(text) == normalize(marker)
    guard, leaks = guard_for(registry)
    with pytest.raises(LeakBlocked):
        await guard.check_body({"choices": [{"index": 0, "message": {"content": f"see {text}"}}]})
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]
