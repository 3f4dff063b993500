"""One request's spans: the root (the gateway's server span, from the request's arrival to its log line), its stages
beneath it (admission with its placement, count and rate limit; the fair queue; each judge) and every call to an
engine (a `Hop`, whose traceparent the engine receives, so that its own spans join the trace).

Attributes follow OpenTelemetry's semantic conventions: HTTP's for the request, GenAI's for what was asked of the
model and what it used (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...), `bulkhead.*` for the rest
(tenant, replica, verdicts). Only names, numbers and the gateway's own codes go in: never a prompt, an answer, a
marker or a key, and never an isolation event's detail (its kind, replica and victim say what happened).

A request that is not sampled has a trace that records nothing (`recording` False) and makes no span objects; its
engine calls still carry a traceparent, flagged unsampled, so that the engine does not trace them either.
"""

from __future__ import annotations

import time
from typing import Protocol
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.util.types import Attributes

# GenAI's attributes (semantic conventions 1.37+, still incubating: the SDK's constants for them are private).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_STREAM = "gen_ai.request.stream"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_CHOICES = "gen_ai.request.choice.count"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
TENANT = "bulkhead.tenant.id"
REPLICA = "bulkhead.replica"
REQUEST_ID = "bulkhead.request.id"
# The engine's path is what its GenAI operation is: a Responses or Messages request is a chat to the engine.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/embeddings": "embeddings"}
# The request's stages (RequestTrace.stage), and a judge's span beside them.
ADMISSION, PLACEMENT, COUNT, RATE_LIMIT, QUEUE = "admission", "placement", "count", "rate_limit", "queue"
JUDGE = "judge"
PLACEMENT_REASON = "bulkhead.placement.reason"
VERDICT = "bulkhead.fragment_verdict"
ISOLATION_EVENT = "bulkhead.isolation_event"
FIRST_BYTE = "first_byte"


class Finished(Protocol):
    """What a request's record says once it is done (accesslog.RequestRecord)."""

    request_id: str
    tenant: str | None
    backend: str | None
    error_code: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    started: float  # time.perf_counter()
    first_byte: float | None

    @property
    def sent_status(self) -> int: ...


def traceparent(context: SpanContext) -> str:
    """The W3C header for `context`, never with a tracestate: what the engine receives is the gateway's alone."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def since(started_ns: int) -> float:
    return (time.time_ns() - started_ns) / 1e9


class Hop:
    """One call to an engine (the request's, a failover's, a judge's): a client span when recorded, and the
    traceparent the call carries either way."""

    __slots__ = ("_span", "_started", "traceparent")

    def __init__(self, span: Span | None, context: SpanContext) -> None:
        self._span = span
        self._started = time.time_ns()
        self.traceparent = traceparent(context)

    def first_byte(self) -> None:
        if self._span is not None:
            self._span.set_attribute(GEN_AI_FIRST_CHUNK, since(self._started))
            self._span.add_event(FIRST_BYTE)

    def failed(self, error: str) -> None:
        """The call failed (`error`: the gateway's code for it); its span ends now."""
        span = self._span
        if span is not None and span.is_recording():
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR))
            span.end()

    def end(self, status: int) -> None:
        """The answer, of HTTP `status`, was read to its end or given up on (a second end changes nothing)."""
        span = self._span
        if span is not None and span.is_recording():
            span.set_attribute("http.response.status_code", status)
            if status != 200:
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
            span.end()


