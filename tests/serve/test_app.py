"""The Ray Serve application's pure parts: deployment and ingress options from settings,
build_app's arguments, and the handle client (against a fake handle; the application end to end
is ``test_app_e2e.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from ray import serve
from ray.serve.exceptions import BackPressureError

from serve_app.app import build_app, deployment_options, ingress_options
from serve_app.config import Settings
from serve_app.engine.params import SamplingParams
from serve_app.handle_client import RayEngineClient
from serve_app.wire import GenerateChunk, GenerateRequest


def test_deployment_options_follow_settings() -> None:
    options = deployment_options(Settings())
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 1,
        "target_ongoing_requests": 8.0,  # default: the slot count
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 120.0,
        "look_back_period_s": 30.0,
    }
    assert options["max_ongoing_requests"] == 8 + 2  # slots + a small waiting margin
    assert options["max_queued_requests"] == 64
    assert options["ray_actor_options"] == {"num_cpus": 2.0}
    custom = Settings(
        cache={"max_slots": 16},
        autoscaling={
            "min_replicas": 0,
            "max_replicas": 4,
            "target_ongoing_requests": 12,
            "upscale_delay_s": 1,
            "downscale_delay_s": 5,
            "look_back_period_s": 2,
            "max_queued_requests": -1,
            "replica_num_cpus": 1.5,
        },
    )
    options = deployment_options(custom)
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (0, 4)
    assert scaling["target_ongoing_requests"] == 12.0
    delays = (scaling["upscale_delay_s"], scaling["downscale_delay_s"], scaling["look_back_period_s"])
    assert delays == (1, 5, 2)
    assert options["max_ongoing_requests"] == 16 + 4
    assert options["max_queued_requests"] == -1
    assert options["ray_actor_options"] == {"num_cpus": 1.5}
    with pytest.raises(ValueError, match="min_replicas"):
        deployment_options(Settings(autoscaling={"min_replicas": 3, "max_replicas": 2}))


def test_ingress_options_autoscale_and_take_what_the_engines_hold() -> None:
    ingress = ingress_options(Settings())
    assert "num_replicas" not in ingress  # autoscaled, not one fixed replica
    assert ingress["autoscaling_config"] == {
        "min_replicas": 1,  # never 0: /health must answer
        "max_replicas": 4,
        "target_ongoing_requests": 64.0,
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 120.0,
        "look_back_period_s": 30.0,
    }
    assert ingress["ray_actor_options"] == {"num_cpus": 0}
    assert ingress["max_ongoing_requests"] == 1 * 10 + 64 + 32  # engine capacity + queue + margin
    custom = Settings(
        cache={"max_slots": 16},
        autoscaling={
            "max_replicas": 4,
            "max_ingress_replicas": 2,
            "ingress_target_ongoing_requests": 100,
            "upscale_delay_s": 1,
        },
    )
    ingress = ingress_options(custom)
    scaling = ingress["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)
    assert scaling["target_ongoing_requests"] == 100.0 and scaling["upscale_delay_s"] == 1.0
    # one replica takes all 4 engines' requests (4 x 20) and the queue: a burst is relayed, not refused
    assert ingress["max_ongoing_requests"] == 4 * 20 + 64 + 32
    alone = Settings(autoscaling={"ingress_target_ongoing_requests": 500})
    assert ingress_options(alone)["max_ongoing_requests"] == 500  # never below its target
    with pytest.raises(ValueError, match="max_ingress_replicas"):
        build_app({"autoscaling.max_ingress_replicas": 0})


def test_build_app_validates_its_arguments() -> None:
    assert isinstance(build_app({"model.target": "x"}), serve.Application)  # builds, starts nothing
    with pytest.raises(ValueError, match=r"cache\.max_slots"):
        build_app({"cache": {"max_slots": 0}})


class FakeResponse:
    """A DeploymentResponseGenerator stand-in: streams chunks, may fail, records cancel()."""

    def __init__(self, chunks: list[GenerateChunk], error: Exception | None = None) -> None:
        self.chunks, self.error, self.cancelled = list(chunks), error, False

    def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self.chunks:
            return self.chunks.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, response: FakeResponse) -> None:
        self.response = response
        self.generate = self
        self.stream = False

    def options(self, stream: bool = False) -> FakeHandle:
        self.stream = stream
        return self

    def remote(self, request: GenerateRequest) -> FakeResponse:
        assert self.stream
        return self.response


def test_ray_engine_client_cancels_the_replica_call_when_closed_early() -> None:
    request = GenerateRequest("r", SamplingParams(max_tokens=4), prompt="x")
    chunks = [GenerateChunk("r", "a"), GenerateChunk("r", "b"), GenerateChunk("r", "c", finished=True)]

    async def first_only(response: FakeResponse) -> list[GenerateChunk]:
        gen = RayEngineClient(FakeHandle(response), "EngineDeployment").generate(request)
        got = [await gen.__anext__()]
        await gen.aclose()
        return got

    async def everything(response: FakeResponse) -> list[GenerateChunk]:
        return [c async for c in RayEngineClient(FakeHandle(response), "EngineDeployment").generate(request)]

    early = FakeResponse(chunks)
    assert [c.text for c in asyncio.run(first_only(early))] == ["a"] and early.cancelled
    full = FakeResponse(chunks)
    assert [c.text for c in asyncio.run(everything(full))] == ["a", "b", "c"] and not full.cancelled
    overloaded = FakeResponse([], BackPressureError(64, 64))
    (chunk,) = asyncio.run(everything(overloaded))
    assert chunk.finished and chunk.error.status == 503 and chunk.error.type == "overloaded_error"
    broken = FakeResponse(chunks[:1], RuntimeError("replica died"))
    got = asyncio.run(everything(broken))
    assert got[-1].error.status == 500 and "replica died" not in got[-1].error.message
