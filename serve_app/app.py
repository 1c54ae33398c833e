"""The Ray Serve application: an HTTP ingress and autoscaled engine replicas.

    serve run serve_app.app:build_app model.target=smollm2-135m-instruct     # or a KubeRay
    serveConfigV2 with ``import_path: serve_app.app:build_app`` and ``args: {model: {target: ...}}``

    SPECSERVE_MODEL__TARGET=smollm2-135m-instruct serve build serve_app.serve_entry:app -o serve.yaml
    serve deploy serve.yaml        # ``serve build`` needs an Application object: ``serve_app.serve_entry``

``serve build`` writes both deployments' options; ``serve deploy`` imports ``serve_app.serve_entry``
again on the cluster, whose ``SPECSERVE_*`` environment gives the settings (see that module).

Two deployments:

- ``EngineDeployment``: one ``AsyncEngine`` (``serve_app.async_engine``) per replica. ``generate`` streams
  ``GenerateChunk``s (call it through ``handle.options(stream=True)``); ``info``, ``health`` and
  ``stats`` (running/waiting requests, free KV slots, the process's RSS and threads: a debug view);
  ``check_health`` is Serve's health check and raises when the engine loop died or is stuck, so
  Serve replaces the replica. Replica count, concurrency and CPUs come from settings through
  :func:`deployment_options`.
- ``IngressDeployment``: the OpenAI-compatible FastAPI app of ``serve_app.api.routes.create_app``,
  built in the replica (``__serve_build_asgi_app__``) around a ``RayEngineClient``
  (``serve_app.handle_client``, which also says how cancellation crosses the handle); light
  replicas, autoscaled too (:func:`ingress_options`).

Importing this module starts nothing (no Ray cluster, no model load).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import Settings, build_settings
from serve_app.wire import EngineInfo, GenerateChunk, GenerateRequest, TokenizeResult

log = logging.getLogger(__name__)

APP_NAME = "specserve"  # the Serve application's name (`specserve serve`, the KubeRay RayService)
ENGINE_DEPLOYMENT = "EngineDeployment"
INGRESS_DEPLOYMENT = "IngressDeployment"
HEALTH_CHECK_PERIOD_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------- settings


def deployment_options(settings: Settings) -> dict[str, Any]:
    """``EngineDeployment.options(...)`` from settings (pure; no Ray needed).

    - autoscaling on ongoing requests per replica, aiming at ``target_ongoing_requests`` (default:
      the KV slot count, i.e. a replica is "full" when every slot runs);
    - ``max_ongoing_requests`` = slots + a small waiting margin (a quarter of the slots, at least
      2): a replica takes a few requests more than it can run, to start them the moment a slot
      frees, and Serve queues the rest (up to ``max_queued_requests``, then answers 503) where the
      autoscaler sees them;
    - ``num_cpus`` per replica; health checks every 10 s (a stuck engine loop fails them);
    - graceful shutdown waits for running requests up to ``request_timeout_s`` (at most 120 s).
    """
    scaling = settings.autoscaling
    if scaling.min_replicas > scaling.max_replicas:
        raise ValueError(
            f"autoscaling.min_replicas ({scaling.min_replicas}) is greater than "
            f"autoscaling.max_replicas ({scaling.max_replicas})"
        )
    slots = settings.cache.max_slots
    target = float(scaling.target_ongoing_requests or slots)
    max_ongoing = max(slots + max(2, slots // 4), math.ceil(target))
    return {
        "autoscaling_config": {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": target,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": scaling.look_back_period_s,
        },
        "max_ongoing_requests": max_ongoing,
        "max_queued_requests": scaling.max_queued_requests,
        "ray_actor_options": {"num_cpus": scaling.replica_num_cpus},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": min(settings.server.request_timeout_s, 120.0),
    }


def ingress_options(settings: Settings) -> dict[str, Any]:
    """``IngressDeployment.options(...)`` from settings (pure; no Ray needed).

    Light replicas (no CPU reserved: an ingress only awaits I/O), autoscaled on ongoing requests per
    replica between 1 (``/health`` must always answer) and ``autoscaling.max_ingress_replicas``,
    aiming at ``ingress_target_ongoing_requests``: many more than an engine replica runs, so the
    ingress relays for several engine replicas before it adds one and is never what limits
    throughput. Each replica takes every request the engine replicas can hold or queue, plus health
    and model calls, so a burst that comes faster than the upscale delay is relayed, not refused.
    """
    scaling = settings.autoscaling
    engine = deployment_options(settings)
    queued = max(0, scaling.max_queued_requests)
    capacity = scaling.max_replicas * engine["max_ongoing_requests"] + queued
    target = float(scaling.ingress_target_ongoing_requests)
    return {
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": scaling.max_ingress_replicas,
            "target_ongoing_requests": target,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": scaling.look_back_period_s,
        },
        "max_ongoing_requests": max(100, capacity + 32, math.ceil(target)),
        "ray_actor_options": {"num_cpus": 0},
    }


# --------------------------------------------------------------------------------- engine replica


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineDeployment:
    """One engine replica: an AsyncEngine with its own loop thread, models loaded at start."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from serve_app.builder import build_async_engine
        from serve_app.observability import tracing

        self.settings = Settings(**settings)
        provider = tracing.setup_tracing(self.settings.telemetry)
        self.engine = build_async_engine(
            self.settings, metrics_backend="ray", tracer=tracing.get_tracer(provider)
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream one request (call with ``handle.options(stream=True)``)."""
        # aclosing: when Serve cancels this call, the engine stream closes now (abort), not at GC.
        async with contextlib.aclosing(self.engine.generate(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def info(self) -> EngineInfo:
        return await self.engine.info()

    async def health(self) -> bool:
        return await self.engine.health()

    async def tokenize(
        self, prompt: str | None = None, messages: list | None = None, tools: list | None = None
    ) -> TokenizeResult:
        return await self.engine.tokenize(prompt, messages, tools=tools)

    async def detokenize(self, token_ids: list[int]) -> TokenizeResult:
        return await self.engine.detokenize(token_ids)

    async def stats(self, count_objects: bool = False) -> dict[str, Any]:
        """A debug / test view of what this replica holds, to find leaks from outside: the engine's
        load and KV slots as its loop thread last published them (``AsyncEngine.stats``: running,
        waiting, free_slots, slots, requests, streams, aborts, ...) and the process's RSS, threads,
        file descriptors and, with ``count_objects`` (a full garbage collection first: not for a
        tight polling loop), tracked Python objects (``observability.replica_state.process_state``)."""
        from serve_app.observability.replica_state import process_state

        return {**self.engine.stats(), **process_state(count_objects)}

    def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        if not self.engine.is_healthy():
            raise RuntimeError(f"the engine loop is dead or stuck: {self.engine.stats()}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5.0)


# --------------------------------------------------------------------------------- ingress


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress()
class IngressDeployment:
    """The OpenAI-compatible HTTP API (FastAPI, built in the replica) in front of the engines."""

    def __init__(self, engine: DeploymentHandle, settings: dict[str, Any]) -> None:
        import os
        import socket

        from serve_app.builder import served_model_name
        from serve_app.handle_client import RayEngineClient
        from serve_app.observability import tracing
        from serve_app.observability.metric_names import SERVE_QUEUE_FULL
        from serve_app.observability.metrics import EngineMetrics
        from serve_app.observability.prometheus_relay import PrometheusRelay

        self.settings = Settings(**settings)
        # Serve's own queue refusals happen here, before any engine replica sees the request.
        replica = f"ingress-{socket.gethostname()}-{os.getpid()}"
        refusals = EngineMetrics(served_model_name(self.settings), backend="ray", replica=replica)
        self.client = RayEngineClient(
            engine, ENGINE_DEPLOYMENT, on_refused=lambda: refusals.on_refused(SERVE_QUEUE_FULL)
        )
        self.tracer = tracing.get_tracer(tracing.setup_tracing(self.settings.telemetry))
        self.metrics_relay = PrometheusRelay()  # GET /metrics: every node's engine series

    def __serve_build_asgi_app__(self) -> Any:
        from serve_app.api.metrics_route import add_metrics_route
        from serve_app.api.routes import create_app

        app = create_app(self.client, self.settings.server, tracer=self.tracer)
        add_metrics_route(app, self.metrics_relay.scrape)
        return app


# --------------------------------------------------------------------------------- application


def build_app(args: Mapping[str, Any] | None = None) -> serve.Application:
    """The application (``serve run serve_app.app:build_app``; KubeRay ``import_path``).

    ``args`` override settings (any shape ``serve_app.config.build_settings`` takes); an invalid
    value is a ``ValueError`` naming the field, raised here, before anything is deployed.
    """
    settings = build_settings(args)
    data = settings.model_dump(mode="json")
    engine = EngineDeployment.options(**deployment_options(settings)).bind(data)
    return IngressDeployment.options(**ingress_options(settings)).bind(engine, data)
