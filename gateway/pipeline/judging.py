"""A judge: the same request answered again, greedily and whole, on another replica of the model, to tell a fragment
of another tenant's prompt that the recipient's own request makes the model say from a stale page
(docs/fingerprints.md, "Verdicts"). What a judge asks, what of its answer is read, and how it runs.

A judge is asked when a suspect is found (`Judges.judge`), or, for a tenant past `max_judges_per_day` on the model,
with the request itself, beside the engine's own answer (a `Judgement`): such an answer is released only once its
judge answered, by one rule whether a suspect needed the judge or not, so its time tells nothing.

A judge is a generation like any other, and goes the way one does: it holds a slot (the tenant's in-flight count,
the gauge), is placed and counted on its replica (`upstream.placement.Confined`: only the model's replicas other than
the one whose answer it judges), waits its turn in the fair gate, and its tokens are charged to the tenant who drew
it. It is not refused by the tenant's concurrency cap or token limit, which its request passed already: a judge that
cannot run makes its suspect a leak, and a tenant's own limits must not make one. Its prompt is the request's own,
admitted against the model's limit (every replica's). How many a tenant draws is bounded across instances by the
verdict bound (judges of the day, then judged from the start: incidents/verdicts.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.accesslog import RequestRecord
from gateway.errors import GatewayError
from gateway.incidents.ledger import JUDGED, LedgerWriter, Served
from gateway.incidents.reporting import Reporter
from gateway.incidents.verdicts import VerdictBound
from gateway.metrics import GatewayMetrics
from gateway.pipeline.admission import Admission
from gateway.pipeline.slot import Slot, Slots
from gateway.schemas_pooling import INPUTS_REQUESTS, PipelineRequest
from gateway.settings import ModelSettings, TenantSettings
from gateway.supervisor import Spawn
from gateway.tracing import JUDGE, REPLICA, VERDICT
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.fairness import Gate
from gateway.upstream.placement import Confined
from gateway.upstream.proxy import Upstream, parse_json_body
from isolation.channels import prune, texts, token_streams
from isolation.escapes import readings
from isolation.events import IsolationEvent
from isolation.fingerprints import AnswerCheck, Fingerprinter
from isolation.guard import Suspect
from isolation.winnowing import Fingerprints, Hasher

INDUCED = "fingerprint_induced"  # the isolation event of a judged fragment that was no leak
MAX_VERDICTS = 4  # judges one answer may ask for: one per victim, and an answer names few

# What a judge's answer does without: it is read whole, once. Everything else stays as the tenant sent it (stop
# strings, min_tokens, biases, tools, formats, logprobs), so the judge says what the same request says, greedily.
JUDGE_DROPS = ("stream", "stream_options", "best_of", "prompt_logprobs", "echo")

# Every gram a judge's answer said, or None when it could not be asked or did not answer.
Said = frozenset[int] | None


@dataclass(frozen=True)
class Judgement:
    """A judge asked with the request, before anything of its answer was read: where, and what it says once done."""

    replica: Replica
    said: asyncio.Task[Said]


def judge_body(body: bytes) -> bytes:
    """The request as forwarded, as its judge asks it: greedy, whole, with the output admission reserved (sent as it
    was: the judge fits the window as the request did, and writes at least as far as the answer can have gone)."""
    payload = orjson.loads(body)
    for name in JUDGE_DROPS:
        payload.pop(name, None)
    payload["temperature"] = 0.0
    if not payload.get("use_beam_search"):
        payload["n"] = 1  # greedy choices are all alike (beam search keeps its width: its best beams differ)
    return orjson.dumps(payload)


def grams_said(answer: dict[str, Any], hasher: Hasher) -> Said:
    """Every gram of every text of every choice of a judge's answer (content, reasoning, refusal, tool-call names and
    arguments) and of its logprob tokens, chosen and ranked, in each of their readings (escapes.readings); None
    without choices."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return None
    found: list[str] = []
    said: list[str] = []
    for choice in choices:
        if isinstance(choice, dict):
            prune({"choices": [choice]})
            said += [holder[name] for _, holder, name in texts(choice)]
            logprobs = choice.get("logprobs")
            found += ["".join(pieces) for pieces in token_streams(logprobs).values()] if logprobs else []
    # Its texts one by one, and joined as the guard read the answer's (a fragment it found may span two of them).
    found += [*said, "".join(said), " ".join(said)] if len(said) > 1 else said
    return frozenset(gram for text in found for reading in readings(text) for gram in hasher.grams(reading).tolist())


