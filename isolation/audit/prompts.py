"""Prompts of chosen token counts: filler for the length probes, probe text and marker-dense text for the canary
probes.

With the endpoint's /tokenize (vLLM: POST /tokenize with `messages` counts the chat template too) sizes are
exact: a few counts of a growing filler find the word count that hits the target, and every count is cached
because the filler is one fixed word sequence per run. Without it, sizes are lower bounds: the filler is
common short English words, each at least one token in every BPE or SentencePiece vocabulary, so a prompt of
N words is at least N tokens and an over-limit probe is over the limit for sure; an at-limit one may then be
a little over, and is reported as estimated.

Probe text (the canary fills) is random words of PROBE_WORDS with one of the identity's markers after every
SEGMENT of them: the markers are the strongest evidence of a leak, the words show one in as few as RUN_WORDS
tokens (runs.py). PROBE_WORDS are 256 common words, none of them filler (an answer that echoes its own filler
prompt must match nothing), each one token in the simulator's tokenizer and, being common English, in those of
common models, so a 16-token page holds a run. They are drawn with the run's seed, like everything here.
"""

from __future__ import annotations

import random

from isolation.audit.config import Identity
from isolation.audit.endpoint import Endpoint
from isolation.audit.errors import CannotRun
from isolation.audit.exchange import Prompt

FILLER_WORDS = (
    "the of and to in is it that for on as with was at by be this from or are an not but have you which one all "
    "can if will has more when there they so no we may out up what about into than its only other new some time "
    "could these two first then do any like over such after most also"
).split()
PROBE_WORDS = (
    "above accept add address again against allow already always another apart appear assume back base basic "
    "because become been before begin best better between big blank block body both break build call came cannot "
    "case cause certain change character check clear close come common complete complex connect contain content "
    "context continue control convert correct count create current custom day deep define different does doing "
    "done double drop due during each effect either else empty enable end ensure entire even ever every example "
    "except expand expect extra fact fall fast few field file fill finally find fix follow form format found full "
    "further get given goal going group hand handle happen here hold how ignore initial inside instead item just "
    "keep know large last later leading least left length less letter level limit line list little local long "
    "look lost low made main make manual many mark match meaning meet might much must name need negative next "
    "normal note nothing now often old open option order otherwise page part pass past path per phase pick place "
    "point position possible present previous prior process public put quote range read real reason reference "
    "remain remember remove replace reset rest result right rule safe same save says scan second see send "
    "sentence set short should simply since single size small sort source space split stand standard start state "
    "still strict support sure switch take test through too top total towards transfer type under unless until "
    "used useful using usual valid value version want way where whether while who wrong zero"
).split()
SEGMENT = 32  # probe words before each marker: a short page shows a run, a 64-token one a whole marker
SEARCH_STEPS = 8  # counts per target; a vocabulary where words are ~1 token needs two or three
TEMPLATE_ALLOWANCE = 32  # tokens a chat template may add around the content, when it cannot be counted


