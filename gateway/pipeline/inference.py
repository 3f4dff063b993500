"""The path of one inference request, step by step: authenticate, read, validate, admit, route, forward, relay."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.errors import (
    AnswerWithheld,
    BackendBadResponse,
    GatewayError,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    UpstreamError,
)
from gateway.incidents.ledger import DELIVERED, FAILED, PARTIAL, WITHHELD, LedgerWriter, Served
from gateway.incidents.quarantine import Responder
from gateway.incidents.reporting import LEAKS, USAGE_MISMATCH, Reporter
from gateway.incidents.tracking import Tracker
from gateway.incidents.verdicts import VerdictBound
from gateway.leftovers import let_go
from gateway.metrics import GatewayMetrics
from gateway.offload import heavy, ids_decoder, in_turn
from gateway.pipeline import embeddings, scoring
from gateway.pipeline.admission import Admission, admit, admit_inputs
from gateway.pipeline.counting import LocalCounter, Prompt, PromptCounter
from gateway.pipeline.judging import Judges, Judging
from gateway.pipeline.outcome import DONE, Answer, Event, Outcome, Stream
from gateway.pipeline.recount import ask_count, shape, tokenize_body
from gateway.pipeline.relay import StreamFailed, StreamFilter, StreamWithheld, UsageWanted, failing_closed, filtered
from gateway.pipeline.slot import Slot, Slots
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InferenceRequest,
    not_applied,
    request_path,
    validate,
)
from gateway.schemas_pooling import (
    INPUTS_REQUESTS,
    InputsRequest,
    PipelineRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from gateway.settings import LimitSettings, ModelSettings, Settings, TenantSettings
from gateway.supervisor import Spawn
from gateway.tracing import ADMISSION, COUNT, PLACEMENT, PLACEMENT_REASON, QUEUE, RATE_LIMIT, REPLICA, Hop
from gateway.upstream.backends import Replica
from gateway.upstream.capacity import CapacityMonitor
from gateway.upstream.fairness import Gate
from gateway.upstream.placement import Placement
from gateway.upstream.proxy import Upstream, UpstreamResponse, parse_json_body
from gateway.upstream.routing import Router
from isolation.channels import prune
from isolation.events import IsolationEvent
from isolation.fingerprints import AnswerCheck, Fingerprinter, Mark, Prepared
from isolation.fitted import fitted
from isolation.guard import FRAGMENT, MARKER, Leak, OutputGuard
from isolation.inject import completion_prefix, hide_injected, inject_chat, inject_completion
from isolation.leaks import LeakPolicy
from isolation.markers import MarkerRegistry
from isolation.salts import CacheSalts
from isolation.suspect_text import SuspectText
from isolation.verify import usage_problem
from isolation.winnowing import NO_GRAMS, Fingerprints

SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
# What one token of one choice can take in an honest answer, per alternative: a chat logprob entry with its bytes
# list is ~80 bytes of JSON (measured: 1.6 KB a token with 20 alternatives). A backend that sends more than
# answer_bound allows would only grow the gateway's memory.
TOKEN_BYTES = 256
ANSWER_BASE_BYTES = 1 << 20
DATA = b"data: "
# A surface's work at a stream's end, told whether the backend ended it with its [DONE] (run's docstring).
AtEnd = Callable[[bool], Awaitable[object]]
STOPPED = "stopped"  # the error code of a queued item its worker stopped (jobs/worker.py)
LEAK_DETAILS = {
    MARKER: "another tenant's canary marker in the answer",
    FRAGMENT: "a fragment of another tenant's recent prompt to this replica in the answer",
}

log = logging.getLogger("bulkhead.counting")


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    schema: (
        type[ChatCompletionRequest]
        | type[CompletionRequest]
        | type[EmbeddingRequest]
        | type[ScoreRequest]
        | type[RerankRequest]
    )


CHAT = Route("chat", "/v1/chat/completions", ChatCompletionRequest)
# A Responses request, asked of the engine on its chat route, stateless: the rendering the gateway counts is the one
# the engine runs (api/responses.py; a background one from the queue: jobs/worker.py).
RESPONSES = Route("responses", "/v1/chat/completions", ChatCompletionRequest)
COMPLETIONS = Route("completions", "/v1/completions", CompletionRequest)
EMBEDDINGS = Route("embeddings", "/v1/embeddings", EmbeddingRequest)
POOLING = Route("pooling", "/pooling", PoolingRequest)
SCORE = Route("score", "/v1/score", ScoreRequest)
RERANK = Route("rerank", "/v1/rerank", RerankRequest)


def resolve_model(settings: Settings, tenant: TenantSettings, name: str) -> ModelSettings:
    model = settings.model(name)
    if model is None:
        raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
    if not tenant.may_use(name):
        raise ModelNotAllowed(f"This API key may not use the model '{name}'.", param="model")
    return model


def check_task(model: ModelSettings, request: PipelineRequest) -> None:
    """Refuse a request its model's engines do not serve (vLLM would answer it with an error of its own)."""
    if isinstance(request, INPUTS_REQUESTS) and model.task != "embed":
        raise InvalidRequest(
            f"The model '{model.name}' generates text; it makes no embeddings, poolings or scores (its task is "
            "'generate').",
            param="model",
        )
    if not isinstance(request, INPUTS_REQUESTS) and model.task != "generate":
        raise InvalidRequest(
            f"The model '{model.name}' is an embedding model: send its requests to /v1/embeddings, /pooling, "
            "/v1/score or /v1/rerank.",
            param="model",
        )


