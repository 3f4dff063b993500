"""The app's tracer: an OpenTelemetry TracerProvider built from the `tracing` settings, owned by the lifespan.

Spans are batched and sent over OTLP/HTTP by the SDK's BatchSpanProcessor, from its own thread: ending a span on the
event loop only appends it to a queue, and a slow or absent collector costs the loop nothing (past `max_queue_size`
spans are dropped). The provider is the app's, never the process's global one, so that several apps in one process
(the tests, the demo) each trace apart; `aclose` sends what is left before the lifespan ends.

A client's own traceparent is a header any tenant can write. Joining its trace would let a tenant choose the trace ids
of the gateway's spans (and so the engine's: a trace id chosen to collide with another tenant's mixes their spans in
the operators' backend) and decide, by its sampled flag, whether its requests are traced at all (an attacker probing
for leaks would switch its traces off). So by default (`client_context: link`) every request starts a trace of the
gateway's own, sampled by the gateway's sampler alone, and the client's context is only recorded as a link, which
lets the client's trace be found without handing it any control; `parent` joins it, for deployments whose clients
are all trusted or whose own proxy sets the header. A client's tracestate is never read, nor sent on.
"""

from __future__ import annotations

import asyncio
import re
import time
from importlib.metadata import version

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context

from gateway.settings import TracingSettings
from gateway.tracing.spans import RequestTrace

SCOPE = "bulkhead"
# W3C Trace Context, version 00 and the versions after it (which may add fields); at most what a sane header holds,
# read without the SDK's propagator, which logs a warning for each bad header: a log line any client could write.
TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")
MAX_TRACEPARENT = 256
BATCH = 512  # spans per export, the SDK's default (OTEL_BSP_MAX_EXPORT_BATCH_SIZE)


def sampler(name: str, ratio: float) -> Sampler:
    """The sampler OTEL_TRACES_SAMPLER names, its ratio OTEL_TRACES_SAMPLER_ARG."""
    base = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF}.get(name.removeprefix("parentbased_"))
    chosen = base if base is not None else TraceIdRatioBased(ratio)
    return ParentBased(chosen) if name.startswith("parentbased_") else chosen


def client_context(header: str | None) -> SpanContext | None:
    """The span context of a client's traceparent header, None when there is none or it is not valid."""
    if header is None or len(header) > MAX_TRACEPARENT:
        return None
    found = TRACEPARENT.fullmatch(header.strip())
    if found is None:
        return None
    version_, trace_id, span_id, flags, more = found.groups()
    if version_ == "ff" or (version_ == "00" and more) or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))


class Tracing:
    """Starts each request's trace, and sends the spans (module docstring)."""

    def __init__(self, settings: TracingSettings, instance: str) -> None:
        exporter = OTLPSpanExporter(
            endpoint=settings.endpoint,
            headers=dict(settings.headers),
            timeout=settings.timeout_s,
            compression=Compression.Gzip if settings.compression == "gzip" else Compression.NoCompression,
        )
        self._processor = BatchSpanProcessor(
            exporter,
            max_queue_size=settings.max_queue_size,
            schedule_delay_millis=settings.export_interval_s * 1000,
            max_export_batch_size=min(BATCH, settings.max_queue_size),
            export_timeout_millis=settings.timeout_s * 1000,
        )
        attributes = {
            **settings.resource_attributes,
            "service.name": settings.service_name,
            "service.version": version("bulkhead"),
            "service.instance.id": instance,
        }
        # Not Resource.create, nor the SDK's own sampler or exit hook: each would read the environment or act on
        # the process, and settings.py alone reads the one, the lifespan alone the other.
        self._provider = TracerProvider(
            sampler=sampler(settings.sampler, settings.sampler_ratio),
            resource=Resource(attributes),
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer(SCOPE, version("bulkhead"))
        self._join = settings.client_context == "parent"

    def request(self, method: str, route: str, started: float, header: str | None) -> RequestTrace:
        """The trace of a request that arrived at `started` (time.perf_counter()) on `route`, with the client's
        traceparent `header`."""
        client = client_context(header)
        context, links = Context(), list[Link]()
        if client is not None and self._join:
            context = set_span_in_context(NonRecordingSpan(client))
        elif client is not None:
            links.append(Link(client))
        # Backdated to the request's arrival: its key's check and its body's reading are in it too.
        start = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        attributes = {"http.request.method": method, "http.route": route}
        root = self._tracer.start_span(
            f"{method} {route}", context, SpanKind.SERVER, attributes, links, start_time=start
        )
        return RequestTrace(self._tracer, root)

    async def aclose(self) -> None:
        """Send the spans still queued, and stop (in a thread: the export is a blocking HTTP call)."""
        await asyncio.to_thread(self._provider.shutdown)