@dataclass(frozen=True, kw_only=True)
class Judging:
    """What judges use, shared by every answer's: where they run and how they are held, placed, charged and recorded,
    the verdict bound, and where an induced fragment's event is reported."""

    pool: ReplicaPool
    upstream: Upstream
    fingerprints: Fingerprinter | None
    verdicts: VerdictBound
    ledger: LedgerWriter
    metrics: GatewayMetrics
    gate: Gate
    slots: Slots
    reporter: Reporter
    spawn: Spawn


class Judged(Protocol):
    """The request a judge answers again (pipeline.inference.InferenceCall)."""

    tenant: TenantSettings
    model: ModelSettings
    request: PipelineRequest
    admission: Admission
    replica: Replica
    upstream_id: str
    record: RequestRecord  # its trace, with tracing on, holds the judges' spans

    @property
    def sent(self) -> tuple[str, bytes] | None: ...
    def answer_bound(self) -> int: ...
    def own_grams(self) -> Fingerprints: ...
    def served(self, replica: Replica, start: float, verdict: str) -> Served: ...
    def event(self, kind: str, detail: str, victim_tenant: str = "", epoch: str = "") -> IsolationEvent: ...
    def fingerprint(self, replica: Replica) -> Awaitable[None]: ...


class Judges:
    """The judges of one answer: the one asked with its request, if any, and those its suspects ask."""

    def __init__(self, judging: Judging, call: Judged) -> None:
        self._judging = judging
        self._call = call
        self._asked = 0  # suspects judged in this answer
        self._judgement: Judgement | None = None

    def cancel(self) -> None:
        if self._judgement is not None:
            self._judgement.said.cancel()

    def from_start(self) -> None:
        """Ask the judge now, beside the engine, when this tenant's answers on the model are judged from their start
        (past its judges of the day on a suspect): the answer then waits for it, whether a suspect needs it or not."""
        call, judging = self._call, self._judging
        if (judgement := self._judgement) is not None:
            if judgement.replica is not call.replica:
                return
            judgement.said.cancel()  # the request moved to the judge's replica (its first one refused to connect)
            self._judgement = None
        if judging.fingerprints is None or isinstance(call.request, INPUTS_REQUESTS):
            return
        if not judging.verdicts.judged_from_start(call.tenant.id, call.model.name):
            return
        replica = self._replica()
        if replica is not None:
            judging.metrics.judges.labels(call.tenant.id, call.model.name, "start").inc()
            self._judgement = Judgement(replica, asyncio.create_task(self._regenerate(replica)))

    async def until_judged(self) -> None:
        """The release rule of an answer judged from its start: none of it is read, nor goes out, before its judge
        answered; a suspect found in it is then decided at once, so a judged answer takes a clean one's time."""
        if self._judgement is not None:
            # Not `await`: a judge that failed is for a suspect to find (unjudged), not for a clean answer.
            await asyncio.wait([self._judgement.said])

    async def judge(self, suspect: Suspect) -> frozenset[int] | None:
        """Whether a fragment of another tenant's prompt in this answer was induced: the same request, greedy, on
        another replica (preferably one the victim's prompts never went to), says it too. A stale page cannot follow
        a request to another replica; a text the recipient had the model write (a public text, a candidate of an
        oracle) does. Returns the victim's grams that the judge's answer holds (no evidence in this answer from now
        on) when it was induced, else None (a leak). Every verdict is counted and recorded for operators."""
        call, judging = self._call, self._judging
        judgement = self._judgement
        replica = judgement.replica if judgement is not None else self._replica(suspect.victim)
        verdict, cleared = "unjudged", None
        try:
            if replica is not None and self._asked < MAX_VERDICTS:
                self._asked += 1
                said = await (judgement.said if judgement is not None else self._on_suspect(replica))
                if said is not None:
                    cleared = self._came_back(replica, suspect, said)
                    verdict = "leak" if cleared is None else "induced"
        finally:
            judging.metrics.fragment_verdicts.labels(call.tenant.id, call.model.name, call.replica.name, verdict).inc()
            if call.record.trace is not None:
                judge = {REPLICA: replica.name} if replica is not None else {}
                call.record.trace.event(VERDICT, {"verdict": verdict, "victim": suspect.victim, **judge})
            if verdict != "induced":  # what the tenant sees: a withheld answer
                await judging.verdicts.draw(call.tenant.id, call.model.name)
        if cleared is None or replica is None:
            return None
        detail = f"a fragment of another tenant's prompt that the answer was induced to say (judged on {replica.name})"
        # Not awaited: a store's round trip would make the answer that a judge cleared the slower one.
        judging.spawn(judging.reporter.report(call.event(INDUCED, detail, victim_tenant=suspect.victim)))
        return cleared

    async def _on_suspect(self, replica: Replica) -> Said:
        """A judge asked once a suspect is found: the answer waits for it, which its client sees, so each counts
        against the tenant's judges of the day on the model (past them, its answers are judged from their start)."""
        call, judging = self._call, self._judging
        judging.metrics.judges.labels(call.tenant.id, call.model.name, "suspect").inc()
        await judging.verdicts.judge(call.tenant.id, call.model.name)
        return await self._regenerate(replica)

    def _others(self) -> list[Replica]:
        """Where a judge may run: the model's routable replicas but the one whose answer it judges."""
        answering = self._call.replica
        return [r for r in self._judging.pool.routable(self._call.model) if r is not answering]

    def _replica(self, victim: str | None = None) -> Replica | None:
        """Another routable replica of the model, one the victim's recent prompts never went to if there is one (the
        least busy; before a suspect no victim is known)."""
        fingerprints = self._judging.fingerprints
        assert fingerprints is not None
        others = self._others()
        clean = [r for r in others if victim is not None and not fingerprints.index.sent(victim, r.name)]
        return min(clean or others, key=lambda r: r.in_flight, default=None)

    async def _regenerate(self, replica: Replica) -> Said:
        """Every gram the judge says answering this request, greedily and whole (grams_said), on `replica` or, when
        it has no room, another of `_others` the fair gate places it on; None when it could not be asked or did not
        answer. Counted, placed, queued and charged as a request of the tenant's (the module's docstring)."""
        call, judging = self._call, self._judging
        fingerprints = judging.fingerprints
        assert fingerprints is not None
        if call.sent is None:
            return None
        path, body = call.sent
        slot = Slot(judging.slots, call.tenant, call.model, capped=False)
        start, tried, used = time.time(), False, 0
        trace = call.record.trace
        span = None if trace is None else trace.begin(JUDGE)
        try:
            placement = Confined(replica, self._others, slot)
            await judging.gate.enter(call.model, call.tenant, placement, batch=False, gone=None)
            replica = placement.replica
            await call.fingerprint(replica)  # the tenant's prompt goes there now too
            tried = True
            bound = call.answer_bound()
            hop = None if trace is None else trace.hop(replica.name, replica.url, span)
            response = await judging.upstream.open(replica, path, judge_body(body), f"{call.upstream_id}.j", hop)
            try:
                raw = await response.read(bound + 1)
            finally:
                await response.aclose()
            answer = parse_json_body(replica, raw)
            used = charged(answer, call.admission)
        except GatewayError:
            return None
        finally:
            slot.release(used, ran=tried)
            if tried:
                judging.ledger.record(call.served(replica, start, JUDGED))
            if trace is not None:
                trace.done(span, {REPLICA: replica.name})
        return None if len(raw) > bound else grams_said(answer, fingerprints.hasher)

    def _came_back(self, replica: Replica, suspect: Suspect, said: frozenset[int]) -> frozenset[int] | None:
        """The victim's grams a judge said, when they hold the two that made the suspect (else None)."""
        fingerprints = self._judging.fingerprints
        assert fingerprints is not None
        call = self._call
        # The victim's grams in the index of the replica whose answer is judged: those are what the rest of it is
        # checked against (an index by time looks on every replica).
        check = AnswerCheck(
            fingerprints.index, fingerprints.hasher, call.replica.name, call.tenant.incarnation(), call.own_grams(),
            only=suspect.victim,
        )  # fmt: skip
        found = frozenset(check.found(said))
        return found if found.issuperset(suspect.pair) else None


def charged(answer: dict[str, Any], admission: Admission) -> int:
    """The tokens a judge's answer is charged to its tenant: the prompt as its request was charged up front (the
    gateway's injected tokens are not the tenant's), and what it wrote (all it was allowed, when its usage does not
    say)."""
    usage = answer.get("usage")
    written = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return admission.estimate + (written if type(written) is int and written >= 0 else admission.max_tokens)