def output_cap(limits: LimitSettings, tenant: TenantSettings) -> int:
    """The most output tokens this tenant may ask for in one request."""
    return min(limits.max_output_tokens, tenant.limits.max_output_tokens or limits.max_output_tokens)


def check_request_limits(
    limits: LimitSettings, tenant: TenantSettings, model: ModelSettings, request: InferenceRequest
) -> int:
    """Refuse outputs and choices over the caps; return the output size a request without max_tokens gets."""
    output = request.requested_output
    cap = output_cap(limits, tenant)
    if output is not None and output > cap:
        param = request.output_param
        raise InvalidRequest(f"{param} is {output}; at most {cap} output tokens may be requested.", param=param)
    # Not getattr(request, "best_of", None): a name a pydantic model lacks costs 3 µs (its __getattr__ raises).
    best_of = request.best_of if isinstance(request, CompletionRequest) else None
    for name, choices in (("n", request.n), ("best_of", best_of)):
        if choices is not None and choices > limits.max_n:
            raise InvalidRequest(f"{name} is {choices}; at most {limits.max_n} choices may be requested.", param=name)
    # The legacy completions API defaults to 16 tokens (OpenAI's and vLLM's default); chat to the model's reserve.
    default = 16 if isinstance(request, CompletionRequest) else model.default_output_reserve
    return min(default, cap)


def upstream_body(
    payload: dict[str, Any],
    request: InferenceRequest,
    model: ModelSettings,
    admission: Admission,
    salt: str,
    tenant: TenantSettings,
) -> bytes:
    not_applied(payload)
    set_controls(payload, model, salt, tenant)
    # Always: without it the engine would generate up to its whole window, past what admission reserved.
    payload[request.output_param] = admission.max_tokens
    if request.stream:
        # Usage is always asked of the backend, to verify and account for every stream; what the client did not
        # ask for is taken out again. With continuous usage the very first chunk can be verified.
        continuous = model.continuous_usage or request.continuous_usage
        payload["stream_options"] = {
            **(payload.get("stream_options") or {}),
            "include_usage": True,
            "continuous_usage_stats": continuous,
        }
    return orjson.dumps(payload)


def set_controls(payload: dict[str, Any], model: ModelSettings, salt: str, tenant: TenantSettings) -> None:
    """What the gateway alone sets on any request to an engine: the tenant's cache salt and its priority."""
    if model.cache_salt:
        # Always the tenant's own: a salt the client chose could be another tenant's, and would join its cache.
        payload["cache_salt"] = salt
    else:
        payload.pop("cache_salt", None)
    if model.fairness.forward_priority:
        # The tenant's setting is the only source: a client's own `priority` is refused (schemas.ENGINE_CONTROL).
        payload["priority"] = tenant.limits.priority


@dataclass(frozen=True)
class _Read:
    own: Prompt  # the tenant's
    texts: list[str] | None  # its texts to fingerprint: None with fingerprints off, or when its size alone refuses it
    marker: str | None  # planted in the payload
    sent: Prompt  # with the marker
    least: int  # the sent prompt's lower bound in tokens: a walk of its texts, read with them (in a thread)


def unfingerprinted(model: ModelSettings) -> InvalidRequest:
    # Token ids are text to the engine all the same, and only the model's tokenizer tells which.
    return InvalidRequest(
        f"A prompt of token ids needs the model's tokenizer in the gateway (models[].tokenizer for '{model.name}'), "
        "to protect it with prompt fingerprints; send the prompt as text.",
        param="prompt",
    )


