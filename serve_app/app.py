"""The Ray Serve application: an HTTP ingress and autoscaled engine replicas.

    serve run serve_app.app:build_app model.target=smollm2-135m-instruct     # or a KubeRay
    serveConfigV2 with ``import_path: serve_app.app:build_app`` and ``args: {model: {target: ...}}``

Two deployments:

- ``EngineDeployment``: one ``AsyncEngine`` (``serve_app.replica``) per replica. ``generate`` streams
  ``GenerateChunk``s (call it through ``handle.options(stream=True)``); ``info``, ``health`` and
  ``stats`` (running/waiting requests, a debug view); ``check_health`` is Serve's health check and
  raises when the engine loop died or is stuck, so Serve replaces the replica. Replica count,
  concurrency and CPUs come from settings through :func:`deployment_options`.
- ``IngressDeployment``: the OpenAI-compatible FastAPI app of ``serve_app.api.routes.create_app``,
  built in the replica (``__serve_build_asgi_app__``) around a :class:`RayEngineClient`.

Cancellation across the handle: the ingress closes its engine stream when a request ends early
(client gone, time-out). ``RayEngineClient.generate`` then calls ``cancel()`` on the
``DeploymentResponseGenerator``; Serve cancels the call in the engine replica, which raises
``CancelledError`` inside ``EngineDeployment.generate``; closing the ``AsyncEngine`` stream there
sends the abort to the engine loop, and the KV slot is free at the next step.

Importing this module starts nothing (no Ray cluster, no model load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import Settings, load_settings
from serve_app.generation import EngineInfo, GenerateChunk, GenerateError, GenerateRequest

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineDeployment"
INGRESS_DEPLOYMENT = "IngressDeployment"
HEALTH_CHECK_PERIOD_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------- settings


def settings_from_args(args: Mapping[str, Any] | None) -> Settings:
    """Validate application arguments into ``Settings`` (on top of env / YAML / defaults).

    Accepted shapes, mixed freely: nested (``{"model": {"target": "x"}}``), dotted keys
    (``{"model.target": "x"}``, what ``serve run ... model.target=x`` passes) or double
    underscores (``model__target``), and bare field names where only one section has that field
    (``{"target": "x", "max_slots": 4}``). Errors are ``ValueError``s naming the field.
    """
    owners: dict[str, list[str]] = {}
    for section, info in Settings.model_fields.items():
        for name in getattr(info.annotation, "model_fields", {}):
            owners.setdefault(name, []).append(section)
    nested: dict[str, Any] = {}

    def put(section: str, name: str, value: Any) -> None:
        current = nested.setdefault(section, {})
        if not isinstance(current, dict):  # e.g. {"model": "x", "model.target": "y"}
            raise ValueError(f"application argument {section!r} must be a mapping of its fields")
        current[name] = value

    for key, value in (args or {}).items():
        key = str(key)
        section, dot, name = key.replace("__", ".").partition(".")
        if dot:
            put(section, name, value)
        elif key in Settings.model_fields and isinstance(value, Mapping):
            for name, inner in value.items():
                put(key, str(name), inner)
        elif key not in Settings.model_fields and len(owners.get(key, ())) == 1:
            put(owners[key][0], key, value)
        else:
            nested[key] = value  # unknown keys: Settings (extra="forbid") names them
    try:
        return load_settings(**nested)
    except ValidationError as exc:
        raise ValueError(f"invalid specserve application arguments: {exc}") from None


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
        },
        "max_ongoing_requests": max_ongoing,
        "max_queued_requests": scaling.max_queued_requests,
        "ray_actor_options": {"num_cpus": scaling.replica_num_cpus},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": min(settings.server.request_timeout_s, 120.0),
    }


def ingress_options(settings: Settings) -> dict[str, Any]:
    """``IngressDeployment.options(...)``: one light replica (no CPU reserved: it only waits on I/O)
    that takes every request the engine replicas can hold or queue, plus health and model calls."""
    engine = deployment_options(settings)
    queued = max(0, settings.autoscaling.max_queued_requests)
    capacity = settings.autoscaling.max_replicas * engine["max_ongoing_requests"] + queued
    return {
        "num_replicas": 1,
        "max_ongoing_requests": max(100, capacity + 32),
        "ray_actor_options": {"num_cpus": 0},
    }


# --------------------------------------------------------------------------------- engine replica


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineDeployment:
    """One engine replica: an AsyncEngine with its own loop thread, models loaded at start."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from serve_app import telemetry
        from serve_app.replica import AsyncEngine

        self.settings = Settings(**settings)
        provider = telemetry.setup_tracing(self.settings.telemetry)
        self.engine = AsyncEngine.from_settings(
            self.settings, metrics_backend="ray", tracer=telemetry.get_tracer(provider)
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

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        if not self.engine.is_healthy():
            raise RuntimeError(f"the engine loop is dead or stuck: {self.engine.stats()}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5.0)


# --------------------------------------------------------------------------------- ingress


def _handle_error(exc: Exception) -> GenerateError:
    """A failure of the handle call itself, as the engine would report it."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, BackPressureError):
        return GenerateError(
            "The server is overloaded (request queue full); retry shortly.",
            type="overloaded_error",
            code="overloaded",
            status=503,
        )
    if isinstance(exc, RayActorError | DeploymentUnavailableError):
        return GenerateError(
            "The engine replica is unavailable; retry shortly.",
            type="server_error",
            code="engine_unavailable",
            status=503,
        )
    log.error("engine call failed", exc_info=exc)
    return GenerateError("The server had an error while processing your request.", "server_error", status=500)


class RayEngineClient:
    """``EngineClient`` over a handle to ``EngineDeployment`` (what the ingress app talks to)."""

    def __init__(self, handle: DeploymentHandle, app_name: str | None = None) -> None:
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self._app_name = app_name

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the replica's chunks; closing this early cancels the call in the replica."""
        response = self._streaming.generate.remote(request)
        done = False
        try:
            async for chunk in response:
                done = chunk.finished
                yield chunk
                if done:
                    return
            done = True
            yield GenerateChunk(
                request.request_id,
                finished=True,
                error=GenerateError("The engine stream ended early.", "server_error", status=500),
            )
        except Exception as exc:
            done = True
            yield GenerateChunk(request.request_id, finished=True, error=_handle_error(exc))
        finally:
            if not done:
                response.cancel()  # Serve raises CancelledError in the replica's generate()

    async def info(self) -> EngineInfo:
        return await self._handle.info.remote()

    async def health(self) -> bool:
        """True while the engine deployment has a running replica (Serve health-checks each).

        Asked of the Serve controller, not through the handle: a handle call would queue behind
        the generation requests of a busy replica and time out exactly when the service is busy.
        Outside a Serve application (no controller view), the replica itself is asked.
        """
        try:
            return await asyncio.to_thread(self._controller_health)
        except Exception:
            log.debug("controller health unavailable; asking the replica", exc_info=True)
        try:
            return bool(await asyncio.wait_for(self._handle.health.remote(), 10.0))
        except Exception:
            return False

    def _controller_health(self) -> bool:
        app_name = self._app_name or serve.get_replica_context().app_name
        app = serve.status().applications[app_name]
        deployment = app.deployments[ENGINE_DEPLOYMENT]
        if str(getattr(deployment.status, "value", deployment.status)) in ("DEPLOY_FAILED",):
            return False
        running = sum(
            count
            for state, count in deployment.replica_states.items()
            if str(getattr(state, "value", state)) == "RUNNING"
        )
        return running > 0


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress()
class IngressDeployment:
    """The OpenAI-compatible HTTP API (FastAPI, built in the replica) in front of the engines."""

    def __init__(self, engine: DeploymentHandle, settings: dict[str, Any]) -> None:
        from serve_app import telemetry

        self.settings = Settings(**settings)
        self.client = RayEngineClient(engine)
        self.tracer = telemetry.get_tracer(telemetry.setup_tracing(self.settings.telemetry))

    def __serve_build_asgi_app__(self) -> Any:
        from serve_app.api.routes import create_app

        return create_app(self.client, self.settings.server, tracer=self.tracer)


# --------------------------------------------------------------------------------- application


def build_app(args: Mapping[str, Any] | None = None) -> serve.Application:
    """The application (``serve run serve_app.app:build_app``; KubeRay ``import_path``).

    ``args`` override settings (see :func:`settings_from_args`); an invalid value is a
    ``ValueError`` naming the field, raised here, before anything is deployed.
    """
    settings = settings_from_args(args)
    data = settings.model_dump(mode="json")
    engine = EngineDeployment.options(**deployment_options(settings)).bind(data)
    return IngressDeployment.options(**ingress_options(settings)).bind(engine, data)
