"""Canary checks on everything an OpenAI-style answer carries, streamed or whole (docs/channels.md).

An answer is pruned to the inventory first (channels.prune). What remains is checked, by kind:
- texts that grow over a stream — each choice's content, reasoning, refusal, completion text, tool-call names and
  arguments — each a stream of its own, with the scanner's minimal hold-back (a marker split across chunks of
  one field is found; the edits of one field never cut another), and read again joined as a client could join
  them (joins.py: a marker split across fields or choices is found too);
- token-level fields — each choice's chosen logprob tokens, and the alternatives of each rank — each sequence a
  stream of its own too. A choice's logprobs are atomic per position, so they are never split: an event's
  logprobs go out only once no stream that the event wrote holds anything back, and are otherwise joined to a
  later event's. Nothing of a held tail leaves in another field (the token that mirrors held content waits with
  it);
- strings that stand alone — the envelope's id, model and system_fingerprint, a tool call's id — are scanned
  whole where they first appear, and every later chunk carries that same value: a value an engine changes
  mid-stream (a marker spread over the ids of several chunks) never goes out;
- a string stop_reason must be one of the request's own stop strings.
The tenant's own marker is stripped (and logprob positions overlapping it are removed); another tenant's is a
leak, handled by the deployment's policy. A completion echo's copy of the injected prefix is removed first.
What pruning removed never goes out, but it is scanned all the same (check_removed), each field as a stream of
its own across the answer, so an engine leaking through a field the gateway drops is still a leak event.
"""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from isolation.channels import ENVELOPE, Removed, drop, in_order, join, positions, texts, token_streams
from isolation.escapes import END, has_escape
from isolation.fingerprints import AnswerCheck
from isolation.joins import STANDALONE, Joins
from isolation.leaks import REDACTED, LeakPolicy
from isolation.markers import MarkerRegistry, Owner, normal_form
from isolation.readings import Joined, Reading
from isolation.scanner import Hit, StreamScanner, apply_edits, normalize, scan_all, suspects
from isolation.spelling import ANCHOR
from isolation.suspect_text import SuspectText
from isolation.winnowing import tail_start, words

MARKER = "leak"
FRAGMENT = "fingerprint_leak"


@dataclass(frozen=True)
class Suspect:
    """A fragment of another tenant's prompt in a text of an answer, not yet called a leak: whose, and the grams a
    judge answering the same request on another replica must say for it to be no leak."""

    victim: str
    pair: tuple[int, int]  # the two grams that made it a suspect: a judge's answer must say both


# The victim's grams a judge's answer said too (the answer was induced to say them), or None: a leak.
Judge = Callable[[Suspect], Awaitable[frozenset[int] | None]]


@dataclass(frozen=True)
class Leak:
    """Another tenant's data in an answer: whose, and how it was recognised (MARKER or FRAGMENT)."""

    victim: str
    kind: str
    epoch: str = ""  # a marker's epoch


LeakHandler = Callable[[Leak], Awaitable[None]]
# The model's tokenizer: token ids to text. Awaited: a dropped field can hold a prompt's 200,000 ids (~35 ms to decode),
# which the caller decodes off the event loop (the gateway: gateway/offload.py's ids_decoder).
Decode = Callable[[list[int]], Awaitable[str]]
MAX_REJOINS = 8  # scans of one release after a strip: each strip shortens it, honest text needs one
# Distinct marker-shaped strings one answer may hold: each is read back into codes (~0.1 ms) and, when no marker of
# this instance's, asked of the store. An honest answer holds none but the tenant's own, a few times; a model made to
# write thousands held the event loop and Redis for seconds.
MAX_CANDIDATES = 64
IDS_KEPT = 64  # token ids of a dropped field decoded together: far more than one marker's tokens
# A scanned text's place for the suspect text (SuspectText): which text, and where, in its characters, the text its
# scanner reads ends (held text and this piece).
At = tuple[Hashable, int | None]  # (None: its characters are not counted, prompt fingerprints off: a place of its own)
# A text's place, worked out only when a scan of it hits something (rare): None for a token stream.
Place = Callable[[], At | None]


class StripWouldJoin(Exception):
    """Text built so that stripping the tenant's own marker would make a new one: it cannot be shown safe (the
    gateway withholds the answer as a failed check)."""


class SplitMarker(Exception):
    """The tenant's own marker, split across texts of one answer: what went out of it cannot be taken back, and the
    rest cannot be shown safe (the gateway withholds the answer as a failed check)."""


class CandidateFlood(Exception):
    """More marker-shaped strings than any honest answer holds (MAX_CANDIDATES): the answer is withheld unread."""


class LeakBlocked(Exception):
    """Another tenant's marker was found and the policy is to block: the answer must not go out."""


def place(choice: dict[str, Any], key: str, text: str) -> tuple[dict[str, Any], str]:
    """Append text to one of a streamed choice's texts, by its stream key (channels.texts); where it stands."""
    if key == "text":
        choice["text"] = (choice.get("text") or "") + text
        return choice, "text"
    delta = choice.setdefault("delta", {})
    if not key.startswith("tool:"):
        delta[key] = (delta.get(key) or "") + text
        return delta, key
    _, slot, name = key.split(":")
    index = None if slot == "null" else int(slot)
    calls = delta.setdefault("tool_calls", [])
    call = next((c for c in calls if c.get("index") == index), None)
    if call is None:
        call = {"index": index, "function": {}}
        calls.append(call)
    function = call.setdefault("function", {})
    function[name] = (function.get(name) or "") + text
    return function, name


