"""Warm start (issue 21): a new replica reads the cluster's acceptance statistics from Redis before
its first request, so its first step already plans from them; with an empty Redis it starts cold.

A replica is built as Serve builds one (``build_async_engine``: SmolLM2-135M, prompt lookup, the
default goodput policy) against a Redis of the test's own. The cluster's verdict is written there
first by another ``SharedStats`` (another replica, as far as Redis can tell): prompt lookup on this
model was tried on 4,000 drafts of 4 tokens and never accepted. Warm, the replica's first request
drafts nothing: it believes the cluster from step one. Cold (the same Redis, another key prefix),
the same request drafts: the cold guess is explored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from policies.workload import CODE, JSON, PROSE
from serve_app.builder import build_async_engine, model_pair
from serve_app.config import StatsSettings, build_settings
from serve_app.engine.params import SamplingParams
from serve_app.observability.shared_stats import AcceptanceKey, SharedStats
from serve_app.wire import GenerateRequest
from tests.serve.redis_server import RedisServer, own_redis_server

# Repetitive code: prompt lookup finds continuations in it at once.
PROMPT = (
    "".join(f"def get_{name}(self):\n    return self._{name}\n\n" for name in ("a", "b", "c", "d"))
    + "def get_e"
)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with own_redis_server() as server:
        yield server


def replica_settings(pack: object, url: str, prefix: str) -> dict:
    return {
        "model": {"target": str(pack), "draft": None},
        "runtime": {"dtype": "float32", "threads": 1},
        "cache": {"max_slots": 2, "max_seq_len": 512},
        # the default cost model, not one profiled here: on a model this small a 2-token forward can
        # time as fast as a 1-token one, and then a draft pays even at acceptance 0
        "speculation": {"method": "ngram", "depth": 4, "profile_cost_model": False},
        "stats": {"redis_url": url, "key_prefix": prefix, "flush_interval_s": 0.2, "refresh_interval_s": 0.5},
    }


def publish_a_verdict(stats_settings: StatsSettings, pair: str) -> None:
    """Another replica's counts in Redis: 4,000 drafts of 4 tokens for each workload, none accepted."""
    other = SharedStats(stats_settings, "another-replica")
    try:
        for workload in (CODE, JSON, PROSE):
            other.record(AcceptanceKey(pair, "ngram", workload), [4000] * 4, [0] * 4, steps=4000)
        assert other.flush_now()
    finally:
        other.close()


def first_request_drafted(data: dict) -> int:
    """Draft tokens of a new replica's first request (greedy, 24 tokens)."""
    engine = build_async_engine(build_settings(data, environment=False), metrics_backend="memory")
    try:

        async def run() -> dict:
            request = GenerateRequest("first", SamplingParams(max_tokens=24, temperature=0.0), prompt=PROMPT)
            chunks = [chunk async for chunk in engine.generate(request)]
            assert chunks[-1].error is None, chunks[-1].error
            return chunks[-1].speculation or {}

        return int(asyncio.run(run()).get("drafted", 0))
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_a_new_replica_plans_its_first_step_from_the_cluster_and_starts_cold_without(
    smollm2_path, redis_server: RedisServer
) -> None:
    warm = replica_settings(smollm2_path, redis_server.url, "warm")
    settings = build_settings(warm, environment=False)
    publish_a_verdict(settings.stats, model_pair(settings, "ngram"))

    assert first_request_drafted(warm) == 0  # the cluster's verdict, from the first step
    cold = first_request_drafted(replica_settings(smollm2_path, redis_server.url, "cold"))
    assert cold > 0  # nothing in Redis under this prefix: the cold guess is explored
