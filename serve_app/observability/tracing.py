"""OpenTelemetry tracing: provider setup, W3C context propagation and span helpers.

One request makes one trace: the ingress opens the root span (``chat <model>``), sends the W3C trace
context to the replica inside ``GenerateRequest.trace_context`` (:func:`inject_context`), and the
replica continues the trace from it (:func:`extract_context`). Inside the replica a request's whole
decoding is ONE ``decode`` span with a bounded number of span events
(:class:`DecodeSpanRecorder`), so a long answer never makes thousands of spans.

Attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) and add
``specserve.*`` for speculation (proposer, drafted, accepted, acceptance rate, ...).

The standard variables are honoured, and win over the settings as OpenTelemetry's rule has it:
``OTEL_SERVICE_NAME`` (and ``OTEL_RESOURCE_ATTRIBUTES``) for the resource, ``OTEL_TRACES_EXPORTER``
for the exporter (:func:`traces_exporters`), ``OTEL_EXPORTER_OTLP_*`` read by the OTLP exporter.

This module imports neither Ray nor FastAPI: the engine receives a tracer through its constructor
and both the ingress and the replicas call :func:`setup_tracing` once per process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serve_app.config import TelemetrySettings

logger = logging.getLogger(__name__)

TRACER_NAME = "specserve"
# gen_ai.provider.name (and the deprecated gen_ai.system). The conventions' well-known values name
# hosted providers (openai, aws.bedrock, ...) and select their provider-specific attributes; none
# fits a self-hosted server, so ours is a custom value, as the conventions allow.
GEN_AI_PROVIDER = "specserve"
SPECULATION_EVENT = "specserve.speculation"
# Seconds from the request reaching the ingress to its first token. The conventions define
# gen_ai.response.time_to_first_chunk for streamed responses only; this one is set on every request.
TIME_TO_FIRST_TOKEN = "specserve.time_to_first_token_s"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"

TRACES_EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
TRACES_EXPORTERS = ("otlp", "console", "none")  # the values OTEL_TRACES_EXPORTER may list

_PROPAGATOR = TraceContextTextMapPropagator()
_GLOBAL_LOCK = threading.Lock()

AttributeValue = (
    str | bool | int | float | tuple[str, ...] | tuple[bool, ...] | tuple[int, ...] | tuple[float, ...]
)


# --- provider setup -----------------------------------------------------------------------------


def resolve_otlp_endpoint(endpoint: str | None, protocol: str) -> str | None:
    """The endpoint handed to the OTLP exporter.

    The HTTP exporter posts to its endpoint verbatim, so a bare collector address
    (``http://collector:4318``) gets the traces path ``/v1/traces``; gRPC endpoints are used as
    given. ``None`` leaves the choice to the exporter (``OTEL_EXPORTER_OTLP_*`` or its default).
    """
    if endpoint is None or protocol != "http":
        return endpoint
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def traces_exporters(settings: TelemetrySettings) -> tuple[str, ...]:
    """The exporters to build (``"otlp"``, ``"console"``; empty for none).

    ``OTEL_TRACES_EXPORTER`` wins when set: a comma-separated list of ``otlp``, ``console`` and
    ``none``. An unknown name is logged and ignored, as OpenTelemetry's configuration rule asks of
    invalid values (a typo must not stop a replica from serving); when no valid name is left the
    settings' ``exporter`` applies.
    """
    raw = os.environ.get(TRACES_EXPORTER_ENV, "").strip()
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACES_EXPORTERS]
    known = [name for name in names if name in TRACES_EXPORTERS]
    if unknown:
        logger.warning(
            "%s=%r: ignoring unknown exporter(s) %s (supported: %s); using %s",
            TRACES_EXPORTER_ENV,
            raw,
            ", ".join(unknown),
            ", ".join(TRACES_EXPORTERS),
            ", ".join(known) if known else f"the settings' exporter ({settings.exporter})",
        )
    if not known:
        known = [settings.exporter]
    return tuple(dict.fromkeys(name for name in known if name != "none"))


def tracing_resource(settings: TelemetrySettings) -> Resource:
    """The provider's resource: ``OTEL_RESOURCE_ATTRIBUTES``, and a ``service.name``.

    ``service.name`` is ``OTEL_SERVICE_NAME`` when set, else one given in
    ``OTEL_RESOURCE_ATTRIBUTES``, else ``settings.service_name``: the environment wins.
    """
    from_env = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    # Resource.create reads the OTEL_* variables itself, but what it is given overrides them.
    return Resource.create({} if from_env else {SERVICE_NAME: settings.service_name})


def _build_exporter(name: str, settings: TelemetrySettings, service_name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter(service_name=service_name)
    endpoint = resolve_otlp_endpoint(settings.otlp_endpoint, settings.otlp_protocol)
    # Imported here: each transport pulls in its own stack (grpcio or requests). Neither connects
    # at construction; the first export does.
    if settings.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint)


def _set_global_provider(provider: TracerProvider) -> bool:
    """Install ``provider`` as the process's global tracer provider, once; False if one was set."""
    with _GLOBAL_LOCK:
        current = trace.get_tracer_provider()
        if not isinstance(current, trace.ProxyTracerProvider):
            # OpenTelemetry refuses to replace a global provider (it only logs a warning); say so
            # once here, in our own words, and keep the first one.
            logger.warning(
                "a global tracer provider is already set (%s); keeping it. Use get_tracer(provider) "
                "to trace with the new one.",
                type(current).__name__,
            )
            return False
        trace.set_tracer_provider(provider)
        return True


def setup_tracing(
    settings: TelemetrySettings, exporter: SpanExporter | None = None, *, set_global: bool = True
) -> TracerProvider:
    """Build a tracer provider for ``settings`` and return it.

    The provider carries the resource of :func:`tracing_resource` (``service.name`` from
    ``OTEL_SERVICE_NAME``, else ``settings.service_name``). Spans go to:

    - ``exporter`` when one is given (tests pass an ``InMemorySpanExporter``), through a
      ``SimpleSpanProcessor`` so that each span is exported the moment it ends;
    - otherwise the exporters of :func:`traces_exporters` (``OTEL_TRACES_EXPORTER``, else
      ``settings.exporter``), each through a ``BatchSpanProcessor``: ``console`` prints spans to
      stdout, ``otlp`` sends them to ``settings.otlp_endpoint`` (else ``OTEL_EXPORTER_OTLP_*``) over
      gRPC or HTTP; ``none`` adds no processor at all (spans are still created, so trace ids still
      propagate, but nothing is exported).

    With ``set_global`` the provider also becomes the process's global provider, the first time
    only: OpenTelemetry never replaces a global provider, so a later call logs a warning and
    returns its new provider without installing it. Call ``provider.shutdown()`` to flush.
    """
    resource = tracing_resource(settings)
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        service_name = str(resource.attributes.get(SERVICE_NAME, settings.service_name))
        for name in traces_exporters(settings):
            provider.add_span_processor(BatchSpanProcessor(_build_exporter(name, settings, service_name)))
    if set_global:
        _set_global_provider(provider)
    return provider


def get_tracer(provider: TracerProvider | None = None) -> Tracer:
    """The ``specserve`` tracer of ``provider``, or of the global provider when none is given."""
    if provider is None:
        return trace.get_tracer(TRACER_NAME)
    return provider.get_tracer(TRACER_NAME)


# --- context propagation ------------------------------------------------------------------------


def inject_context(context: Context | None = None) -> dict[str, str]:
    """The W3C trace-context carrier (``traceparent``, ``tracestate``) of the current or given context.

    Empty when the context holds no valid span. The result is a plain dict, so it pickles across a
    Ray Serve handle (``GenerateRequest.trace_context``) and works as HTTP headers.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> Context:
    """The context to parent spans on from a carrier made by :func:`inject_context` (or headers).

    A missing or malformed ``traceparent`` gives an empty context: spans then start a new trace.
    """
    return _PROPAGATOR.extract(carrier=dict(carrier))


# --- attributes -----------------------------------------------------------------------------------


def _attribute_value(value: object) -> AttributeValue | None:
    """``value`` as an OpenTelemetry attribute value, or None where it cannot be one."""
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Sequence):
        items = tuple(value)
        if not items:
            return ()
        for kind in (str, bool, int, float):
            if all(type(item) is kind for item in items):
                return items
        if all(isinstance(item, int | float) and not isinstance(item, bool) for item in items):
            return tuple(float(item) for item in items)
    return None


def clean_attributes(attributes: Mapping[str, object]) -> dict[str, AttributeValue]:
    """Drop the values OpenTelemetry cannot hold (None, nested mappings, mixed sequences)."""
    clean: dict[str, AttributeValue] = {}
    for key, value in attributes.items():
        converted = _attribute_value(value)
        if converted is not None:
            clean[key] = converted
    return clean


def gen_ai_span_name(operation: str, model: str) -> str:
    """The GenAI conventions' span name: ``"{gen_ai.operation.name} {gen_ai.request.model}"``."""
    return f"{operation} {model}" if model else operation


def gen_ai_request_attributes(
    operation: str,
    model: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    *,
    top_k: int = 0,
    seed: int | None = None,
    stop_sequences: Sequence[str] = (),
    stream: bool | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> dict[str, AttributeValue]:
    """GenAI request attributes; ``operation`` is ``"chat"`` or ``"text_completion"``.

    The optional ones are left out when unset: ``top_k`` 0 (the filter is off), no ``seed``, no stop
    sequences, ``stream`` None, penalties 0. ``gen_ai.request.top_k`` is a double in the conventions.
    """
    return clean_attributes(
        {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": GEN_AI_PROVIDER,
            "gen_ai.system": GEN_AI_PROVIDER,  # deprecated name of gen_ai.provider.name
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature,
            "gen_ai.request.top_p": top_p,
            "gen_ai.request.top_k": float(top_k) if top_k > 0 else None,
            "gen_ai.request.seed": seed,
            "gen_ai.request.stop_sequences": tuple(stop_sequences) or None,
            "gen_ai.request.stream": stream,
            "gen_ai.request.presence_penalty": presence_penalty or None,
            "gen_ai.request.frequency_penalty": frequency_penalty or None,
        }
    )


def gen_ai_usage_attributes(
    input_tokens: int, output_tokens: int, finish_reasons: Sequence[str], response_id: str
) -> dict[str, AttributeValue]:
    """GenAI response attributes: token usage, finish reasons and the response id."""
    return clean_attributes(
        {
            "gen_ai.response.id": response_id,
            "gen_ai.response.finish_reasons": tuple(str(reason) for reason in finish_reasons),
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        }
    )


def speculation_attributes(stats: Mapping[str, object]) -> dict[str, AttributeValue]:
    """``SpecStats.as_dict()`` as ``specserve.*`` attributes.

    ``{"proposer": "draft", "drafted": 12, ...}`` -> ``{"specserve.proposer": "draft",
    "specserve.drafted": 12, ...}``. None values are dropped (OpenTelemetry attributes cannot be
    None), lists become tuples (``specserve.accepted_per_position``), a mapping becomes one
    attribute per entry (``{"steps_by_proposer": {"eagle": 3}}`` ->
    ``specserve.steps_by_proposer.eagle = 3``), and keys already starting with ``specserve.`` are
    kept as they are.
    """
    flat: dict[str, object] = {}
    for key, value in stats.items():
        key = key if key.startswith("specserve.") else f"specserve.{key}"
        if isinstance(value, Mapping):
            flat.update({f"{key}.{name}": v for name, v in value.items()})
        else:
            flat[key] = value
    return clean_attributes(flat)