class InferenceCall:
    """One admitted request, holding a replica slot and a tenant slot until `close`."""

    def __init__(
        self,
        pipeline: Pipeline,
        record: RequestRecord,
        tenant: TenantSettings,
        model: ModelSettings,
        request: PipelineRequest,
        admission: Admission,
        placement: Placement,
        slot: Slot,
        echo_prefix: str = "",
        prepared: Prepared | asyncio.Future[Prepared] | None = None,
        *,
        batch: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.batch = batch  # a queued item's: no client waits on it
        self.prepared = prepared  # the prompt's fingerprints, registered for each replica before it is sent there
        self.slot = slot
        self.echo_prefix = echo_prefix
        self.limit_headers = slot.limit_headers
        self.record = record
        self.tenant = tenant
        self.model = model
        self.request = request
        self.admission = admission
        self.placement = placement
        self.replica = placement.replica
        record.backend = self.replica.name
        # The engine's request id, unique whatever the client's x-request-id says: vLLM takes the header as its
        # request id, and two requests with one id (a tenant can send another's) must never meet in an engine.
        self.upstream_id = f"{record.request_id}.{secrets.token_hex(8)}"
        self.response: UpstreamResponse | None = None
        self.sent_bytes = 0  # the request as forwarded: an echo can answer with all of it
        self.finished = False
        self._closed = False
        self._injected: int | None = None  # the tokens the gateway injected, once counted
        self._mark: Mark | None = None  # the prompt's last entry in the fingerprint feed
        self.sent: tuple[str, bytes] | None = None  # the path and body forwarded
        self.judges = Judges(pipeline.judging, self)
        self._forwarded_at: float | None = None  # when it was sent (the ledger records only what was)
        self._kinds: list[str] = []  # its isolation events' kinds
        self._withheld = False
        self._events_out = 0  # stream events handed to the client
        # Some of another tenant's data went out with them (_exposed): the victim's words, not the template's
        # scaffolding or the tenant's own text before them.
        self._exposed = False
        # The answer's guard's count of the suspect text it let out, and its `sent` as the last event handed to the
        # client (or the whole answer) went out: the events its checks let through but that never went out (withheld
        # after them) are not counted.
        self._suspect: SuspectText | None = None
        self._suspect_sent = 0
        self._whole = True  # a stream that ended with its [DONE] (one cut short is relayed as it came, in part)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.judges.cancel()
        if self.response is not None:
            await self.response.aclose()
        self.admission.cancel()
        if not self.finished and self.record.status == 200:
            # A queued item has no client to leave: its worker stopped it (its job cancelled, or the worker stopping).
            self.record.status, self.record.error_code = 499, STOPPED if self.batch else "client_disconnected"
        try:
            accesslog.finish(self.record, self.pipeline.metrics)
            self._write_down()
        finally:
            # Whatever the log made of it, the slots are given back: a lost one would cap the tenant for good.
            ran = self.response is not None
            if self.record.prompt_tokens is not None:
                used = self.record.prompt_tokens + (self.record.completion_tokens or 0)
            elif ran and self.record.error_code == "client_disconnected":
                # The engine worked, but the client left before the usage came (a stream without usage on every
                # chunk): the reservation stands, or leaving early would make any answer free of the tokens limit.
                used = self.slot.reserved
            elif ran and self.record.error_code == STOPPED:
                # Stopped before the engine said what it had done; nothing of it went anywhere: the prompt it was
                # sent, and none of the output it had room for.
                used = self.admission.estimate
            else:
                used = 0  # refused, failed or withheld: nothing the tenant received is charged
            self.slot.release(used, ran=ran)

    def _write_down(self) -> None:
        """The exposure ledger's record of this request, once it reached a replica (no await: it is buffered)."""
        if self._forwarded_at is None:
            return
        suspect = 0 if self._suspect is None else self._suspect.chars(self._suspect_sent)
        if self.record.status == 200 and self.finished and self._whole:
            verdict = DELIVERED
        elif self._events_out and (self._exposed or LEAKS.isdisjoint(self._kinds)):
            # (An answer in an incident's window with no leak of its own: what it carried is not known, so a part
            # that went out is one.)
            verdict = PARTIAL
        else:
            verdict, suspect = (WITHHELD if self._withheld else FAILED), 0  # none of it went out
        served = self.served(self.replica, self._forwarded_at, verdict, ",".join(self._kinds), suspect)
        self.pipeline.ledger.record(served)
        if not LEAKS.isdisjoint(self._kinds):
            self.pipeline.metrics.exposed_answers.labels(self.model.name, self.replica.name, verdict).inc()
            self.pipeline.spawn(self.pipeline.tracker.answered(served))

    def served(self, replica: Replica, start: float, verdict: str, kinds: str = "", suspect: int | None = 0) -> Served:
        return Served(
            self.record.request_id, self.tenant.incarnation(), self.model.name, replica.name, start, time.time(),
            verdict, kinds, suspect,
        )  # fmt: skip

    def fail(self, error: GatewayError) -> Answer:
        self.record.status, self.record.error_code = error.status, error.code
        return Answer.refusal(error, {"x-request-id": self.record.request_id, **self.limit_headers})

    async def forward(self, path: str, body: bytes) -> None:
        self.sent_bytes = len(body)
        self.sent = (path, body)
        self._forwarded_at = time.time()
        try:
            await self.fingerprint(self.replica)
            self.judges.from_start()  # before it is sent: the engine may answer only once it has written it all
            await self._open(path, body)
        except InvalidRequest as refusal:
            # The backend's own words about the request: they can quote the prompt, markers included.
            refusal.message = await self.scrub(refusal.message)
            param = request_path(refusal.param, type(self.request))
            refusal.param = param if param is None or await self.scrub(param) == param else None
            raise
        except BackendBadResponse as failure:
            # Its words are never relayed, but a leak there is one all the same.
            await self.scan_dropped("error.body", failure.quoted)
            raise
        self.pipeline.metrics.routed.labels(self.replica.name, self.placement.reason.value).inc()
        fingerprints = self.pipeline.fingerprints
        if fingerprints is not None and not await fingerprints.caught_up(self._mark):
            # Prompts other instances forwarded before this one may not be known here yet, and the answer could carry
            # one unseen. In health the feed is read within a round trip of Redis.
            lag = "the other gateway instances' prompt fingerprints could not be read in time"
            raise await self.withhold(StreamWithheld(lag, "fingerprint_feed_lag"))

    async def fingerprint(self, replica: Replica) -> None:
        """Make this prompt known to every instance as sent to `replica`, before it is (its mark: `_mark`)."""
        fingerprints, prepared = self.pipeline.fingerprints, self.prepared
        if fingerprints is None or prepared is None:
            return
        if isinstance(prepared, asyncio.Future):
            prepared = self.prepared = await prepared
        self._mark = await fingerprints.register(prepared, replica.name)

    async def scrub(self, text: str) -> str:
        guard = self.output_guard()
        if guard is None:
            return text
        try:
            with failing_closed():
                return await guard.check_text(text)
        except StreamWithheld as exc:
            raise await self.withhold(exc) from exc

    async def scan_dropped(self, where: str, text: str) -> None:
        """Scan a text of the backend's that never goes out: a leak in it withholds the answer all the same."""
        guard = self.output_guard()
        if guard is None or not text:
            return
        try:
            with failing_closed():
                await guard.check_removed([(where, text)])
        except StreamWithheld as exc:
            raise await self.withhold(exc) from exc

    async def _open(self, path: str, body: bytes) -> None:
        upstream = self.pipeline.upstream
        try:
            self.response = await upstream.open(self.replica, path, body, self.upstream_id, self._hop(self.replica))
        except UpstreamError as error:
            # Retried once, and only when nothing reached the backend: a request is never sent twice.
            fallback = self.placement.fail_over() if error.before_sending else None
            if fallback is None:
                raise
            self.replica, self.record.backend = fallback, fallback.name
            await self.fingerprint(fallback)
            self.judges.from_start()
            self.response = await upstream.open(fallback, path, body, self.upstream_id, self._hop(fallback))

    def _hop(self, replica: Replica) -> Hop | None:
        """The call to `replica`, traced (with tracing on)."""
        trace = self.record.trace
        return None if trace is None else trace.hop(replica.name, replica.url)

    async def check_usage(self, usage: dict[str, Any] | None) -> None:
        """Raise StreamWithheld when the backend's accounting does not add up."""
        sent = await self.admission.prompt_tokens()
        problem = usage_problem(usage, sent, self.model.usage_tolerance, self.admission.max_tokens * self.request.n)
        if problem is None:
            return
        if problem.prompt_tokens is not None and await self._counts_so(problem.prompt_tokens):
            log.warning(
                "prompt count drift: model %s counted %d tokens where the gateway counted %d, for a %s request on %s "
                "(request %s); the gateway renders this shape otherwise than the engine",
                self.model.name, problem.prompt_tokens, sent, self._shape(), self.record.route, self.record.request_id,
            )  # fmt: skip
            self.pipeline.metrics.count_drift.labels(self.model.name, self.record.route, self._shape()).inc()
            return
        raise StreamWithheld(problem.reason, USAGE_MISMATCH)

    async def _counts_so(self, reported: int) -> bool:
        """Whether the replica that answered, asked to count the request it was forwarded (recount.py), says what its
        usage said: then it read that prompt. Not when it cannot be asked: the answer stays unvouched for."""
        if self.sent is None:
            return False
        path, body = self.sent
        asked = tokenize_body(path, body)
        if asked is None:
            return False
        try:
            counted = await ask_count(self.pipeline.upstream, self.replica, asked)
        except GatewayError:
            return False
        return abs(counted - reported) <= self.model.usage_tolerance

    def _shape(self) -> str:
        assert self.sent is not None
        return shape(*self.sent)

    async def withhold(self, exc: StreamWithheld) -> AnswerWithheld:
        """The error the tenant gets for an answer that cannot be shown safe, once its event is recorded. A usage
        mismatch is the incident's own signature (an engine that answered from a prompt it did not read, its count
        drift ruled out: recount.py), so it is answered as a leak is: its replica suspended and probed, an incident
        opened or joined."""
        self._withheld = True
        if exc.kind == USAGE_MISMATCH:
            await self.pipeline.responder.on_leak(self.event(exc.kind, exc.reason))
        elif exc.kind is not None:
            await self.pipeline.reporter.report(self.event(exc.kind, exc.reason))
        return withheld()

    async def leak(self, leak: Leak) -> None:
        self._exposed = self._exposed or self._goes_out(leak)
        event = self.event(leak.kind, LEAK_DETAILS[leak.kind], victim_tenant=leak.victim, epoch=leak.epoch)
        await self.pipeline.responder.on_leak(event)

    def _goes_out(self, leak: Leak) -> bool:
        """Whether some of what made this leak reaches the client, should the stream have begun: under a policy that
        lets the answer go on (alert, or redact, which sends what follows a marker), or a fragment of a stream held
        only from its first hit (up to min_fragment - 1 of its words left before the hit). A marker under block is
        held whole until decided: what went out before it is no one else's data that any check found."""
        if self.pipeline.settings.isolation.canary.policy != "block":
            return True
        return leak.kind == FRAGMENT and self.pipeline.settings.isolation.fingerprints.stream_hold == "first_hit"

    def event(self, kind: str, detail: str, victim_tenant: str = "", epoch: str = "") -> IsolationEvent:
        """An isolation event about this request."""
        self._kinds.append(kind)
        if self.record.trace is not None:
            self.record.trace.isolation_event(kind, self.replica.name, victim_tenant)
        return IsolationEvent(
            kind=kind,
            request_id=self.record.request_id,
            tenant=self.tenant.id,
            model=self.model.name,
            replica=self.replica.name,
            detail=detail,
            victim_tenant=victim_tenant,
            epoch=epoch,
        )

    async def view_usage(self, usage: dict[str, Any]) -> None:
        """The backend's usage as the tenant sees it and is charged: without the tokens the gateway injected."""
        injected = self._injected
        if injected is None:
            # Counted once: a stream with usage on every chunk asks for it at every event.
            injected = self._injected = await self.admission.injected_tokens()
            self.pipeline.metrics.injected_tokens.labels(self.model.name).observe(injected)
        hide_injected(usage, injected)

    def answer_bound(self) -> int:
        """The most bytes an honest whole answer to this request can take."""
        return answer_bound(self.request, self.admission.max_tokens, self.sent_bytes)

    def own_grams(self) -> Fingerprints:
        """Every gram of the tenant's own prompt (none counts in its answer), as its admission made them."""
        return self.prepared.grams if isinstance(self.prepared, Prepared) else NO_GRAMS

    def output_guard(self) -> OutputGuard | None:
        canary, fingerprints = self.pipeline.settings.isolation.canary, self.pipeline.fingerprints
        if not canary.enabled and fingerprints is None:
            return None
        owner = self.tenant.incarnation()  # whose marker is its own, whose prompts are its own
        counter = self.pipeline.counters[self.model.name]
        decode = ids_decoder(counter.tokenizer.decode) if isinstance(counter, LocalCounter) else None
        stop = self.request.stop
        stops = frozenset([stop] if isinstance(stop, str) else stop or ())
        fragments, hold_tail = None, 0
        if fingerprints is not None:
            if self.pipeline.settings.isolation.fingerprints.stream_hold == "tail":
                hold_tail = fingerprints.hasher.shape.min_fragment - 1
            fragments = AnswerCheck(fingerprints.index, fingerprints.hasher, self.replica.name, owner, self.own_grams())
        return OutputGuard(
            self.pipeline.markers,
            owner,
            LeakPolicy(canary.policy),
            self.leak,
            self.echo_prefix,
            decode,
            stops,
            fragments,
            self.request.n,
            self.judges.judge if fragments is not None else None,
            hold_tail,
        )

    async def complete(self) -> Answer:
        assert self.response is not None
        bound = self.answer_bound()
        raw = await self.response.read(bound + 1)
        self.record.mark_first_byte()
        if len(raw) > bound:
            raise BackendBadResponse(f"Backend '{self.replica.name}' answered more than {bound} bytes.")
        try:
            with failing_closed():
                await self.judges.until_judged()
                body = await self._checked(raw)
        except StreamWithheld as exc:
            raise await self.withhold(exc) from exc
        if self._suspect is not None:
            self._suspect_sent = self._suspect.sent
        self.finished = True
        headers = {"x-request-id": self.record.request_id, **self.limit_headers}
        return Answer(200, body, headers)

    async def _checked(self, raw: bytes) -> dict[str, Any]:
        """A whole answer, pruned, verified and scanned."""
        guard = self.output_guard()
        self._suspect = None if guard is None else guard.suspect
        found = None if isinstance(self.request, INPUTS_REQUESTS) else fitted(raw)
        if found is not None:
            body, removed = found
        else:
            try:
                body = parse_json_body(self.replica, raw)
            except BackendBadResponse:
                if guard is not None:  # never relayed, but a leak there is one all the same
                    await guard.check_removed([("answer.raw", raw.decode("utf-8", "replace"))])
                raise
            if isinstance(self.request, EmbeddingRequest):
                return await self._embeddings(body, self.request, guard)
            if isinstance(self.request, ScoreRequest | RerankRequest):
                return await self._scored(body, self.request, guard)
            removed = prune(body)
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        if guard is not None and removed:
            await guard.check_removed(removed)
        if guard is not None:
            # Scanned before its usage is checked: an answer from a prompt the engine did not read is withheld
            # either way, and whose data it carries names the victims of the incident it opens.
            await guard.check_body(body)
        if self.model.verify_usage:
            await self.check_usage(usage)
        if usage is not None:
            await self.view_usage(usage)
            self.record.take_usage(usage)
        return body

    async def _embeddings(
        self, body: dict[str, Any], request: EmbeddingRequest, guard: OutputGuard | None
    ) -> dict[str, Any]:
        """An embeddings answer built again from its vectors, once they answer the inputs and its usage adds up."""
        vectors, removed = embeddings.vectors(body, request, self.replica.name)
        if guard is not None and removed:
            await guard.check_removed(removed)
        if self.model.verify_usage:
            await self.check_usage(body.get("usage") if isinstance(body.get("usage"), dict) else None)
        answer = embeddings.answer(vectors, request, self.model.name, await self.admission.prompt_tokens())
        self.record.take_usage(answer["usage"])
        return answer

    async def _scored(
        self, body: dict[str, Any], request: ScoreRequest | RerankRequest, guard: OutputGuard | None
    ) -> dict[str, Any]:
        """A scoring answer built again from its scores, once they answer the pairs and its usage adds up."""
        found, removed = scoring.scores(body, request, self.replica.name)
        if guard is not None and removed:
            await guard.check_removed(removed)
        if self.model.verify_usage:
            await self.check_usage(body.get("usage") if isinstance(body.get("usage"), dict) else None)
        answer = scoring.answer(found, request, self.model.name, await self.admission.prompt_tokens())
        self.record.take_usage(answer["usage"])
        return answer

    async def relay(self, at_end: AtEnd | None = None) -> AsyncGenerator[Event, None]:
        """The checked stream; `at_end`: run's, once the backend's stream has ended, before the log is written and
        the stream's end goes out."""
        assert self.response is not None
        record, request = self.record, self.request
        assert not isinstance(request, INPUTS_REQUESTS)  # never streamed
        wanted = UsageWanted(final=request.include_usage, every_chunk=request.continuous_usage)
        check = self.check_usage if self.model.verify_usage else None
        bound = answer_bound(request, request.stream_interval or 1, self.sent_bytes)
        guard = self.output_guard()
        suspect = self._suspect = None if guard is None else guard.suspect
        stream_filter = StreamFilter(wanted, check, self.view_usage, self.model.continuous_usage, guard, bound)
        last: Event | None = None
        try:
            await self.judges.until_judged()
            async for event in filtered(self.response.chunks(), stream_filter):
                record.mark_first_byte()
                self._events_out += 1
                if suspect is not None:
                    self._suspect_sent = suspect.sent
                yield event
            self.finished = True
            self._whole = stream_filter.done
            if at_end is not None:
                await at_end(stream_filter.done)
            last = DONE if stream_filter.done else None
        except StreamWithheld as exc:
            last = self._ended(await self.withhold(exc))
        except StreamFailed:
            last = self._ended(
                BackendBadResponse(f"Backend '{self.replica.name}' reported an error in the middle of the answer.")
            )
        except GatewayError as error:
            last = self._ended(error)
        finally:
            if stream_filter.usage is not None:
                record.take_usage(stream_filter.usage)
            # Before the stream's last event goes out, so the log and metrics are complete when the client is.
            await self.close()
        if last is not None:
            yield last

    def _ended(self, error: GatewayError) -> GatewayError:
        """The stream ends with this error (in an event of its own, then [DONE])."""
        self.finished = True
        self.record.status, self.record.error_code = error.status, error.code
        return error


def answer_bound(request: PipelineRequest, tokens: int, sent_bytes: int) -> int:
    """The most bytes an honest answer (or one stream event) of `tokens` tokens per choice can take."""
    if isinstance(request, EmbeddingRequest):
        return ANSWER_BASE_BYTES + sent_bytes + embeddings.answer_bound(request)
    if isinstance(request, ScoreRequest | RerankRequest):
        return ANSWER_BASE_BYTES + sent_bytes + scoring.answer_bound(request)
    alternatives = (request.top_logprobs or 0) if isinstance(request, ChatCompletionRequest) else request.logprobs or 0
    return ANSWER_BASE_BYTES + sent_bytes + request.n * tokens * (alternatives + 1) * TOKEN_BYTES


def withheld() -> AnswerWithheld:
    # Generic on purpose: the tenant learns that the answer was withheld, not what it contained or whose it was.
    return AnswerWithheld(
        "The backend's answer could not be verified as belonging to this request and was withheld. "
        "The event has been recorded; retrying is safe."
    )


@dataclass(frozen=True)
class Submission:
    """One inference request as the pipeline takes it: from HTTP, from the Workers-style route, from the queue."""

    tenant: TenantSettings
    payload: dict[str, Any]
    session: str | None = None
    batch: bool = False  # a queued job's: waits behind interactive requests, never refused for capacity
    gone: Callable[[], Awaitable[None]] | None = None  # returns when the client has gone away
    reject_if_busy: bool = False  # refused (429 capacity_exceeded) rather than wait in the fair queue for a slot


def refuse(metrics: GatewayMetrics, record: RequestRecord, error: GatewayError) -> Answer:
    """A request refused before it ran: logged, and answered with its request id."""
    record.status, record.error_code = error.status, error.code
    accesslog.finish(record, metrics)
    return Answer.refusal(error, {"x-request-id": record.request_id})


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """The path of one inference request (`run`), whatever surface it came in by, built once by the app's lifespan
    from what it uses (server/app.py)."""

    settings: Settings  # the models, the request limits, the isolation settings
    # Admission: the prompt counted against what the model and the tenant may take, a replica and a slot held.
    counters: dict[str, PromptCounter]
    capacity: CapacityMonitor
    verdicts: VerdictBound
    router: Router
    gate: Gate
    slots: Slots
    salts: CacheSalts
    markers: MarkerRegistry
    fingerprints: Fingerprinter | None
    # The hop, and the answer's judges.
    upstream: Upstream
    judging: Judging
    # What a request leaves behind: its log line and metrics, the ledger's record, its isolation events.
    metrics: GatewayMetrics
    ledger: LedgerWriter
    reporter: Reporter
    responder: Responder
    tracker: Tracker
    spawn: Spawn

    async def run(
        self,
        route: Route,
        submission: Submission,
        record: RequestRecord,
        accept: Callable[[dict[str, Any]], Awaitable[object]] | None = None,
        at_end: AtEnd | None = None,
    ) -> Outcome:
        """The whole pipeline for one request, whatever surface it came in by; the surface renders the outcome.
        `accept` (a whole answer, with its checked body) and `at_end` (a stream, once every event but its end has gone
        to the surface; told whether the backend ended it with its [DONE]): the surface's own work on the answer (its
        reading of it, storing it), raising the GatewayError its client gets instead (an Anthropic `input` that is not
        an object, a response that could not be stored, a stream cut off where the surface cannot say so but in an
        error), so that the log, the metrics and the charge say what the client got."""
        try:
            call, body = await self._admit(route, submission, record)
        except GatewayError as error:
            return refuse(self.metrics, record, error)
        streaming = False
        try:
            await call.forward(route.path, body)
            if call.request.stream:
                streaming = True
                headers = {"x-request-id": record.request_id, "cache-control": "no-cache", **call.limit_headers}
                return Stream(call.relay(at_end), headers, call.close)
            answer = await call.complete()
            if accept is not None and answer.status == 200:
                await accept(answer.body)
            return answer
        except GatewayError as error:
            return call.fail(error)
        finally:
            if not streaming:
                await call.close()

    async def _admit(self, route: Route, submission: Submission, record: RequestRecord) -> tuple[InferenceCall, bytes]:
        tenant, payload = submission.tenant, submission.payload
        record.tenant = tenant.id
        trace = record.trace
        if trace is not None:
            trace.stage(ADMISSION)
        # Every surface's body is validated again here, as the engine's request, then walked for its texts and planted
        # with a marker: ~1.5 µs a value in all, so a large body's (~170 ms for 100,000) goes to a thread, as the
        # surfaces' own validation does, while the loop serves other tenants (docs/benchmarks.md, bench_bodies).
        threaded = heavy(payload)
        parsed = await in_turn(partial(validate, route.schema, payload), threaded)
        if threaded:
            let_go(parsed)
        model = resolve_model(self.settings, tenant, parsed.model)
        check_task(model, parsed)
        self.verdicts.check(tenant.id, model.name)
        record.model, record.stream = model.name, parsed.stream
        if trace is not None:
            trace.asked(route.path, route.name, model.name, stream=parsed.stream)
        if isinstance(parsed, INPUTS_REQUESTS):
            return await self._admit_inputs(submission, record, model, parsed)
        default_output = check_request_limits(self.settings.limits, tenant, model, parsed)
        slot = Slot(self.slots, tenant, model)
        prepared = None
        try:
            chat = isinstance(parsed, ChatCompletionRequest)
            limit = self.capacity.require(model, tenant)
            read = await in_turn(partial(self._read_prompt, tenant, model, payload, limit.tokens, chat), threaded)
            own, sent, marker = read.own, read.sent, read.marker
            # Started now so that a large prompt is hashed while it is counted and its request routed and queued; not
            # for one its size alone refuses (admission says so at once), which would make hashing the cheapest
            # refusal's cost.
            if read.texts is not None:
                prepared = self._prepare_fingerprints(model, own, read.texts)
            # Routed before counting: a backend that counts the prompt should be the one that will serve it.
            if trace is not None:
                trace.stage(PLACEMENT, ADMISSION)
            placement = Placement(self.router, model, tenant.id, submission.session, slot)
            if trace is not None:
                trace.note({REPLICA: placement.replica.name, PLACEMENT_REASON: placement.reason.value})
                trace.stage(COUNT, ADMISSION)
            admission = await admit(
                sent,
                own,
                read.least,
                parsed.requested_output,
                default_output,
                model,
                tenant,
                limit,
                self.counters[model.name],
                self.metrics,
                placement.replica,
            )
            if prepared is None and self.fingerprints is not None:
                raise unfingerprinted(model)
            body = upstream_body(payload, parsed, model, admission, self.salts.salt(tenant.incarnation()), tenant)
            if trace is not None:
                output, choices = admission.max_tokens, parsed.n
                trace.sampling(temperature=parsed.temperature, top_p=parsed.top_p, max_tokens=output, choices=choices)
                trace.stage(RATE_LIMIT, ADMISSION)
            await slot.reserve(admission.estimate + admission.max_tokens * parsed.n)
            if trace is not None:
                trace.stage(QUEUE)
            await self.gate.enter(
                model, tenant, placement, submission.batch, submission.gone, submission.reject_if_busy
            )
            if trace is not None:
                trace.stage(None)
        except BaseException:
            slot.release()
            if isinstance(prepared, asyncio.Future):
                prepared.cancel()
            raise
        echo = isinstance(parsed, CompletionRequest) and parsed.echo and marker is not None
        call = InferenceCall(
            self,
            record,
            tenant,
            model,
            parsed,
            admission,
            placement,
            slot,
            completion_prefix(marker) if echo and marker is not None else "",
            prepared,
            batch=submission.batch,
        )
        return call, body

    async def _admit_inputs(
        self, submission: Submission, record: RequestRecord, model: ModelSettings, parsed: InputsRequest
    ) -> tuple[InferenceCall, bytes]:
        """An embeddings request: each input admitted on its own and all of them together, held like any request. No
        marker is planted (it would change the vectors) and nothing is fingerprinted (no text comes back, and a replica
        that embeds serves nothing else: settings.py)."""
        tenant = submission.tenant
        owner = tenant.incarnation()
        inputs = [Prompt.of_text(value, where, owner) for where, value in parsed.inputs]
        slot = Slot(self.slots, tenant, model)
        trace = record.trace
        try:
            if trace is not None:
                trace.stage(PLACEMENT, ADMISSION)
            placement = Placement(self.router, model, tenant.id, submission.session, slot)
            if trace is not None:
                trace.note({REPLICA: placement.replica.name, PLACEMENT_REASON: placement.reason.value})
                trace.stage(COUNT, ADMISSION)
            admission = await admit_inputs(
                inputs,
                self.settings.limits.max_embedding_tokens,
                model,
                self.capacity.require(model, tenant),
                self.counters[model.name],
                self.metrics,
                placement.replica,
            )
            payload = (
                embeddings.upstream_body(submission.payload)
                if isinstance(parsed, EmbeddingRequest)
                else dict(submission.payload)
            )
            set_controls(payload, model, self.salts.salt(owner), tenant)
            if trace is not None:
                trace.stage(RATE_LIMIT, ADMISSION)
            await slot.reserve(admission.estimate)
            if trace is not None:
                trace.stage(QUEUE)
            await self.gate.enter(
                model, tenant, placement, submission.batch, submission.gone, submission.reject_if_busy
            )
            if trace is not None:
                trace.stage(None)
        except BaseException:
            slot.release()
            raise
        return InferenceCall(self, record, tenant, model, parsed, admission, placement, slot), orjson.dumps(payload)

    def _read_prompt(
        self, tenant: TenantSettings, model: ModelSettings, payload: dict[str, Any], limit: int, chat: bool
    ) -> _Read:
        """A request's prompt read, and its marker planted. Touches the payload alone: a thread may run it."""
        of = Prompt.of_chat if chat else Prompt.of_completion
        own = of(payload, tenant.incarnation())
        counter = self.counters[model.name]
        wanted = self.fingerprints is not None and counter.lower_bound(own) < limit
        texts = list(own.texts()) if wanted else None
        marker = self._plant_marker(tenant, model, payload, chat)
        sent = own if marker is None else of(payload, own.owner)
        return _Read(own, texts, marker, sent, counter.lower_bound(sent))

    def _plant_marker(
        self, tenant: TenantSettings, model: ModelSettings, payload: dict[str, Any], chat: bool
    ) -> str | None:
        """The tenant's marker, in the model's spelling, when one was put into the prompt."""
        canary = self.settings.isolation.canary
        if not canary.enabled:
            return None
        markers = self.markers
        style = markers.of_model(model.name)
        marker = markers.marker(tenant.incarnation(), style.spelling)
        if chat:
            inject_chat(payload, marker, model.marker_placement or canary.placement, style.system_first)
            return marker
        return marker if inject_completion(payload, marker) else None

    def _prepare_fingerprints(
        self, model: ModelSettings, prompt: Prompt, own: list[str]
    ) -> Prepared | asyncio.Future[Prepared] | None:
        """The tenant's own prompt's fingerprints (none of the gateway's markers), made or being made from its `own`
        texts."""
        fingerprints = self.fingerprints
        if fingerprints is None:
            return None
        assert prompt.owner is not None
        if prompt.token_ids is None:
            return fingerprints.prepare(prompt.owner, own)
        counter = self.counters[model.name]
        if not isinstance(counter, LocalCounter):
            return None  # refused once admitted (a prompt over the limit hears that first): unfingerprinted()
        return fingerprints.prepare(prompt.owner, own, partial(counter.tokenizer.decode, prompt.token_ids))