@dataclass
class _Choice:
    """What the guard keeps of one choice between the events of a stream."""

    echo: str  # what is left to strip of the injected prefix that a completion echo repeats
    settled: set[str]  # its texts a plain piece changes nothing of, for the joins (Joins.settled)
    scanners: dict[str, StreamScanner] = field(default_factory=dict)
    held_logprobs: dict[str, Any] | None = None  # logprobs of earlier events, waiting for a hold to clear
    dropped: set[int] = field(default_factory=set)  # held positions that overlap a stripped marker
    tool_ids: dict[int, str] = field(default_factory=dict)  # the id each tool call was first given
    grams: dict[str, Reading] = field(default_factory=dict)  # per stream: its k-grams, as sent and decoded
    tainted: set[str] = field(default_factory=set)  # streams redacted for a fragment: the rest of them is too
    # Per stream, its text since a first hit of another tenant's prompt, held until the hit is paired (a leak) or
    # can no longer be.
    suspended: dict[str, str] = field(default_factory=dict)
    held_tokens: bool = False  # a token-level stream's first hit is undecided: the logprobs wait
    hits: bool = False  # some text of this choice has had a hit: from then on, whether one is undecided is asked
    mirror: str | None = None  # the text whose grams the chosen logprob tokens share so far

    def scanner(self, key: str) -> StreamScanner:
        scanner = self.scanners.get(key)
        if scanner is None:
            scanner = self.scanners[key] = StreamScanner()
        return scanner


@dataclass
class _Sink:
    """One dropped field across an answer: its texts as a stream, its byte lists as UTF-8, its token ids."""

    scanner: StreamScanner = field(default_factory=StreamScanner)
    names: StreamScanner = field(default_factory=StreamScanner)  # the names of the maps in it, a stream of their own
    bytes_scanner: StreamScanner = field(default_factory=StreamScanner)
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    ids: list[int] = field(default_factory=list)


