"""The standard OTEL_* variables: they win over ``TelemetrySettings`` (service name, resource,
exporter), and an unknown exporter name is logged and ignored."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.config import TelemetrySettings
from serve_app.observability.tracing import get_tracer, setup_tracing, traces_exporters

OTEL_VARIABLES = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* variable from the machine running the tests leaks in."""
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _resource_of_a_span(settings: TelemetrySettings) -> dict:
    exporter = InMemorySpanExporter()
    provider = setup_tracing(settings, exporter, set_global=False)
    try:
        with get_tracer(provider).start_as_current_span("s"):
            pass
        (span,) = exporter.get_finished_spans()
        return dict(span.resource.attributes)
    finally:
        provider.shutdown()


def _exporters(provider: TracerProvider) -> list[str]:
    return [
        type(p._batch_processor._exporter).__name__ for p in provider._active_span_processor._span_processors
    ]


def test_service_name_from_settings_without_the_variable() -> None:
    resource = _resource_of_a_span(TelemetrySettings(service_name="from-settings"))
    assert resource["service.name"] == "from-settings"


def test_otel_service_name_wins_over_settings(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_SERVICE_NAME", "from-env")
    resource = _resource_of_a_span(TelemetrySettings(service_name="from-settings"))
    assert resource["service.name"] == "from-env"


def test_otel_resource_attributes_are_kept(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,service.name=from-attrs")
    resource = _resource_of_a_span(TelemetrySettings(service_name="from-settings"))
    assert resource["deployment.environment"] == "staging"
    assert resource["service.name"] == "from-attrs"  # the environment wins here too
    clean_env.setenv("OTEL_SERVICE_NAME", "from-env")  # and OTEL_SERVICE_NAME over the attributes
    resource = _resource_of_a_span(TelemetrySettings(service_name="from-settings"))
    assert (resource["service.name"], resource["deployment.environment"]) == ("from-env", "staging")


@pytest.mark.parametrize(
    ("variable", "setting", "expected"),
    [
        (None, "console", ("console",)),  # unset: the settings choose
        (None, "none", ()),
        ("console", "none", ("console",)),  # set: the variable wins
        ("none", "otlp", ()),
        (" OTLP , console ", "none", ("otlp", "console")),  # a list, as OpenTelemetry allows
        ("console,console,none", "otlp", ("console",)),
    ],
)
def test_otel_traces_exporter_chooses(
    clean_env: pytest.MonkeyPatch, variable: str | None, setting: str, expected: tuple[str, ...]
) -> None:
    if variable is not None:
        clean_env.setenv("OTEL_TRACES_EXPORTER", variable)
    assert traces_exporters(TelemetrySettings(exporter=setting)) == expected


def test_an_unknown_exporter_is_logged_and_ignored(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with caplog.at_level(logging.WARNING, logger="serve_app.observability.tracing"):
        assert traces_exporters(TelemetrySettings(exporter="console")) == ("console",)  # the settings'
    (record,) = caplog.records
    assert "jaeger" in record.getMessage() and "otlp, console, none" in record.getMessage()
    caplog.clear()
    clean_env.setenv("OTEL_TRACES_EXPORTER", "jaeger,none")
    with caplog.at_level(logging.WARNING, logger="serve_app.observability.tracing"):
        assert traces_exporters(TelemetrySettings(exporter="console")) == ()  # the valid rest applies
    assert len(caplog.records) == 1


def test_setup_builds_the_exporters_the_variable_names(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console")
    clean_env.setenv("OTEL_SERVICE_NAME", "from-env")
    provider = setup_tracing(TelemetrySettings(exporter="none"), set_global=False)
    try:
        assert _exporters(provider) == ["ConsoleSpanExporter"]
        (processor,) = provider._active_span_processor._span_processors
        console = processor._batch_processor._exporter
        assert isinstance(console, ConsoleSpanExporter)
        assert console.service_name == "from-env"
    finally:
        provider.shutdown()
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    provider = setup_tracing(TelemetrySettings(exporter="console"), set_global=False)
    assert _exporters(provider) == []
    provider.shutdown()


def test_otlp_from_the_variable_reads_the_otlp_endpoint_variable(clean_env: pytest.MonkeyPatch) -> None:
    """With no endpoint in the settings, the OTLP exporter takes OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/custom/traces")
    provider = setup_tracing(TelemetrySettings(exporter="none", otlp_protocol="http"), set_global=False)
    (processor,) = provider._active_span_processor._span_processors
    exporter = processor._batch_processor._exporter
    assert type(exporter).__name__ == "OTLPSpanExporter"
    assert exporter._endpoint == "http://127.0.0.1:9/custom/traces"
    provider.shutdown()  # no span was made: nothing is sent, no connection is tried
