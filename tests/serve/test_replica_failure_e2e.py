"""A replica killed mid-load (issue 21's first chaos case), on a real local Ray cluster with two
SmolLM2-135M engine replicas and the official ``openai`` client.

What must hold: each stream that was on the killed replica ends with a clean error event in
OpenAI's shape (the client raises ``APIError`` naming the unavailable replica; no hang, no cut
JSON), each stream on the other replica finishes whole, short requests fail only while they were
in flight on the killed replica (503, ``engine_unavailable``) and all succeed from two seconds after
the kill, and Serve starts a replacement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
import ray
from ray import serve

from loadtest.chaos import engine_replica_actors
from serve_app.app import build_app
from tests.serve.test_autoscaling_e2e import SLOTS, running_replicas, small_replicas, wait_for

APP = "specserve-replica-failure-e2e"
MODEL = "smollm2-chaos"
PER_REPLICA = SLOTS + 2  # max_ongoing_requests: the slots and a waiting margin (app.deployment_options)
LONG = 200  # tokens of each long stream


@pytest.fixture(scope="module")
def client(smollm2_path, serve_http: str) -> Iterator[openai.OpenAI]:
    args = small_replicas(smollm2_path, MODEL, {"min_replicas": 2, "max_replicas": 2})
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        serve.delete(APP)


def long_stream(client: openai.OpenAI, results: list, index: int) -> None:
    """A streamed completion of ``LONG`` tokens: ("done", tokens) or ("error", the APIError)."""
    tokens = 0
    try:
        stream = client.completions.create(
            model=MODEL, prompt=f"# Story {index}\nOnce upon a time", max_tokens=LONG, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        results[index] = ("done", tokens)
    except openai.APIError as exc:
        results[index] = ("error", exc)


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_a_killed_replica_fails_only_what_it_ran_and_is_replaced(client: openai.OpenAI) -> None:
    wait_for(lambda: running_replicas(APP) == 2, 120, "two replicas")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None
    # As many streams as both replicas take at once: the router gives each replica at most
    # PER_REPLICA, so whichever replica dies had streams.
    streams: list = [None] * (2 * PER_REPLICA)
    threads = [threading.Thread(target=long_stream, args=(client, streams, i)) for i in range(len(streams))]
    for thread in threads:
        thread.start()
    time.sleep(4)  # every stream has reached its replica
    victim = engine_replica_actors(APP)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=180)
    assert not any(thread.is_alive() for thread in threads), "a stream hung after the kill"
    errors = [s[1] for s in streams if s[0] == "error"]
    assert all(s == ("done", LONG) for s in streams if s[0] == "done"), streams
    assert 1 <= len(errors) <= PER_REPLICA, streams  # the victim's streams, and only those
    for error in errors:
        assert isinstance(error.body, dict) and error.body.get("code") == "engine_unavailable", error.body
    # Once the router has dropped the dead replica, requests succeed (the survivor, then both).
    while time.monotonic() - killed_at < 2:
        time.sleep(0.2)
    for i in range(4):
        response = client.completions.create(model=MODEL, prompt=f"def f{i}(x):", max_tokens=8)
        assert response.choices[0].finish_reason in ("stop", "length")
    replaced = lambda: running_replicas(APP) == 2 and victim not in engine_replica_actors(APP)  # noqa: E731
    wait_for(replaced, 180, "a replacement")
