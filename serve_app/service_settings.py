"""The service's settings sections: HTTP server, autoscaling, telemetry, shared statistics, load tests.

Part of the one settings root, ``serve_app.config.Settings`` (which imports them from here): every
field has a description, unknown keys are errors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    api_key: str | None = Field(None, description="If set, requests must send `Authorization: Bearer <key>`.")
    served_model_name: str | None = Field(
        None, description="The model name clients use in requests; default: the target's name."
    )
    max_tokens_limit: int | None = Field(
        None, ge=1, description="The largest max_tokens a request may ask for; null: the model's context."
    )
    strict_requests: bool = Field(
        False,
        description="Refuse unknown top-level request fields with a 400, as OpenAI does; by default they are "
        "ignored with one log line per field name, as vLLM and SGLang do (client extras keep working).",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request still running after this is aborted."
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens a streamed chunk holds at least (vLLM's and SGLang's --stream-interval): 1 sends "
        "each step's tokens at once; more send fewer chunks, each a message through the ingress and Serve's "
        "proxy (CPU a small host's forward shares). The first chunk and the last are never held.",
    )
    tool_call_parser: str = Field(
        "hermes",
        description="How the model writes tool calls, read back into OpenAI's tool_calls (and written into "
        "the prompt when the chat template does not render tools): one of serve_app.api.tool_calls."
        'TOOL_FORMATS; hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Hermes).',
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_format(cls, v: str) -> str:
        from serve_app.api.tool_calls import tool_format  # the registry names the choices

        tool_format(v)  # unknown: a ValueError naming the known ones
        return v


class AutoscalingSettings(_Section):
    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Most engine replicas.")
    target_ongoing_requests: float | None = Field(
        None,
        gt=0,
        description="Ongoing requests per replica the autoscaler aims for; default: the slot count.",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="How long load must stay high before scaling up.")
    look_back_period_s: float = Field(
        30.0, gt=0, description="The window Serve averages ongoing requests over before it decides."
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="How long load must stay low before scaling down."
    )
    max_queued_requests: int = Field(
        64, ge=-1, description="Requests Serve queues per deployment before answering 503 (-1 = no bound)."
    )
    replica_num_cpus: float = Field(2.0, gt=0, description="CPUs each engine replica reserves in Ray.")
    max_ingress_replicas: int = Field(
        4, ge=1, description="Most HTTP ingress replicas (at least 1 always runs; they reserve no CPU)."
    )
    ingress_target_ongoing_requests: float = Field(
        64.0,
        gt=0,
        description="Ongoing requests per ingress replica the autoscaler aims for: an ingress only relays "
        "I/O, so it holds many more than an engine replica runs before it adds a replica.",
    )


class TelemetrySettings(_Section):
    """OpenTelemetry tracing (``serve_app.observability.tracing``) and the Prometheus metrics' export.

    The standard OpenTelemetry variables win over these settings, as OpenTelemetry's own rule has
    it: ``OTEL_SERVICE_NAME`` (or a ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``) over
    ``service_name``; ``OTEL_TRACES_EXPORTER`` (a comma-separated list of ``otlp``, ``console``,
    ``none``) over ``exporter``, where an unknown name is logged and ignored (no valid name left: this
    ``exporter``); ``OTEL_RESOURCE_ATTRIBUTES`` adds resource attributes; with no ``otlp_endpoint``
    the OTLP exporter reads ``OTEL_EXPORTER_OTLP_*``.
    """

    exporter: Literal["none", "console", "otlp"] = Field(
        "none", description="Where traces go (OTEL_TRACES_EXPORTER, when set, wins)."
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP collector endpoint, e.g. http://collector:4317 (grpc) or :4318/v1/traces (http).",
    )
    otlp_protocol: Literal["grpc", "http"] = Field("grpc", description="OTLP transport.")
    service_name: str = Field(
        "specserve", description="service.name resource attribute (OTEL_SERVICE_NAME, when set, wins)."
    )
    metrics_export_port: int = Field(
        8080,
        ge=0,
        le=65535,
        description="Port of Ray's Prometheus exporter when `specserve serve` starts the cluster (0 = any "
        "free port; KubeRay pods use 8080). GET /metrics on the API port relays it either way.",
    )
    metrics_report_interval_ms: int = Field(
        2000,
        ge=100,
        description="How often each Ray worker reports its metrics to its node, when `specserve serve` "
        "starts the cluster: the most a scrape of /metrics lags behind the engines.",
    )


class StatsSettings(_Section):
    redis_url: str | None = Field(
        None,
        description="Redis for statistics shared across replicas, e.g. redis://127.0.0.1:6379/0; "
        "null = local statistics only.",
    )
    key_prefix: str = Field(
        "specserve", min_length=1, description="Namespace prefix of every Redis key this service writes."
    )
    window_s: float = Field(
        600.0, gt=0, description="Rolling window of acceptance statistics (the last N seconds, cluster-wide)."
    )
    bucket_s: float = Field(
        60.0, gt=0, description="Time bucket of acceptance counts; a bucket expires once out of the window."
    )
    flush_interval_s: float = Field(
        2.0, gt=0, description="How often the background thread writes batched counts and load to Redis."
    )
    refresh_interval_s: float = Field(
        5.0, gt=0, description="How often the background thread refreshes the cluster-wide priors cache."
    )
    load_ttl_s: float = Field(
        15.0, gt=0, description="A replica's published load expires this long after its last update."
    )
    warn_interval_s: float = Field(
        60.0, ge=0, description="At most one warning about Redis being unavailable per this many seconds."
    )
    socket_timeout_s: float = Field(
        0.5, gt=0, description="Redis connect and socket timeout of the background thread."
    )
    max_backoff_s: float = Field(
        30.0, gt=0, description="Longest wait between reconnection attempts (exponential backoff)."
    )


class LoadtestSettings(_Section):
    replica_hour_price: float = Field(
        0.15,
        ge=0,
        description="Price of one engine replica for one hour (USD), for the load test's cost per 1M output "
        "tokens. Default: about an on-demand 2-vCPU, 16 GiB cloud VM; set your own (a GPU's price on GPUs).",
    )
