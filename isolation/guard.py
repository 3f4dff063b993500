"""Canary checks on everything an OpenAI-style answer carries, streamed or whole (docs/channels.md).

An answer is pruned to the fields of the inventory first (channels.prune). What remains is scanned, in three kinds:
- texts that grow over a stream — each choice's content, reasoning, refusal, completion text, tool-call names and
  arguments — each a stream of its own, with the scanner's minimal hold-back (a marker split across chunks of
  one field is found; fields never run into each other);
- token-level fields — each choice's chosen logprob tokens, and the alternatives of each rank — each sequence a
  stream of its own too. A choice's logprobs are atomic per position, so they are never split: an event's
  logprobs go out only once no stream that the event wrote holds anything back, and are otherwise joined to a
  later event's. Nothing of a held tail leaves in another field (the token that mirrors held content waits with
  it);
- every other string (ids, model, roles, finish and stop reasons): whole, on its own.
The tenant's own marker is stripped (and logprob positions overlapping it are removed); another tenant's is a
leak, handled by the deployment's policy. A completion echo's copy of the injected prefix is removed first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from isolation.channels import drop, join, positions, strings, texts, token_streams
from isolation.leaks import REDACTED, LeakPolicy
from isolation.markers import MarkerRegistry, Owner
from isolation.scanner import Hit, StreamScanner, apply_edits

LeakHandler = Callable[[Owner], Awaitable[None]]
Decode = Callable[[list[int]], str]  # the model's tokenizer: token ids to text
CLEAN_STRINGS_KEPT = 64


class LeakBlocked(Exception):
    """Another tenant's marker was found and the policy is to block: the answer must not go out."""


def place(choice: dict[str, Any], key: str, text: str) -> None:
    """Append text to one of a streamed choice's texts, by its stream key (channels.texts)."""
    if key == "text":
        choice["text"] = (choice.get("text") or "") + text
        return
    delta = choice.setdefault("delta", {})
    if not key.startswith("tool:"):
        delta[key] = (delta.get(key) or "") + text
        return
    _, index, name = key.split(":")
    calls = delta.setdefault("tool_calls", [])
    call = next((c for c in calls if c.get("index") == int(index)), None)
    if call is None:
        call = {"index": int(index), "function": {}}
        calls.append(call)
    function = call.setdefault("function", {})
    function[name] = (function.get(name) or "") + text


@dataclass
class _Choice:
    """What the guard keeps of one choice between the events of a stream."""

    echo: str  # what is left to strip of the injected prefix that a completion echo repeats
    scanners: dict[str, StreamScanner] = field(default_factory=dict)
    held_logprobs: dict[str, Any] | None = None  # logprobs of earlier events, waiting for a hold to clear
    held_lengths: dict[str, list[int]] = field(default_factory=dict)  # per token stream: text length per position
    dropped: set[int] = field(default_factory=set)  # held positions that overlap a stripped marker

    def scanner(self, key: str) -> StreamScanner:
        scanner = self.scanners.get(key)
        if scanner is None:
            scanner = self.scanners[key] = StreamScanner()
        return scanner


