"""Autoscaling for real (issue 21): Serve adds an engine replica under load and removes it when the
load is gone, on a real local Ray cluster with the SmolLM2-135M pack and the official ``openai``
client; no request fails, and a stream running on the replica being removed finishes whole (Serve's
graceful shutdown waits for it).

The delays are seconds instead of the defaults' minutes (``autoscaling`` settings: upscale 1 s,
downscale 3 s, a 2 s window; the session's cluster pushes load figures every second).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator

import openai
import pytest
import requests
from ray import serve

from serve_app.app import ENGINE_DEPLOYMENT, build_app

APP = "specserve-autoscaling-e2e"
MODEL = "smollm2-autoscaling"
SLOTS = 2


def small_replicas(pack: object, model: str, autoscaling: dict) -> dict:
    """``build_app`` arguments: SmolLM2 replicas of 1 thread and 1 CPU each (two fit the test
    cluster), SLOTS slots, prompt lookup, float32."""
    return {
        "model": {"target": str(pack), "draft": None},
        "runtime": {"dtype": "float32", "threads": 1},
        "cache": {"max_slots": SLOTS, "max_seq_len": 1024},
        "speculation": {"method": "ngram", "depth": 4, "policy": "static"},
        "server": {"served_model_name": model},
        "autoscaling": {"replica_num_cpus": 1, **autoscaling},
    }


@pytest.fixture(scope="module")
def client(smollm2_path, serve_http: str) -> Iterator[openai.OpenAI]:
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": SLOTS, "upscale_delay_s": 1,
               "downscale_delay_s": 3, "look_back_period_s": 2}  # fmt: skip
    args = small_replicas(smollm2_path, MODEL, scaling)
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        serve.delete(APP)


def running_replicas(app: str = APP) -> int:
    """The application's engine replicas in state RUNNING, as Serve's controller reports them."""
    deployment = serve.status().applications[app].deployments[ENGINE_DEPLOYMENT]
    return int(deployment.replica_states.get("RUNNING", 0))


def replicas_in_metrics(base_url: str) -> set[str]:
    """The ``replica`` labels of this application's running-requests gauge in ``GET /metrics``
    (the README's way to watch it scale)."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    lines = (line for line in text.splitlines() if line.startswith("specserve:num_requests_running{"))
    return {
        match.group(1)
        for line in lines
        if f'model_name="{MODEL}"' in line and (match := re.search(r'replica="([^"]+)"', line))
    }


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``condition`` held (polled twice a second); fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - start


class Load:
    """``users`` threads sending short completions back to back until stopped; counts each outcome."""

    def __init__(self, client: openai.OpenAI, users: int) -> None:
        self.client, self.stop = client, threading.Event()
        self.answered, self.failed = 0, []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(users)]

    def _user(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                response = self.client.completions.create(
                    model=MODEL, prompt=f"def function_{index}(x):", max_tokens=24, temperature=0.0
                )
                ok = response.choices[0].finish_reason in ("stop", "length")
                with self.lock:
                    self.answered += ok
                    self.failed += [] if ok else [response.choices[0].finish_reason]
            except Exception as exc:  # every failure is the test's business: it asserts none
                with self.lock:
                    self.failed.append(repr(exc))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def long_stream(client: openai.OpenAI, results: list, index: int) -> None:
    """A streamed completion of a fixed length: (text length in chunks, finish reason, tokens)."""
    try:
        chunks, reason, usage = 0, None, None
        stream = client.completions.create(
            model=MODEL, prompt=f"# Story {index}\nOnce upon a time", max_tokens=300, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            for choice in chunk.choices:
                chunks += bool(choice.text)
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        results[index] = (chunks, reason, usage.completion_tokens if usage else None)
    except Exception as exc:
        results[index] = repr(exc)


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_scales_up_under_load_and_down_after_losing_nothing(client: openai.OpenAI, serve_http: str) -> None:
    assert running_replicas() == 1
    streams: list = [None, None]
    with Load(client, users=3 * SLOTS) as load:
        up = wait_for(lambda: running_replicas() == 2, 180, "a second replica under load")
        wait_for(lambda: len(replicas_in_metrics(serve_http)) == 2, 60, "both replicas in /metrics")
        # a long stream on each replica (the router spreads them), started while both run
        threads = [threading.Thread(target=long_stream, args=(client, streams, i)) for i in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(3)
    # Only the two streams are left: within target_ongoing_requests of one replica, so Serve removes
    # one, and the stream on it must finish before that replica goes.
    down = wait_for(lambda: running_replicas() == 1, 120, "back to one replica once the load is gone")
    for thread in threads:
        thread.join(timeout=300)
    assert load.failed == [] and load.answered > 0, load.failed
    assert streams == [(s[0], "length", 300) if isinstance(s, tuple) else s for s in streams], streams
    assert all(isinstance(s, tuple) and s[0] > 0 for s in streams), streams
    print(f"up after {up:.0f} s of load, down {down:.0f} s after it stopped; {load.answered} answered")
