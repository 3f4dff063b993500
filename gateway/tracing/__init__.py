"""OpenTelemetry tracing, off by default: `Tracing` (the app's tracer, from the `tracing` settings), each request's
`RequestTrace`, and the `Hop` of each call to an engine. With tracing off there is none of them: a request's record
holds no trace, and each stage's only cost is finding that out."""

from gateway.tracing.provider import Tracing
from gateway.tracing.spans import (
    ADMISSION,
    COUNT,
    JUDGE,
    PLACEMENT,
    PLACEMENT_REASON,
    QUEUE,
    RATE_LIMIT,
    REPLICA,
    VERDICT,
    Hop,
    RequestTrace,
)

__all__ = [
    "ADMISSION",
    "COUNT",
    "JUDGE",
    "PLACEMENT",
    "PLACEMENT_REASON",
    "QUEUE",
    "RATE_LIMIT",
    "REPLICA",
    "VERDICT",
    "Hop",
    "RequestTrace",
    "Tracing",
]
