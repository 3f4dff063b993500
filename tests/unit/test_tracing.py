"""The tracing module's pure parts: a client's traceparent as the W3C spec reads it (never trusted past its shape),
and the sampler each OTEL_TRACES_SAMPLER name means."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

from gateway.tracing.provider import client_context, sampler

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_a_valid_traceparent_is_read() -> None:
    context = client_context(f"00-{TRACE}-{SPAN}-01")
    assert context is not None and context.is_remote and context.trace_flags.sampled
    assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == (TRACE, SPAN)
    later = client_context(f"01-{TRACE}-{SPAN}-00-what-a-later-version-adds")
    assert later is not None and not later.trace_flags.sampled


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "garbage",
        f"ff-{TRACE}-{SPAN}-01",  # the version W3C forbids
        f"00-{TRACE}-{SPAN}-01-more",  # version 00 has exactly four fields
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE.upper()}-{SPAN}-01",
        f"01-{TRACE}-{SPAN}-01-{'x' * 300}",
    ],
)
def test_a_traceparent_that_is_not_valid_is_ignored(header: str | None) -> None:
    assert client_context(header) is None


def test_each_sampler_name_is_the_sdks_sampler() -> None:
    assert sampler("always_on", 0.5) is ALWAYS_ON and sampler("always_off", 0.5) is ALWAYS_OFF
    ratio = sampler("traceidratio", 0.25)
    assert isinstance(ratio, TraceIdRatioBased) and ratio.rate == 0.25
    for name, root in (("parentbased_always_on", "AlwaysOn"), ("parentbased_traceidratio", "TraceIdRatioBased")):
        chosen = sampler(name, 0.25)
        assert isinstance(chosen, ParentBased) and root in chosen.get_description()