class OutputGuard:
    def __init__(
        self,
        registry: MarkerRegistry,
        tenant: str,
        policy: LeakPolicy,
        on_leak: LeakHandler,
        echo_prefix: str = "",
        decode: Decode | None = None,
        stops: frozenset[str] = frozenset(),
        fragments: AnswerCheck | None = None,
        choices: int = 1,
        judge: Judge | None = None,
        hold_tail: int = 0,
    ) -> None:
        self._registry = registry
        self._judge = judge
        self._hold_tail = hold_tail  # words of every streamed text held back at all times (0: from a first hit only)
        self._choices_asked = choices  # the request's n: a choice of another index answers nothing that was asked
        self._fragments = fragments
        self._tenant = tenant
        self._policy = policy
        self._on_leak = on_leak
        self._echo_prefix = echo_prefix
        self._decode = decode
        self._stops = stops
        self._choices: dict[int, _Choice] = {}
        self._finished: set[int] = set()  # choices whose finish_reason went out
        self._envelope: dict[str, str] = {}
        self._sinks: dict[str, _Sink] = {}
        self._reported: set[tuple[str, str]] = set()
        self._owners: dict[bytes, Owner | None] = {}  # the candidates of this answer looked up: whose they are
        self._joins = Joins()
        self._joined = Joined()  # every text in the order it went out, for fragments spread over several
        self.suspect = SuspectText()  # what of the answer's suspect text went out
        self._let_out: set[bytes] = set()  # other tenants' markers a text's scanner let out whole, placed (alert)

    async def check_chunk(self, chunk: dict[str, Any]) -> None:
        """Scan and edit one streamed chunk (pruned: channels.prune) in place."""
        envelope = self._envelope
        for name in ENVELOPE:
            # Every chunk after the first carries the values the first set (or none): nothing for _hold_envelope.
            value = chunk.get(name)
            if value is not None and value != envelope.get(name):
                await self._hold_envelope(chunk)
                break
        choices = self._answered(chunk)
        for choice in choices if choices is not None else await self._unasked_out(chunk):
            index = choice.get("index") or 0
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice(self._echo_prefix, self._joins.settled(index))
            final = choice.get("finish_reason") is not None
            await self._choice(index, state, choice, final)
            if final:
                # Nothing more comes for this choice: what was held goes out with its last chunk, even when that
                # chunk carries none of the fields (OpenAI's closing chunk has `delta: {}`).
                del self._choices[index]
                self._finished.add(index)

    async def check_body(self, body: dict[str, Any]) -> None:
        """Scan and edit a whole (non-streamed, pruned) answer in place."""
        await self._hold_envelope(body)
        choices = self._answered(body)
        for choice in choices if choices is not None else await self._unasked_out(body):
            index = choice.get("index") or 0
            await self._choice(index, _Choice(self._echo_prefix, self._joins.settled(index)), choice, final=True)

    def _answered(self, answer: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The answer's choices, when all of them answer the request (every event of an honest engine); else None.

        A choice of an index the request did not ask for does not, nor one an engine writes on after its finish: a
        fresh scanner there would miss a marker whose first half went out in the finished part.
        """
        choices: list[dict[str, Any]] = answer.get("choices") or []
        seen = 0  # the indexes so far, as bits: one index twice in an answer is two streams of one choice
        for choice in choices:
            index = choice.get("index") or 0
            if index in self._finished or not 0 <= index < self._choices_asked or seen >> index & 1:
                return None
            seen |= 1 << index
        return choices

    async def _unasked_out(self, answer: dict[str, Any]) -> list[dict[str, Any]]:
        """The answer's choices once those that answer nothing asked are taken out: never relayed, and scanned. A
        choice that comes again in the same answer goes with them (after its first, finished or not)."""
        choices: list[dict[str, Any]] = answer["choices"]
        kept: list[dict[str, Any]] = []
        taken = set(self._finished)
        for choice in choices:
            index = choice.get("index") or 0
            if index in taken or not 0 <= index < self._choices_asked:
                await self.check_removed([("choice.unasked", choice)])
                continue
            kept.append(choice)
            taken.add(index)
        choices[:] = kept
        return kept

    async def closing(self) -> list[dict[str, Any]]:
        """For a stream that ended without finishing its choices: their held texts and logprobs, as last choices.

        Empties the guard. Text held for an undecided fragment (not yet scanned for markers) is not among them.
        """
        closing = []
        for index, state in self._choices.items():
            choice: dict[str, Any] = {"index": index, "finish_reason": None}
            for key, scanner in state.scanners.items():
                rest = await self._rest(scanner, partial(self._at, index, state, key))
                if rest and not key.startswith("lp"):
                    holder, name = place(choice, key, rest)
                    if found := self._joins.went_out(index, key, rest, False):
                        await self._split(found, holder, name)
            if state.held_logprobs is not None and not state.suspended and not state.held_tokens:
                # (Those held with an undecided fragment's text go with it.)
                drop(state.held_logprobs, state.dropped)
                choice["logprobs"] = state.held_logprobs
            if len(choice) > 2:
                closing.append(choice)
        self._choices.clear()
        return closing

    async def check_text(self, text: str) -> str:
        """A text that stands on its own (an id, a backend's error message): the tenant's own marker stripped,
        another's handled by policy; a fragment of another tenant's prompt too (under redact, the whole text)."""
        check, at = self._fragments, (object(), len(text))  # (a text of its own for the suspect text)
        if check is not None and check.hasher.may_hold_gram(text) and len(words(text)) > check.hasher.shape.k:
            # With fewer words it holds not one gram (an id, a model name: most of these).
            reading = Reading(check.hasher, located=True)
            victim = reading.feed(check, text, end=True)
            if victim is not None:
                self._placed(at[0], reading, reading, 0)
                if await self._leak(Leak(victim, FRAGMENT)) is not None:
                    return REDACTED
        if not suspects([text]):  # no candidate in it, and no end that could start one: it passes unchanged
            return text
        scanner = StreamScanner()
        return await self._release(scanner, text, lambda: at) + await self._rest(scanner, lambda: at)

    async def check_removed(self, removed: Removed) -> None:
        """Scan what never goes out (pruned fields, stray SSE lines, a backend's error event): another tenant's
        marker there is an engine leaking all the same — a leak event, and under block the answer is withheld."""
        for where, value in removed:
            sink = self._sinks.get(where)
            if sink is None:
                sink = self._sinks[where] = _Sink()
            for kind, item in _contents(value):
                if kind == "text":
                    await self._detect(sink.scanner.scan(item).hits)
                    continue
                if kind == "name":
                    await self._detect(sink.names.scan(item).hits)
                    continue
                if all(0 <= number < 256 for number in item):
                    await self._detect(sink.bytes_scanner.scan(sink.decoder.decode(bytes(item))).hits)
                if self._decode is not None:
                    # All of them, after the tail of the ones before: a marker can be anywhere in a long list, and
                    # numbers no tokenizer takes (negative, past 32 bits) must not stop the rest being read.
                    ids = sink.ids + [number for number in item if 0 <= number < 1 << 32]
                    sink.ids = ids[-IDS_KEPT:]
                    try:
                        decoded = await self._decode(ids)
                    except (OverflowError, TypeError, ValueError):
                        continue  # not ids of this vocabulary
                    await self._detect(scan_all(decoded))

    async def _detect(self, hits: list[Hit]) -> None:
        await self._resolve([hit.normal for hit in hits])
        for hit in hits:
            await self._verdict(hit)

    async def _hold_envelope(self, answer: dict[str, Any]) -> None:
        """Scan the envelope's strings where they first appear, and hold every later chunk to those values."""
        for name in ENVELOPE:
            value = answer.get(name)
            if value is None:
                continue
            first = self._envelope.get(name)
            if first is None:
                self._envelope[name] = first = await self.check_text(value)
                if found := self._joins.standalone(STANDALONE, name, first):
                    await self._split(found, self._envelope, name)
                    first = self._envelope[name]
            elif value != first:
                where = f"envelope.{name}"
                if where not in self._sinks:  # the value it changes from starts the stream a marker could span
                    await self.check_removed([(where, first)])
                await self.check_removed([(where, value)])
            if value != first:
                answer[name] = first

    async def _hold_tool_ids(self, state: _Choice, choice: dict[str, Any]) -> None:
        for holder in (choice.get("delta"), choice.get("message")):
            for position, call in enumerate((holder or {}).get("tool_calls") or ()):
                value = call.get("id")
                if value is None:
                    continue
                index = call.get("index", position)
                first = state.tool_ids.get(index)
                if first is None:
                    call["id"] = first = await self.check_text(value)
                    if found := self._joins.standalone(choice.get("index") or 0, f"tool:{index}:id", first):
                        await self._split(found, call, "id")
                    state.tool_ids[index] = value = first = call["id"]
                elif value != first:
                    if "tool.id" not in self._sinks:
                        await self.check_removed([("tool.id", first)])
                    await self.check_removed([("tool.id", value)])
                if value != first:
                    call["id"] = first

    async def _choice(self, index: int, state: _Choice, choice: dict[str, Any], final: bool) -> None:
        """One choice of one event, channel by channel: its own fields, its texts' fragments, its texts' markers, its
        logprobs, and at its end what its scanners still hold."""
        if state.echo or state.tool_ids or choice.get("stop_reason") is not None or _calls(choice):
            await self._choice_fields(state, choice)
        slots = texts(choice)
        if len(slots) > 1:
            for holder in (choice.get("delta"), choice.get("message")):
                if holder is not None:
                    in_order(holder)
        logprobs = choice.get("logprobs")
        streams = token_streams(logprobs) if logprobs is not None else {}
        if self._fragments is not None:
            await self._find_fragments(index, state, slots, streams, choice, final)
        # One pass over every text of this event finds the few that a scanner must look at; most events have none.
        flagged = suspects([holder[name] for _, holder, name in slots] + ["".join(p) for p in streams.values()])
        if _quiet(state, slots, flagged):
            for key, holder, name in slots:
                if found := self._plain(index, state, key, holder[name]):
                    await self._split(found, holder, name)
            return
        holding = await self._texts(index, state, slots, flagged, final)
        if logprobs is not None or state.held_logprobs is not None:
            await self._logprobs(state, choice, streams, flagged, len(slots), holding, final)
        if final:
            await self._flush(index, state, choice, {key for key, _, _ in slots})

    async def _choice_fields(self, state: _Choice, choice: dict[str, Any]) -> None:
        """The choice's strings that are not texts: the echo of what was injected, stop_reason, tool-call ids."""
        if state.echo and type(choice.get("text")) is str:
            self._strip_echo(state, choice)
        stop = choice.get("stop_reason")
        if type(stop) is str and stop not in self._stops:
            await self.check_removed([("choice.stop_reason", stop)])
            choice["stop_reason"] = None
        if state.tool_ids or _calls(choice):
            await self._hold_tool_ids(state, choice)

    def _plain(self, index: int, state: _Choice, key: str, text: str) -> list[bytes]:
        """A text no scanner needs to read: only the joins, for a marker it ends that began in another text. Not a
        coroutine: it runs for every text of every event, and only a find needs to wait (_split)."""
        if key in state.settled and self._joins.order_idle:
            return []
        return self._joins.went_out(index, key, text, True)

    async def _texts(
        self,
        index: int,
        state: _Choice,
        slots: list[tuple[str, dict[str, Any], str]],
        flagged: set[int] | None,
        final: bool,
    ) -> bool:
        """Scan each text of the event for markers, releasing what cannot still become one; whether any is held."""
        holding = bool(state.suspended) or state.held_tokens
        for position, (key, holder, name) in enumerate(slots):
            scanner = state.scanners.get(key)
            if (
                flagged is not None
                and position not in flagged
                and (scanner is None or scanner.idle)
                and not has_escape(holder[name])
            ):
                if found := self._plain(index, state, key, holder[name]):
                    await self._split(found, holder, name)
                continue
            scanner = scanner or state.scanner(key)
            original = holder[name]
            place = partial(self._at, index, state, key)
            released = await self._release(scanner, original, place)
            if final:
                released += await self._rest(scanner, place)
            holding |= scanner.holding
            if released != original:
                holder[name] = released
            if found := self._joins.went_out(index, key, released, False, scanner.held):
                await self._split(found, holder, name)
        return holding

    async def _flush(self, index: int, state: _Choice, choice: dict[str, Any], seen: set[str]) -> None:
        """The choice's last event: what a scanner of a text this event did not write still holds goes out in it."""
        for key, scanner in state.scanners.items():
            rest = await self._rest(scanner, partial(self._at, index, state, key))
            if rest and key not in seen and not key.startswith("lp"):
                holder, name = place(choice, key, rest)
                if found := self._joins.went_out(index, key, rest, False):
                    await self._split(found, holder, name)

    async def _find_fragments(
        self,
        index: int,
        state: _Choice,
        slots: list[tuple[str, dict[str, Any], str]],
        streams: dict[str, list[str]],
        choice: dict[str, Any],
        final: bool,
    ) -> None:
        """Check this event's texts and chosen logprob tokens for a fragment of another tenant's recent prompt.
        From a text's first hit on, its text is held (suspended) until the hit is paired or no longer can be, so at
        most the words before that first hit go out. Under redact, a text where one is found is redacted from there
        on, and the event's logprob positions are dropped. The chosen tokens and the alternatives of every rank are
        token-level streams of their own, checked the same way. The texts are also read joined, in the order they went
        out (readings.py): a first hit there holds every text until it is decided."""
        chosen = "".join(streams["lp"]) if "lp" in streams else None
        mirrored = self._mirror(state, slots, chosen)
        found = await self._text_fragments(index, state, slots, mirrored, final)
        if streams:
            found |= await self._token_fragments(index, state, streams, chosen, mirrored, final)
        # Every token stream read so far, not only this event's: an event without logprobs decides nothing.
        state.held_tokens = (
            not final and state.hits and any(self._pending(state, key) for key in state.grams if key[:2] == "lp")
        )
        suspended = state.suspended
        if final and suspended:
            # Nothing more comes: what a stream this event did not write still holds goes out with its last chunk.
            for key in list(suspended):
                place(choice, key, suspended.pop(key))
            slots[:] = texts(choice)
        if found:  # under redact: the positions held for it go too
            held = positions(state.held_logprobs) if state.held_logprobs is not None else 0
            state.dropped |= set(range(held + positions(choice["logprobs"])))

    def _mirror(self, state: _Choice, slots: list[tuple[str, dict[str, Any], str]], chosen: str | None) -> str | None:
        """The text whose grams the chosen logprob tokens share. The chosen tokens usually spell exactly the event's
        one text: their grams would be the same, so they are fed once, until the first event where they differ (from
        then on the tokens are a stream of their own)."""
        mirrors = chosen is not None and len(slots) == 1 and chosen == slots[0][1][slots[0][2]]
        mirrored = state.mirror
        if mirrored is not None and not (mirrors and slots[0][0] == mirrored):
            # They part: the tokens go on from where the text's grams are now, before this event.
            assert self._fragments is not None
            own = state.grams.get(mirrored)
            state.grams["lp"] = own.copy() if own is not None else Reading(self._fragments.hasher)
            state.mirror = mirrored = None
        elif mirrored is None and mirrors and "lp" not in state.grams:
            state.mirror = mirrored = slots[0][0]
        return mirrored

    async def _text_fragments(
        self,
        index: int,
        state: _Choice,
        slots: list[tuple[str, dict[str, Any], str]],
        mirrored: str | None,
        final: bool,
    ) -> bool:
        """Each text of the event: a fragment found redacts it (under redact) from there on; an undecided first hit
        holds it; a decided one releases what was held. Whether a fragment was found in the text the tokens mirror."""
        found = False
        suspended = state.suspended
        for key, holder, name in slots:
            # A tool call's name is no part of the joined texts: it stands between a text and the call's arguments,
            # where a word of its own would break the grams of a passage running on from one into the other.
            find = self._fragment(index, state, key, holder[name], final, joins=not key.endswith(":name"))
            judged = None if find is None else await self._unless_induced(*find)  # (a coroutine only on a find)
            victim = None
            if judged is not None:
                victim, reading = judged
                own = state.grams[key]
                scanner = state.scanners.get(key)
                # What of the text went out with the events before: all it read before this piece, but what is held
                # for a fragment and what its scanner holds for a marker.
                before = own.sent.chars - len(holder[name])
                out = before - len(suspended.get(key, "")) - (len(scanner.held) if scanner is not None else 0)
                self._placed((index, key), own, reading, out)
            hit = victim is not None and await self._leak(Leak(victim, FRAGMENT)) is not None
            found |= hit and key == mirrored
            if hit or key in state.tainted:
                state.tainted.add(key)
                suspect = suspended.pop(key, "")  # the held text goes with the rest
                holder[name] = REDACTED if holder[name] or suspect else ""
            elif victim is None and not final and (state.hits or self._joined.hit) and self._pending(state, key):
                suspended[key] = suspended.get(key, "") + holder[name]
                holder[name] = ""
            elif self._hold_tail and victim is None and not final:
                # The strict setting: the last min_fragment - 1 words wait, so no word of a fragment leaves before it
                # is recognised.
                held = suspended.get(key, "") + holder[name]
                cut = tail_start(held, self._hold_tail)
                holder[name], suspended[key] = held[:cut], held[cut:]
            elif key in suspended:  # decided (no fragment, or let through under alert): it goes out
                holder[name] = suspended.pop(key) + holder[name]
        return found

    async def _token_fragments(
        self,
        index: int,
        state: _Choice,
        streams: dict[str, list[str]],
        chosen: str | None,
        mirrored: str | None,
        final: bool,
    ) -> bool:
        """Every token-level stream, the alternatives of each rank as much as the chosen tokens: an engine can spell a
        fragment in either. Their positions wait with the text while one of them is undecided."""
        found = False
        for key, pieces in streams.items():
            if key == "lp" and mirrored is not None:
                continue
            text = chosen if key == "lp" and chosen is not None else "".join(pieces)
            # A judge asks for the same logprobs: what a request makes the model write, chosen or ranked, it says too.
            find = self._fragment(index, state, key, text, final, joins=False)
            judged = None if find is None else await self._unless_induced(*find)
            if judged is not None:
                # Logprob tokens are no text of the answer (the chosen ones repeat it): what went out is not placed.
                self.suspect.located = False
                found |= await self._leak(Leak(judged[0], FRAGMENT)) is not None
        return found

    async def _unless_induced(self, found: str, reading: Reading, read: list[Reading]) -> tuple[str, Reading] | None:
        """The victim of a fragment a piece ended (found by `reading`), and the reading that found it, unless a judge
        finds each one the piece ends induced (the answer said it where her prompt never went: a public text, a text
        the recipient had the model write). `read`: every reading of the piece, each read on past what the judge
        cleared."""
        victim: str | None = found
        while victim is not None and self._judge is not None:
            assert self._fragments is not None and reading.paired is not None and reading.paired.pair is not None
            cleared = await self._judge(Suspect(victim, reading.paired.pair))
            if cleared is None:
                return victim, reading
            self._fragments.clear(cleared)
            judged, victim = victim, None
            for each in read:
                after = each.resume(self._fragments, judged)
                if after is not None and victim is None:
                    victim, reading = after, each
        return None if victim is None else (victim, reading)

    def _placed(self, text: Hashable, own: Reading, reading: Reading, out: int) -> None:
        """A fragment found by `reading` in a text whose own reading is `own`, which let out its first `out`
        characters with the events before: its suspect text, when its own reading as sent found it (else it is not
        placed)."""
        grams = reading.paired
        if reading is not own or grams is not own.sent or grams.span is None:
            self.suspect.located = False
            return
        start, end = grams.span
        self.suspect.found(text, start, end, out, goes=self._policy is LeakPolicy.ALERT)

    def _pending(self, state: _Choice, key: str) -> bool:
        """Whether what this stream says next could still complete a fragment with a hit already read: on its own,
        or joined to the texts before it."""
        check = self._fragments
        assert check is not None
        reading = state.grams.get(key)
        return (reading is not None and reading.pending(check)) or self._joined.pending(check)

    def _fragment(
        self, index: int, state: _Choice, key: str, piece: str, final: bool, joins: bool
    ) -> tuple[str, Reading, list[Reading]] | None:
        """Feed one piece of one stream to its readings, and (`joins`: a text) to the answer's joined ones; when it
        ends a fragment of another tenant's prompt, the victim, the reading that found it, and every reading of the
        piece (to judge: _unless_induced; to report: _leak). Not a coroutine: it runs for every text of every event,
        and only a find needs to wait. A stream's last piece ends its last word."""
        check = self._fragments
        assert check is not None
        reading = state.grams.get(key)
        if reading is None:
            # A text's own reading places what it finds (suspect text); a token stream's is no text of the answer.
            reading = state.grams[key] = Reading(check.hasher, located=key[:2] != "lp")
        victim = reading.feed(check, piece, final)
        if reading.hit:
            state.hits = True
        find = None if victim is None else (victim, reading)
        joined = self._joined
        if not joins or (joined.glued is None and key == joined.key and index == joined.choice):
            # (While one text alone has gone out, its own reading is the joined one.)
            return None if find is None else (*find, [reading])
        found = joined.feed(check, index, key, piece, reading, final)
        find = find or found
        return None if find is None else (*find, [reading, *joined.readings])

    def _strip_echo(self, state: _Choice, choice: dict[str, Any]) -> None:
        text: str = choice["text"]
        size = min(len(state.echo), len(text))
        if text[:size] != state.echo[:size]:
            state.echo = ""  # not an echo of what was injected: the scan still strips the marker itself
            return
        choice["text"], state.echo = text[size:], state.echo[size:]

    async def _logprobs(
        self,
        state: _Choice,
        choice: dict[str, Any],
        streams: dict[str, list[str]],
        flagged: set[int] | None,
        first: int,
        holding: bool,
        final: bool,
    ) -> None:
        """Scan this event's token-level streams; release the choice's logprobs, or hold them with the held text."""
        new = choice.get("logprobs")
        held = state.held_logprobs
        found = []
        for position, (key, pieces) in enumerate(streams.items(), start=first):
            scanner = state.scanners.get(key)
            if flagged is not None and position not in flagged and (scanner is None or scanner.idle):
                continue
            scanner = scanner or state.scanner(key)
            scan = scanner.scan("".join(pieces))
            if scan.hits:
                found.append((key, scan))
            holding |= scanner.holding
        joined = new if held is None else join(held, new)
        for key, scan in found:
            assert joined is not None
            # The scanned text ends where this stream's text of all held and new positions ends.
            lengths = [len(piece) for piece in token_streams(joined)[key]]
            start = sum(lengths) - len(scan.text)
            for hit in scan.hits:
                if await self._verdict(hit) is not None:
                    state.dropped |= _overlapping(lengths, start + hit.start, start + hit.end)
                elif self._foreign(hit):  # let out (alert): logprob tokens are no text of the answer, not placed
                    self.suspect.located = False
        if holding and not final:
            state.held_logprobs = joined
            choice["logprobs"] = None
            return
        dropped = state.dropped
        if joined is not None and dropped:
            drop(joined, dropped)
        choice["logprobs"] = joined
        state.held_logprobs, state.dropped = None, set()

    async def _release(self, scanner: StreamScanner, piece: str, place: Place) -> str:
        """What of a text goes out once this piece is scanned, edited; `place`: the text's (_at)."""
        scan = scanner.scan(piece)
        released = scan.text[: scan.release]
        if not scan.hits:
            return released
        edits = await self._edits(scan.hits)
        out = apply_edits(released, edits)
        passes = [(scan.hits, edits)]
        strips = [hit for hit, replacement in edits if replacement == ""]
        if strips:
            if any(scanner.opens_escape(scan.text[: hit.start]) for hit in strips):
                raise StripWouldJoin("a stripped marker stands right after the start of a JSON escape")
            # A stripped marker joins what stood around it: `CN` + the tenant's own marker + `RY-…` would go out as a
            # marker no scan saw. What goes out is scanned again until no strip joins anything, and the next piece is
            # read after it.
            for _ in range(MAX_REJOINS):
                hits = scanner.after_out(out)
                joined = await self._edits(hits)
                passes.append((hits, joined))
                if not joined:
                    break
                # A marker stripped on a later pass may stand after an escape's start as well (`\` + marker +
                # `ud835…`).
                if any(cut == "" and scanner.opens_escape(out[: hit.start]) for hit, cut in joined):
                    raise StripWouldJoin("a stripped marker stands right after the start of a JSON escape")
                out = apply_edits(out, joined)
            else:
                raise StripWouldJoin("stripping markers kept joining text into new ones")
            scanner.went_out(out)
        self._suspects(passes, place(), len(scan.text))
        return out

    def _suspects(self, passes: list[tuple[list[Hit], list[tuple[Hit, str]]]], at: At | None, scanned: int) -> None:
        """The suspect text of a scan's passes (its hits and edits, then each rescan's after a strip, in the text the
        pass before made): another tenant's markers let out (alert), and what the edits took out."""
        alert = self._policy is LeakPolicy.ALERT
        if at is None:
            if alert and any(self._foreign(hit) for hits, _ in passes for hit in hits):
                self.suspect.located = False
            return
        text, end = at
        if end is None:
            text, end = object(), scanned
        base = end - scanned  # where the scanned text (held, then this piece) begins in the text
        for depth, (hits, edits) in enumerate(passes):
            before = [made for _, made in passes[:depth]]
            for hit in hits:
                if alert and self._foreign(hit):
                    start, stop = _unedited(hit.start, hit.end, before)
                    self.suspect.left(text, base + start, base + stop)
                    self._let_out.add(hit.normal)
            for hit, _ in edits:
                start, stop = _unedited(hit.start, hit.end, before)
                self.suspect.edited(text, base + start, base + stop)

    def _at(self, index: int, state: _Choice, key: str) -> At | None:
        """A stream's place for the suspect text: a text's, where its scanner's reading ends (all its own reading read,
        but what is held for a fragment), when prompt fingerprints read it (not once it is redacted for one: its
        scanner reads `[redacted]`); None for a token stream."""
        if key[:2] == "lp":
            return None
        own = state.grams.get(key)
        if own is None or key in state.tainted:
            return (index, key), None
        return (index, key), own.sent.chars - len(state.suspended.get(key, ""))

    def _foreign(self, hit: Hit) -> bool:
        """Another tenant's live marker (its owner was asked already)."""
        owner = self._owners.get(hit.normal)
        return owner is not None and owner.tenant != self._tenant

    async def _split(self, found: list[bytes], holder: dict[str, Any], name: str) -> None:
        """Candidates that a text about to go out completes with texts that went out before (joins.py): the tenant's
        own marker cannot be stripped from texts already gone (the answer is withheld as a failed check); another
        tenant's is a leak (under redact, this text is redacted)."""
        await self._resolve(found)
        for candidate in found:
            owner = self._owners[candidate]
            if owner is None:
                continue
            if owner.tenant == self._tenant:
                if candidate in self._joins.held:
                    continue  # its start is not out: it goes out, and is joined then, only if it is no marker there
                raise SplitMarker("the tenant's own marker, split across texts of the answer")
            if (self._policy is not LeakPolicy.BLOCK or candidate not in self._joins.held) and (
                candidate not in self._let_out
            ):
                # Its start went out in another text (or goes, the policy letting the answer on), where the joins,
                # reading normal forms, do not place it. (The joins read a text's own markers too: one its scanner let
                # out whole is placed.)
                self.suspect.located = False
            if await self._leak(Leak(owner.tenant, MARKER, str(owner.epoch))) is not None:
                holder[name] = REDACTED

    async def _rest(self, scanner: StreamScanner, place: Place) -> str:
        """What a stream's scanner still held at its end: a tail that can no longer become a marker goes out, except
        the start of the tenant's own (a stream cut by max_tokens inside it would show her most of her marker). An
        escape still open there is read as a lenient decoder reads one at a text's end (`&#107` is "k"): what it
        completes is found before it goes out. `place`: the text's (_at)."""
        released = ""
        if scanner.escaping:
            at = place()
            ended = None if at is None or at[1] is None else at[1] + len(END)  # the end is read as one more character
            released = await self._release(scanner, END, lambda: None if at is None else (at[0], ended))
        held = scanner.flush()
        if held.endswith(END):
            held = held[:-1]
        elif released.endswith(END):
            released = released[:-1]
        if not held:
            return released
        normal = normalize(held)
        registry = self._registry
        if len(normal) > len(ANCHOR) and any(
            normal_form(registry.marker(self._tenant, spelling)).startswith(normal) for spelling in registry.spellings
        ):
            at = place()
            if at is not None and at[1] is not None:
                self.suspect.edited(at[0], at[1] - len(held), at[1])
            return released
        return released + held

    async def _resolve(self, candidates: list[bytes]) -> None:
        """Whose these candidates are, asked together (one round trip to the store for all the new ones) and kept for
        the rest of the answer: a model can be made to write marker-shaped strings over and over."""
        new = [candidate for candidate in dict.fromkeys(candidates) if candidate not in self._owners]
        if not new:
            return
        if len(self._owners) + len(new) > MAX_CANDIDATES:
            raise CandidateFlood(f"more than {MAX_CANDIDATES} marker-shaped strings in one answer")
        self._owners.update(await self._registry.resolve(new))

    async def _edits(self, hits: list[Hit]) -> list[tuple[Hit, str]]:
        await self._resolve([hit.normal for hit in hits])
        edits = []
        for hit in hits:
            replacement = await self._verdict(hit)
            if replacement is not None:
                edits.append((hit, replacement))
        return edits

    async def _verdict(self, hit: Hit) -> str | None:
        """What replaces a candidate marker: "" for the tenant's own, REDACTED for another's under redact, None to
        leave it (not a live marker, or the alert policy); raises LeakBlocked under block."""
        await self._resolve([hit.normal])
        owner = self._owners[hit.normal]
        if owner is None:
            return None
        if owner.tenant == self._tenant:
            return ""
        # Even when the recipient's own prompt holds it: a tenant who learned another's marker (from a model that
        # writes its system line encoded) would otherwise blind the markers to that tenant's leaks into its answers.
        return await self._leak(Leak(owner.tenant, MARKER, str(owner.epoch)))

    async def _leak(self, leak: Leak) -> str | None:
        """Report another tenant's data (once per victim, kind and answer); raises LeakBlocked under block, else
        what replaces it (REDACTED under redact, None to leave it under alert)."""
        if (leak.victim, leak.kind) not in self._reported:
            self._reported.add((leak.victim, leak.kind))
            await self._on_leak(leak)
        if self._policy is LeakPolicy.BLOCK:
            raise LeakBlocked
        return REDACTED if self._policy is LeakPolicy.REDACT else None


def _quiet(state: _Choice, slots: list[tuple[str, dict[str, Any], str]], flagged: set[int] | None) -> bool:
    """Nothing of this event needs a scanner: no text is a suspect, nothing is held, and no backslash starts a JSON
    escape that spells a marker only once a client decodes the text."""
    return (
        flagged is not None
        and not flagged
        and state.held_logprobs is None
        and _idle(state.scanners)
        and not state.suspended
        and not state.held_tokens
        and not any(has_escape(holder[name]) for _, holder, name in slots)
    )


def _calls(choice: dict[str, Any]) -> bool:
    message = choice.get("delta") or choice.get("message")
    return message is not None and bool(message.get("tool_calls"))


def _idle(scanners: dict[str, StreamScanner]) -> bool:
    return all(scanner.idle for scanner in scanners.values()) if scanners else True


def _contents(value: Any) -> Iterator[tuple[str, Any]]:
    """The texts ("text", str), field names ("name", str) and runs of integers ("ints", list; floats of integer value
    too) in a removed value, in document order.

    Keys count as text in maps of numbers (a completion's token → logprob). Elsewhere they are field names: scanned
    as a stream of their own, since their letters would only break up the text between them.
    """
    if type(value) is str:
        yield "text", value
    elif type(value) is dict:
        numbers = all(type(item) in (int, float) for item in value.values())
        for key, item in value.items():
            if numbers:
                yield "text", str(key)
            else:
                yield "name", str(key)
                yield from _contents(item)
    elif type(value) is list:
        # Every run of integers, whatever stands between: one string or `true` after a prompt's ids must not hide them.
        run: list[int] = []
        for item in value:
            if type(item) is int or (type(item) is float and item.is_integer()):
                run.append(int(item))
                continue
            if run:
                yield "ints", run
                run = []
            yield from _contents(item)
        if run:
            yield "ints", run


def _unedited(start: int, end: int, passes: list[list[tuple[Hit, str]]]) -> tuple[int, int]:
    """Where [start, end) of a text stood before these passes of edits (each made on the text the one before made):
    a character of a replacement stood where its hit did."""
    for edits in reversed(passes):
        start, end = _before(start, edits), _before(end - 1, edits, last=True) + 1
    return start, end


def _before(at: int, edits: list[tuple[Hit, str]], last: bool = False) -> int:
    """Where the character at `at` of a text that `edits` made (apply_edits) stood before them (one of a replacement:
    its hit's first, or its last for the `last` character of a span)."""
    shift = 0  # characters the edits before it took out, less those they put in
    for hit, replacement in sorted(edits, key=lambda edit: edit[0].start):
        made = hit.start - shift
        if at < made:
            break
        if at < made + len(replacement):
            return hit.end - 1 if last else hit.start
        shift += hit.end - hit.start - len(replacement)
    return at + shift


def _overlapping(lengths: list[int], start: int, end: int) -> set[int]:
    """The positions whose text (lengths per position, in order) overlaps [start, end)."""
    found, at = set(), 0
    for position, length in enumerate(lengths):
        if at < end and start < at + length:
            found.add(position)
        at += length
    return found
