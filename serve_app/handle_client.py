"""``RayEngineClient``: the ``EngineClient`` the ingress talks to, over a Ray Serve handle.

Cancellation across the handle: the ingress closes its engine stream when a request ends early
(client gone, time-out). ``RayEngineClient.generate`` then calls ``cancel()`` on the
``DeploymentResponseGenerator``; Serve cancels the call in the engine replica, which raises
``CancelledError`` inside ``EngineDeployment.generate``; closing the ``AsyncEngine`` stream there
sends the abort to the engine loop, and the KV slot is free at the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.wire import EngineInfo, GenerateChunk, GenerateError, GenerateRequest, TokenizeResult

log = logging.getLogger(__name__)


def _handle_error(exc: Exception, on_refused: Callable[[], None] | None = None) -> GenerateError:
    """A failure of the handle call itself, as the engine would report it (``on_refused`` is told
    when Serve's own queue in front of the replicas refused the request)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, BackPressureError):
        if on_refused is not None:
            on_refused()
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

    def __init__(
        self,
        handle: DeploymentHandle,
        deployment: str,
        app_name: str | None = None,
        on_refused: Callable[[], None] | None = None,  # Serve's queue was full (a metric)
    ) -> None:
        self._handle = handle
        self._on_refused = on_refused
        self._streaming = handle.options(stream=True)
        self._deployment = deployment  # the engine deployment's name, for the controller's view
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
            yield GenerateChunk(request.request_id, finished=True, error=_handle_error(exc, self._on_refused))
        finally:
            if not done:
                response.cancel()  # Serve raises CancelledError in the replica's generate()

    async def info(self) -> EngineInfo:
        return await self._handle.info.remote()

    async def tokenize(
        self, prompt: str | None = None, messages: list | None = None, tools: list | None = None
    ) -> TokenizeResult:
        try:
            return await self._handle.tokenize.remote(prompt, messages, tools)
        except Exception as exc:
            return TokenizeResult(error=_handle_error(exc, self._on_refused))

    async def detokenize(self, token_ids: list[int]) -> TokenizeResult:
        try:
            return await self._handle.detokenize.remote(token_ids)
        except Exception as exc:
            return TokenizeResult(error=_handle_error(exc, self._on_refused))

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
        deployment = app.deployments[self._deployment]
        if str(getattr(deployment.status, "value", deployment.status)) in ("DEPLOY_FAILED",):
            return False
        running = sum(
            count
            for state, count in deployment.replica_states.items()
            if str(getattr(state, "value", state)) == "RUNNING"
        )
        return running > 0