class OutputGuard:
    def __init__(
        self,
        registry: MarkerRegistry,
        tenant: str,
        policy: LeakPolicy,
        on_leak: LeakHandler,
        echo_prefix: str = "",
        decode: Decode | None = None,
    ) -> None:
        self._registry = registry
        self._decode = decode
        self._tenant = tenant
        self._policy = policy
        self._on_leak = on_leak
        self._echo_prefix = echo_prefix
        self._choices: dict[int, _Choice] = {}
        self._clean: set[str] = set()
        self._reported: set[str] = set()
        self._unknown: set[bytes] = set()

    async def check_chunk(self, chunk: dict[str, Any]) -> bool:
        """Scan and edit one streamed chunk (pruned: channels.prune) in place; True when it changed."""
        changed = await self._strings(chunk)
        for choice in chunk.get("choices") or ():
            index = choice.get("index") or 0
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice(self._echo_prefix)
            final = choice.get("finish_reason") is not None
            changed |= await self._choice(state, choice, final)
            if final:
                # Nothing more comes for this choice: what was held goes out with its last chunk, even when that
                # chunk carries none of the fields (OpenAI's closing chunk has `delta: {}`).
                del self._choices[index]
        return changed

    async def check_body(self, body: dict[str, Any]) -> bool:
        """Scan and edit a whole (non-streamed, pruned) answer in place; True when it changed."""
        changed = await self._strings(body)
        for choice in body.get("choices") or ():
            changed |= await self._choice(_Choice(self._echo_prefix), choice, final=True)
        return changed

    def closing(self) -> list[dict[str, Any]]:
        """For a stream that ended without finishing its choices: their held texts and logprobs, as last choices.

        Empties the guard.
        """
        closing = []
        for index, state in self._choices.items():
            choice: dict[str, Any] = {"index": index, "finish_reason": None}
            for key, scanner in state.scanners.items():
                rest = scanner.flush()
                if rest and not key.startswith("lp"):
                    place(choice, key, rest)
            if state.held_logprobs is not None:
                drop(state.held_logprobs, state.dropped)
                choice["logprobs"] = state.held_logprobs
            if len(choice) > 2:
                closing.append(choice)
        self._choices.clear()
        return closing

    async def _choice(self, state: _Choice, choice: dict[str, Any], final: bool) -> bool:
        changed = False
        if state.echo and isinstance(choice.get("text"), str):
            changed = self._strip_echo(state, choice)
        holding = False
        seen = set()
        for key, holder, name in texts(choice):
            scanner = state.scanner(key)
            seen.add(key)
            original = holder[name]
            released = await self._release(scanner, original)
            if final:
                released += scanner.flush()
            holding |= scanner.holding
            if released != original:
                holder[name] = released
                changed = True
        if choice.get("logprobs") is not None or state.held_logprobs is not None:
            changed |= await self._logprobs(state, choice, holding, final)
        if final:
            for key, scanner in state.scanners.items():
                rest = scanner.flush()
                if rest and key not in seen and not key.startswith("lp"):
                    place(choice, key, rest)
                    changed = True
        return changed

    def _strip_echo(self, state: _Choice, choice: dict[str, Any]) -> bool:
        text: str = choice["text"]
        size = min(len(state.echo), len(text))
        if text[:size] != state.echo[:size]:
            state.echo = ""  # not an echo of what was injected: the scan still strips the marker itself
            return False
        choice["text"], state.echo = text[size:], state.echo[size:]
        return size > 0

    async def _logprobs(self, state: _Choice, choice: dict[str, Any], holding: bool, final: bool) -> bool:
        """Scan this event's token-level streams; release the choice's logprobs, or hold them with the held text."""
        new = choice.get("logprobs")
        held = state.held_logprobs
        first = positions(held) if held is not None else 0
        streams = token_streams(new) if new is not None else {}
        for key, pieces in streams.items():
            scanner = state.scanner(key)
            lengths = state.held_lengths.setdefault(key, [0] * first)
            piece = "".join(pieces)
            scan = scanner.scan(piece)
            lengths += [len(p) for p in pieces]
            if scan.hits:
                # Where the scanned text starts among this stream's held positions: after what was released of them.
                start = sum(lengths) - len(scan.text)
                for hit in scan.hits:
                    if await self._verdict(hit) is not None:
                        state.dropped |= _overlapping(lengths, start + hit.start, start + hit.end)
            holding |= scanner.holding
        if new is not None:
            for key, lengths in state.held_lengths.items():
                if key not in streams:  # a rank of alternatives this event did not have
                    lengths += [0] * positions(new)
        joined = new if held is None else join(held, new)
        if holding and not final:
            state.held_logprobs = joined
            choice["logprobs"] = None
            return new is not None
        dropped = state.dropped
        if joined is not None and dropped:
            drop(joined, dropped)
        choice["logprobs"] = joined
        state.held_logprobs, state.held_lengths, state.dropped = None, {}, set()
        return held is not None or bool(dropped)

    async def check_removed(self, removed: list[Any]) -> None:
        """Scan what pruning took out of an answer. It never goes out, but another tenant's marker in it is an engine
        leaking all the same: an isolation event, and under block the whole answer is withheld."""
        for text in self._texts_in(removed):
            await self.check_text(text)

    def _texts_in(self, value: Any) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield str(key)
                yield from self._texts_in(item)
        elif isinstance(value, list) and value and all(type(item) is int for item in value):
            # Bytes or token ids: read both ways.
            if all(0 <= item < 256 for item in value):
                yield bytes(value).decode("utf-8", errors="replace")
            if self._decode is not None:
                try:
                    yield self._decode(value)
                except (OverflowError, TypeError, ValueError):
                    pass  # not ids of this vocabulary
        elif isinstance(value, list):
            for item in value:
                yield from self._texts_in(item)

    async def check_text(self, text: str) -> str:
        """A text that stands on its own (an id, a backend's error message): the tenant's own marker stripped,
        another's handled by policy."""
        scanner = StreamScanner()
        return await self._release(scanner, text) + scanner.flush()

    async def _strings(self, answer: dict[str, Any]) -> bool:
        changed = False
        for holder, name in strings(answer):
            value = holder[name]
            if value in self._clean:
                continue
            checked = await self.check_text(value)
            if checked != value:
                holder[name] = checked
                changed = True
            elif len(self._clean) < CLEAN_STRINGS_KEPT:
                self._clean.add(value)
        return changed

    async def _release(self, scanner: StreamScanner, piece: str) -> str:
        scan = scanner.scan(piece)
        released = scan.text[: scan.release]
        if not scan.hits:
            return released
        edits: list[tuple[Hit, str]] = []
        for hit in scan.hits:
            replacement = await self._verdict(hit)
            if replacement is not None:
                edits.append((hit, replacement))
        return apply_edits(released, edits)

    async def _verdict(self, hit: Hit) -> str | None:
        """What replaces a candidate marker: "" for the tenant's own, REDACTED for another's under redact, None to
        leave it (not a live marker, or the alert policy); raises LeakBlocked under block."""
        if hit.normal in self._unknown:
            return None
        owner = await self._registry.resolve(hit.normal)
        if owner is None:
            # A model can be made to write marker-shaped strings over and over: ask the store once per answer.
            self._unknown.add(hit.normal)
            return None
        if owner.tenant == self._tenant:
            return ""
        if owner.tenant not in self._reported:  # one event per victim and answer, however often it shows
            self._reported.add(owner.tenant)
            await self._on_leak(owner)
        if self._policy is LeakPolicy.BLOCK:
            raise LeakBlocked
        return REDACTED if self._policy is LeakPolicy.REDACT else None


def _overlapping(lengths: list[int], start: int, end: int) -> set[int]:
    """The positions whose text (lengths per position, in order) overlaps [start, end)."""
    found, at = set(), 0
    for position, length in enumerate(lengths):
        if at < end and start < at + length:
            found.add(position)
        at += length
    return found
