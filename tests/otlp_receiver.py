"""An OTLP/HTTP trace receiver on 127.0.0.1, as a collector's would take the gateway's exports: each POST to
/v1/traces kept as it came (the raw protobuf, to search for what must never be in it) and decoded with OpenTelemetry's
own messages (opentelemetry-proto) into spans a test can assert on, and print as trees.

The integration tests start it in a thread (`otlp_receiver`); the benchmarks too, as the sink a traced gateway
exports to.
"""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.server.serving import run_server

PATH = "/v1/traces"
KINDS = {ProtoSpan.SPAN_KIND_SERVER: "server", ProtoSpan.SPAN_KIND_CLIENT: "client"}


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, kind) if kind is not None else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        found[pair.key] = value_of(pair.value)
    return found


def _short(value: Any) -> Any:
    return f"{value:.4f}" if isinstance(value, float) else value


@dataclass(frozen=True)
class ExportedSpan:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    failed: bool
    resource: dict[str, Any]

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class OtlpReceiver:
    url: str = ""  # the traces endpoint, as tracing.endpoint takes it
    exports: list[bytes] = field(default_factory=list)  # every export's body, decompressed
    spans: list[ExportedSpan] = field(default_factory=list)

    def take(self, body: bytes) -> None:
        self.exports.append(body)
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ExportedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=KINDS.get(span.kind, "internal"),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes=attributes_of(span.attributes),
                            events=[(event.name, attributes_of(event.attributes)) for event in span.events],
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            failed=span.status.code == span.status.STATUS_CODE_ERROR,
                            resource=resource,
                        )
                    )

    @property
    def raw(self) -> bytes:
        return b"".join(self.exports)

    def roots(self) -> list[ExportedSpan]:
        return [span for span in self.spans if span.kind == "server"]

    def children(self, parent: ExportedSpan) -> list[ExportedSpan]:
        found = [s for s in self.spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id]
        return sorted(found, key=lambda s: s.start_ns)

    async def wait_for(self, done: Callable[[OtlpReceiver], bool], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self):
            assert time.monotonic() < deadline, f"{len(self.spans)} spans received, not what was waited for"
            await asyncio.sleep(0.02)

    def tree(self, root: ExportedSpan, shown: tuple[str, ...] = ()) -> str:
        """The span tree under `root`, one span a line, with the attributes named in `shown` and every event."""
        lines: list[str] = []

        def walk(span: ExportedSpan, lead: str, tail: str) -> None:
            values = " ".join(f"{k}={_short(span.attributes[k])}" for k in shown if k in span.attributes)
            kind = f" [{span.kind}]" if span.kind != "internal" else ""
            failed = " FAILED" if span.failed else ""
            lines.append(f"{lead}{span.name}{kind} {span.ms:.2f} ms{failed} {values}".rstrip())
            for name, attributes in span.events:
                detail = " ".join(f"{k}={v}" for k, v in attributes.items())
                lines.append(f"{tail}  · event {name} {detail}".rstrip())
            kids = self.children(span)
            for n, kid in enumerate(kids):
                last = n == len(kids) - 1
                walk(kid, tail + ("└─ " if last else "├─ "), tail + ("   " if last else "│  "))

        walk(root, "", "")
        return "\n".join(lines)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()

    async def export(request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        receiver.take(body)
        answer = ExportTraceServiceResponse().SerializeToString()
        return Response(answer, media_type="application/x-protobuf")

    with run_server(Starlette(routes=[Route(PATH, export, methods=["POST"])])) as url:
        receiver.url = url + PATH
        yield receiver
