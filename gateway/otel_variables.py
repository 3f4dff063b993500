"""The OpenTelemetry SDK's standard environment variables (`OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_TRACES_SAMPLER`, ...) read as keys of the `tracing` section, for settings.py to apply under its own
`BULKHEAD_TRACING__*` variables. A deployment configured for OpenTelemetry the usual way needs nothing else.

Values are as the OpenTelemetry specification writes them: times in milliseconds, headers and resource attributes as
`key=value` pairs joined by commas (values percent-encoded), an empty variable the same as an unset one. Of two
variables for one key, the signal's own (`OTEL_EXPORTER_OTLP_TRACES_*`) wins over the general one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

SECTION = "tracing"
DISABLED = "OTEL_SDK_DISABLED"
TRACES_PATH = "/v1/traces"  # what the general endpoint variable is a base of (the OTLP/HTTP exporter's spec)


def _pairs(raw: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for number, item in enumerate(raw.split(","), 1):
        if not item.strip():
            continue
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            # Not the item itself: a header's value is often a credential (`authorization: Bearer ...`).
            raise ValueError(f"item {number} (of the comma-separated list) is not a key=value pair")
        pairs[unquote(key.strip())] = unquote(value.strip())
    return pairs


def _milliseconds(raw: str) -> float:
    try:
        return float(raw) / 1000
    except ValueError:
        raise ValueError(f"{raw!r} is not a number of milliseconds") from None


def _exporter(raw: str) -> bool:
    # The gateway exports traces over OTLP or not at all; the SDK's other exporters (console, zipkin) are not here.
    if raw in ("otlp", "none"):
        return raw == "otlp"
    raise ValueError(f"{raw!r}: the gateway exports traces with otlp, or none")


def _base_endpoint(raw: str) -> str:
    return raw.rstrip("/") + TRACES_PATH


def _as_is(raw: str) -> str:
    return raw


# In the order they apply: a later variable for the same key wins.
VARIABLES: list[tuple[str, str, Callable[[str], Any]]] = [
    ("OTEL_TRACES_EXPORTER", "enabled", _exporter),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "endpoint", _base_endpoint),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "endpoint", _as_is),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "protocol", _as_is),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "protocol", _as_is),
    ("OTEL_EXPORTER_OTLP_HEADERS", "headers", _pairs),
    ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "headers", _pairs),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "timeout_s", _milliseconds),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "timeout_s", _milliseconds),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "compression", _as_is),
    ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "compression", _as_is),
    ("OTEL_TRACES_SAMPLER", "sampler", _as_is),
    ("OTEL_TRACES_SAMPLER_ARG", "sampler_ratio", _as_is),
    ("OTEL_SERVICE_NAME", "service_name", _as_is),
    ("OTEL_RESOURCE_ATTRIBUTES", "resource_attributes", _pairs),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "max_queue_size", _as_is),
    ("OTEL_BSP_SCHEDULE_DELAY", "export_interval_s", _milliseconds),
]


def tracing_overrides(environ: Mapping[str, str]) -> dict[tuple[str, ...], tuple[str, Any]]:
    """The `tracing` keys the environment's OTEL_* variables set: key path → (variable, value). Raise ValueError,
    naming the variable, for a value that cannot be read at all (the settings' own checks judge the rest)."""
    found: dict[tuple[str, ...], tuple[str, Any]] = {}
    for variable, key, read in VARIABLES:
        raw = environ.get(variable, "").strip()
        if raw:
            try:
                found[(SECTION, key)] = (variable, read(raw))
            except ValueError as exc:
                raise ValueError(f"environment variable {variable}: {exc}") from None
    return found


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    """OTEL_SDK_DISABLED=true: the SDK reads it itself and then records nothing, so tracing is off whatever else
    says on (the gateway's own variables included)."""
    return environ.get(DISABLED, "").strip().lower() == "true"
