"""``GET /metrics`` of a real local server (Ray Serve, SmolLM2, the official openai client), parsed
with ``prometheus_client``: every metric present with its type and labels, and the counters equal
to what the clients counted, refusals of Serve's queue included."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from serve_app.observability import metric_names as m

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from serve_app.app import build_app  # noqa: E402  (after the Ray check)

APP = "specserve-metrics"
MODEL = "smol-metrics"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def base_url(smollm2_path, serve_http: str) -> Iterator[str]:
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": pack},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 2, "max_seq_len": 512},
        "speculation": {
            "method": "draft",
            "depth": 3,
            "policy": "static",
            "proposers": {"draft": {"int8": False}},
        },
        "server": {"served_model_name": MODEL},
        # one request may wait in Serve's queue: a burst beyond slots + margin + 1 is refused (503)
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 1},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield serve_http
    finally:
        serve.delete(APP)


@dataclass
class ClientCounts:
    """What the clients saw: the numbers the server's counters must equal."""

    requests: dict[str, int] = field(default_factory=dict)  # by finish reason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    refused: int = 0

    def add(self, reason: str, prompt: int, completion: int, speculation: dict | None) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.drafted += (speculation or {}).get("drafted", 0)
        self.accepted += (speculation or {}).get("accepted", 0)


def scrape(base_url: str) -> dict[str, list[Sample]]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        spec = m.METRICS_BY_NAME.get(family.name)
        assert spec is not None, f"/metrics shows a family we do not declare: {family.name}"
        assert family.type == spec.kind, family.name
        for sample in family.samples:
            assert set(spec.tag_keys) <= set(sample.labels), (sample.name, sample.labels)
            samples.setdefault(sample.name, []).append(sample)
    return samples


def total(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The sum of ``name``'s series of this module's model (the session's cluster also exports
    series of other tests' applications) that carry ``labels``."""
    labels = {"model_name": MODEL, **labels}
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def run_clients(client: openai.OpenAI) -> ClientCounts:
    counts = ClientCounts()
    for max_tokens in (8, 200):  # one cut by max_tokens ("length"), one that may stop on its own
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0
        )
        counts.add(r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens,
                   r.model_extra.get("speculation"))  # fmt: skip
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    reason, usage, speculation = None, None, None
    for chunk in stream:
        reason = next((c.finish_reason for c in chunk.choices if c.finish_reason), reason)
        usage = chunk.usage or usage
        speculation = (chunk.model_extra or {}).get("speculation") or speculation
    counts.add(reason, usage.prompt_tokens, usage.completion_tokens, speculation)
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0,
                                  extra_body={"speculation": {"mode": "off"}})  # fmt: skip
    counts.add(r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens,
               r.model_extra.get("speculation"))  # fmt: skip
    return counts


def burst(client: openai.OpenAI, counts: ClientCounts, n: int = 12) -> None:
    """More concurrent requests than the replica holds plus Serve's one queued: some get 503."""

    lock = threading.Lock()  # the counts are shared by the client threads

    def one(_: int) -> None:
        try:
            r = client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0
            )
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc.response.text
            with lock:
                counts.refused += 1
            return
        with lock:
            counts.add(r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens,
                       r.model_extra.get("speculation"))  # fmt: skip

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_metrics_endpoint_counts_what_the_clients_saw(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    counts = run_clients(client)
    burst(client, counts)
    assert counts.refused > 0 and counts.drafted > 0
    finished = sum(counts.requests.values())

    deadline = time.monotonic() + 60  # Ray reports each worker's metrics to its node every second
    samples = scrape(base_url)
    while time.monotonic() < deadline and (
        total(samples, m.REQUEST_SUCCESS + "_total") < finished
        or total(samples, m.REQUESTS_REFUSED + "_total") < counts.refused
    ):
        time.sleep(1.0)
        samples = scrape(base_url)

    for reason, n in counts.requests.items():
        assert total(samples, m.REQUEST_SUCCESS + "_total", finished_reason=reason) == n, reason
    assert total(samples, m.REQUEST_SUCCESS + "_total") == finished
    assert total(samples, m.REQUESTS_REFUSED + "_total") == counts.refused  # Serve's or the engine's
    assert total(samples, m.PROMPT_TOKENS + "_total") == counts.prompt_tokens
    assert total(samples, m.GENERATION_TOKENS + "_total") == counts.completion_tokens
    assert total(samples, m.NUM_DRAFT_TOKENS + "_total", proposer="draft", policy="static") == counts.drafted
    assert total(samples, m.NUM_ACCEPTED_TOKENS + "_total", proposer="draft") == counts.accepted
    assert total(samples, m.NUM_ACCEPTED_TOKENS_PER_POS + "_total") == counts.accepted
    assert total(samples, m.TTFT + "_count") == finished
    assert total(samples, m.ITL + "_count") == counts.completion_tokens - finished
    for name in (m.E2E, m.QUEUE_TIME, m.PREFILL_TIME, m.DECODE_TIME, m.INFERENCE_TIME):
        assert total(samples, name + "_count") == finished, name
    assert total(samples, m.EXACT_MODE) == 1.0  # float32 SmolLM2: speculation is bit-exact here
    assert total(samples, m.NUM_RUNNING) == 0 and total(samples, m.KV_CACHE_USAGE) == 0
    assert total(samples, m.FALLBACKS + "_total", proposer=m.NO_PROPOSER) > 0  # the "off" request
    shown = set(samples)  # every declared metric is there: this run recorded each at least once
    for spec in m.METRICS:
        assert set(spec.exported_names()) & shown, f"{spec.name} missing from /metrics"
    time.sleep(12)  # idle: Ray evicts gauges not set again for seconds; the replica keeps them set
    idle = scrape(base_url)
    assert total(idle, m.EXACT_MODE) == 1.0 and m.NUM_RUNNING in idle and m.KV_CACHE_USAGE in idle