class PromptBuilder:
    def __init__(self, endpoint: Endpoint, counter: Identity, exact: bool, rng: random.Random) -> None:
        self._endpoint = endpoint
        self._counter = counter  # whose credentials /tokenize is called with
        self.exact = exact
        self._rng = rng
        self._words: list[str] = []
        self._filler_counts: dict[int, int] = {}
        self._marker_tokens: int | None = None  # one marker's tokens; all markers have one form
        self._segment_tokens: int | None = None  # SEGMENT probe words and a marker: probe text's unit

    async def count(self, content: str) -> int:
        body = {"model": self._endpoint.model, "messages": [{"role": "user", "content": content}]}
        response = await self._endpoint.post("/tokenize", body, self._counter)
        try:
            count = response.json()["count"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CannotRun(f"/tokenize stopped answering: HTTP {response.status_code}") from exc
        if not isinstance(count, int):
            raise CannotRun("/tokenize answered without an integer count")
        return count

    async def counted(self, content: str, label: str) -> Prompt:
        """Any content, with its count (or a lower bound of it)."""
        if self.exact:
            return Prompt(content, await self.count(content), True, label)
        return Prompt(content, len(content.split()), False, label)

    def _filler_text(self, words: int) -> str:
        while len(self._words) < words:
            self._words.append(self._rng.choice(FILLER_WORDS))
        return " ".join(self._words[:words])

    async def _filler_count(self, words: int) -> int:
        if words not in self._filler_counts:
            self._filler_counts[words] = await self.count(self._filler_text(words))
        return self._filler_counts[words]

    async def filler(self, target: int, label: str) -> Prompt:
        """A prompt of `target` tokens: exactly when /tokenize allows (else the nearest found), else at least."""
        if not self.exact:
            return Prompt(self._filler_text(max(1, target)), max(1, target), False, label)
        base = await self._filler_count(0)
        below, above = 0, None  # word counts known to give fewer / more tokens than the target
        words = max(1, target - base)
        for _ in range(SEARCH_STEPS):
            tokens = await self._filler_count(words)
            if tokens == target:
                return Prompt(self._filler_text(words), tokens, True, label)
            if tokens < target:
                below = max(below, words)
            else:
                above = words if above is None else min(above, words)
            if above is not None and above - below <= 1:
                break
            step = target - tokens  # words are about one token each; the bracket keeps this from oscillating
            words = words + step
            words = max(below + 1, words if above is None else min(above - 1, words))
        return await self._closest(target, below, label)

    async def _closest(self, target: int, below: int, label: str) -> Prompt:
        """The last word overshoots (it is several tokens): fill the gap with one-token words instead."""
        tokens = await self._filler_count(below)
        content = self._filler_text(below)
        padded = content + " a" * (target - tokens)
        padded_tokens = await self.count(padded)
        if abs(padded_tokens - target) < abs(tokens - target):
            return Prompt(padded, padded_tokens, True, label)
        return Prompt(content, tokens, True, label)

    async def markers(self, identity: Identity, budget: int, label: str) -> Prompt:
        """As many of the identity's markers as fit in `budget` tokens, in random order, and nothing else.

        Nothing else, so that whatever part of it an endpoint leaks, a stale cache page or a stream's chunks,
        is mostly marker.
        """
        marker = identity.markers[0]
        if not self.exact:
            count = max(1, (budget - TEMPLATE_ALLOWANCE) // (len(marker) + 1))
            content = self._marker_text(identity, count)
            # ASCII is at most one token per character, so this many markers fit; the bound reported is one each.
            return Prompt(content, count, False, label)
        base = await self._filler_count(0)
        if self._marker_tokens is None:
            self._marker_tokens = max(1, await self.count(marker) - base)
        each = self._marker_tokens
        count = max(1, (budget - base) // each)
        for _ in range(3):
            content = self._marker_text(identity, count)
            tokens = await self.count(content)
            if tokens <= budget or count == 1:
                return Prompt(content, tokens, True, label)
            count = max(1, count - -(-(tokens - budget) // each))
        return Prompt(content, tokens, True, label)

    def _marker_text(self, identity: Identity, count: int) -> str:
        return " ".join(self._rng.choice(identity.markers) for _ in range(count))

    async def probe_text(self, identity: Identity, budget: int, label: str) -> Prompt:
        """Probe text of the identity, as much as fits in `budget` tokens; it starts with words, so that its first
        page (the one a stale-KV engine shows first) holds a run.
        """
        # More items than can fit: each word and each marker is at least one token.
        items = self._probe_items(identity, max(budget, SEGMENT + 1))
        if not self.exact:
            return self._probe_estimate(items, budget - TEMPLATE_ALLOWANCE, label)
        base = await self._filler_count(0)
        if self._segment_tokens is None:
            self._segment_tokens = max(1, await self.count(" ".join(items[: SEGMENT + 1])) - base)
        count = max(1, min(len(items), (budget - base) * (SEGMENT + 1) // self._segment_tokens))
        content = " ".join(items[:count])
        tokens = await self.count(content)
        if tokens > budget and count > 1:
            # The estimate is an average; every item is at least one token, so one fewer per token over fits.
            content = " ".join(items[: max(1, count - (tokens - budget))])
            tokens = await self.count(content)
        return Prompt(content, tokens, True, label)

    def _probe_items(self, identity: Identity, count: int) -> list[str]:
        return [
            self._rng.choice(identity.markers) if index % (SEGMENT + 1) == SEGMENT else self._rng.choice(PROBE_WORDS)
            for index in range(count)
        ]

    @staticmethod
    def _probe_estimate(items: list[str], room: int, label: str) -> Prompt:
        """Without /tokenize: as many items as fit in `room` characters, since ASCII is at most a token a character."""
        taken: list[str] = []
        used = -1  # characters: the items and a space between each two
        for item in items:
            used += len(item) + 1
            if used > room and taken:
                break
            taken.append(item)
        # Each item is at least one token: the count reported is that lower bound.
        return Prompt(" ".join(taken), len(taken), False, label)