class RequestTrace:
    """A request's root span and its stages'. Its sequential stages (admission with its placement, count and rate
    limit, then the fair queue) are a chain: one begins where the one before it ends (`stage`). What runs beside them
    (a judge) has a span of its own (`begin`, `done`). Whatever an error left open ends with the request, failed."""

    __slots__ = ("_tracer", "_root", "_context", "_stages", "_open", "_operation", "_model", "recording")

    def __init__(self, tracer: Tracer, root: Span) -> None:
        self._tracer = tracer
        self._root = root
        self.recording = root.is_recording()
        # A request not sampled never parents a span: its context is not made (~1 µs of every such request).
        self._context: Context = set_span_in_context(root) if self.recording else Context()
        self._stages: list[tuple[str, Span]] = []  # the chain's open spans, each the child of the one before it
        self._open: list[Span] = []
        self._operation = "request"  # until the model is known (asked)
        self._model = ""

    def asked(self, path: str, route: str, model: str, *, stream: bool) -> None:
        """The model a request asks of the engine at `path`, on the gateway's `route`: the GenAI operation."""
        self._operation, self._model = OPERATIONS.get(path, route), model
        if self.recording:
            self._root.set_attributes({GEN_AI_OPERATION: self._operation, GEN_AI_MODEL: model, GEN_AI_STREAM: stream})

    def sampling(self, *, temperature: float | None, top_p: float | None, max_tokens: int, choices: int) -> None:
        """How the model is asked to sample, and the output it may write (what admission imposes on the engine)."""
        if self.recording:
            values = {GEN_AI_TEMPERATURE: temperature, GEN_AI_TOP_P: top_p, GEN_AI_MAX_TOKENS: max_tokens}
            values[GEN_AI_CHOICES] = choices
            self._root.set_attributes({name: value for name, value in values.items() if value is not None})

    def stage(self, name: str | None, within: str | None = None) -> None:
        """Stage `name` begins, a child of the open stage named `within` (else of the root); every stage opened since
        that one ends. None: every stage has ended."""
        if not self.recording:
            return
        stages = self._stages
        while stages and stages[-1][0] != within:
            stages.pop()[1].end()
        if name is not None:
            context = set_span_in_context(stages[-1][1]) if stages else self._context
            stages.append((name, self._tracer.start_span(name, context)))

    def note(self, attributes: Attributes) -> None:
        """Attributes of the stage now open."""
        if self.recording and self._stages and attributes:
            self._stages[-1][1].set_attributes(attributes)

    def begin(self, name: str, attributes: Attributes = None) -> Span | None:
        """A span beside the stages, from now until `done` (or the request's end); None when not recorded."""
        if not self.recording:
            return None
        span = self._tracer.start_span(name, self._context, attributes=attributes)
        self._open.append(span)
        return span

    def done(self, span: Span | None, attributes: Attributes = None) -> None:
        """The work of `span` ended (a span the request's end already closed is left as it is)."""
        if span is None or span not in self._open:
            return
        self._open.remove(span)
        if attributes:
            span.set_attributes(attributes)
        span.end()

    def hop(self, replica: str, url: str, parent: Span | None = None) -> Hop:
        """A call to `replica` at `url`, as a client span beneath `parent` (else the root) when recorded."""
        if not self.recording:
            return Hop(None, self._root.get_span_context())
        where = urlsplit(url)
        attributes: dict[str, str | int] = {GEN_AI_OPERATION: self._operation, REPLICA: replica}
        if self._model:
            attributes[GEN_AI_MODEL] = self._model
        if where.hostname:
            attributes["server.address"] = where.hostname
        if where.port:
            attributes["server.port"] = where.port
        context = self._context if parent is None else set_span_in_context(parent)
        name = f"{self._operation} {self._model}".rstrip()
        span = self._tracer.start_span(name, context, SpanKind.CLIENT, attributes)
        return Hop(span, span.get_span_context())

    def event(self, name: str, attributes: Attributes) -> None:
        if self.recording:
            self._root.add_event(name, attributes)

    def isolation_event(self, kind: str, replica: str, victim: str) -> None:
        """An isolation event of this request (a leak, a usage mismatch, an induced fragment, ...): its kind and
        where, never its detail."""
        self.event(ISOLATION_EVENT, {"kind": kind, REPLICA: replica, **({"victim": victim} if victim else {})})

    def end(self, record: Finished) -> None:
        """The request is done: what its log line says goes on the root, and every span still open ends with it."""
        if not self.recording:
            return
        status = record.sent_status
        failed = record.error_code is not None
        for span in [*(span for _, span in self._stages), *self._open]:
            if failed:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
        self._stages.clear()
        self._open.clear()
        root = self._root
        values: dict[str, str | int | float | None] = {
            REQUEST_ID: record.request_id,
            TENANT: record.tenant,
            REPLICA: record.backend,
            "http.response.status_code": status,
            "error.type": record.error_code,
            GEN_AI_INPUT_TOKENS: record.prompt_tokens,
            GEN_AI_OUTPUT_TOKENS: record.completion_tokens,
        }
        if record.first_byte is not None:
            values[GEN_AI_FIRST_CHUNK] = record.first_byte - record.started
        root.set_attributes({name: value for name, value in values.items() if value is not None})
        if status >= 500:  # a server span's errors are its 5xx: a refused request is the client's (HTTP's convention)
            root.set_status(Status(StatusCode.ERROR))
        root.end()
