"""The standard OTEL_* variables set the `tracing` settings as the OpenTelemetry specification writes them; the
gateway's own BULKHEAD_TRACING__* variables win, and a value that cannot be used stops the start naming its
variable."""

from __future__ import annotations

import pytest

from gateway.settings import SettingsError, load_settings


def test_tracing_is_off_unless_asked_for() -> None:
    assert load_settings(None, {}).tracing.enabled is False
    assert load_settings(None, {"OTEL_SERVICE_NAME": "gw"}).tracing.enabled is False


def test_the_standard_variables_set_the_tracing_keys() -> None:
    tracing = load_settings(
        None,
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s3cr3t%2Fkey, team = a ",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_SERVICE_NAME": "gateway-eu",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
            "OTEL_BSP_MAX_QUEUE_SIZE": "4096",
        },
    ).tracing
    assert tracing.enabled and tracing.endpoint == "http://collector:4318/v1/traces"
    assert tracing.headers == {"api-key": "s3cr3t/key", "team": "a"} and "s3cr3t" not in repr(tracing)
    assert (tracing.timeout_s, tracing.compression, tracing.export_interval_s) == (2.5, "gzip", 0.5)
    assert (tracing.sampler, tracing.sampler_ratio, tracing.max_queue_size) == ("parentbased_traceidratio", 0.25, 4096)
    assert tracing.service_name == "gateway-eu" and tracing.resource_attributes == {"deployment.environment": "prod"}


def test_the_signals_own_variable_and_then_the_gateways_own_win() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/custom/path",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "BULKHEAD_TRACING__SAMPLER_RATIO": "0.5",
    }
    tracing = load_settings(None, environ).tracing
    assert tracing.endpoint == "http://traces:4318/custom/path" and tracing.sampler_ratio == 0.5


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"},
        {"BULKHEAD_TRACING__ENABLED": "true", "OTEL_SDK_DISABLED": "TRUE"},
    ],
)
def test_the_sdks_switches_turn_it_off(environ: dict[str, str]) -> None:
    assert load_settings(None, environ).tracing.enabled is False


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "tracing.protocol: must be 'http/protobuf'"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "otlp, or none"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "no-equals-sign", "is not a key=value pair"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon", "is not a number of milliseconds"),
        ("OTEL_TRACES_SAMPLER", "jaeger_remote", "tracing.sampler"),
        ("OTEL_TRACES_SAMPLER_ARG", "2", "tracing.sampler_ratio"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318", "tracing.endpoint"),
    ],
)
def test_a_value_that_cannot_be_used_names_its_variable(variable: str, value: str, said: str) -> None:
    with pytest.raises(SettingsError, match=variable) as refused:
        load_settings(None, {variable: value})
    assert said in str(refused.value)


@pytest.mark.parametrize("value", ["authorization: Bearer s3cret", "x-api-key=abc,s3cret"])
def test_a_header_that_is_not_a_pair_is_not_repeated(value: str) -> None:
    # Headers carry credentials: a malformed one is named by its place in the list, never by its text.
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_HEADERS") as refused:
        load_settings(None, {"OTEL_EXPORTER_OTLP_HEADERS": value})
    assert "is not a key=value pair" in str(refused.value) and "s3cret" not in str(refused.value)
