"""Engine metrics: exact counts through the memory backend, and the Ray backend inside a local Ray."""

from __future__ import annotations

import pytest

from serve_app.observability.metric_names import (
    BATCH_SIZE,
    DECODE_TIME,
    E2E,
    ENGINE_QUEUE_FULL,
    EXACT_MODE,
    FALLBACKS,
    GENERATION_TOKENS,
    INFERENCE_TIME,
    ITL,
    KV_CACHE_USAGE,
    METRICS,
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    NUM_RUNNING,
    NUM_WAITING,
    PREFILL_TIME,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUEST_GENERATION_TOKENS,
    REQUEST_SUCCESS,
    REQUESTS_REFUSED,
    SPEC_DEPTH,
    TPOT,
    TTFT,
    exported_sample_names,
    from_ray_name,
    ray_name,
)
from serve_app.observability.metrics import EngineMetrics, RequestTimings, StepOutcome


@pytest.fixture
def metrics() -> EngineMetrics:
    m = EngineMetrics("tiny", backend="memory", replica="r0", policy="adaptive")
    # step 1: two draft rows (one all accepted + bonus, one rejected at once), one plain row
    m.on_step(
        3,
        [
            StepOutcome("draft", 4, 4, 4, 5),
            StepOutcome("draft", 4, 4, 0, 1),
            StepOutcome(None, 0, 0, 0, 1),
        ],
    )
    # step 2: an n-gram row that found a match, one that found none, a draft row cut to 2 drafts
    m.on_step(
        3,
        [
            StepOutcome("ngram", 3, 3, 2, 3),
            StepOutcome("ngram", 3, 0, 0, 1),
            StepOutcome("draft", 6, 2, 1, 2),
        ],
    )
    # step 3: plain only (speculation off, or the policy chose depth 0)
    m.on_step(1, [StepOutcome("draft", 0, 0, 0, 1)])
    return m


def test_speculation_counters(metrics: EngineMetrics) -> None:
    assert metrics.value(NUM_DRAFTS) == 4
    assert metrics.value(NUM_DRAFTS, proposer="draft") == 3
    assert metrics.value(NUM_DRAFTS, proposer="ngram") == 1
    assert metrics.value(NUM_DRAFT_TOKENS, proposer="draft") == 4 + 4 + 2
    assert metrics.value(NUM_DRAFT_TOKENS, proposer="ngram") == 3
    assert metrics.value(NUM_ACCEPTED_TOKENS, proposer="draft") == 4 + 0 + 1
    assert metrics.value(NUM_ACCEPTED_TOKENS, proposer="ngram") == 2
    assert metrics.value(GENERATION_TOKENS) == 5 + 1 + 1 + 3 + 1 + 2 + 1
    assert metrics.value(GENERATION_TOKENS, model_name="tiny") == 14
    assert metrics.value(GENERATION_TOKENS, model_name="other") == 0


def test_per_position_acceptance(metrics: EngineMetrics) -> None:
    def per_pos(proposer: str, position: int) -> float:
        return metrics.value(NUM_ACCEPTED_TOKENS_PER_POS, proposer=proposer, position=str(position))

    # draft rows accepted 4, 0 and 1: positions 0..3 kept 2, 1, 1, 1 times
    assert [per_pos("draft", j) for j in range(5)] == [2, 1, 1, 1, 0]
    assert [per_pos("ngram", j) for j in range(3)] == [1, 1, 0]
    # per-position counts add up to the accepted tokens
    assert metrics.value(NUM_ACCEPTED_TOKENS_PER_POS) == metrics.value(NUM_ACCEPTED_TOKENS)


def test_fallbacks_and_depths(metrics: EngineMetrics) -> None:
    assert metrics.value(FALLBACKS, proposer="none") == 2  # no proposer, or depth 0
    assert metrics.value(FALLBACKS, proposer="ngram") == 1  # chosen, but drafted nothing
    assert metrics.value(FALLBACKS, proposer="draft") == 0
    draft_depths = metrics.histogram(SPEC_DEPTH, proposer="draft")
    assert draft_depths.count == 3 and draft_depths.sum == 4 + 4 + 6
    bounds = draft_depths.boundaries
    assert draft_depths.bucket_counts[bounds.index(4.0)] == 2  # "le 4" holds exactly the 4s
    assert draft_depths.bucket_counts[bounds.index(6.0)] == 1
    ngram_depths = metrics.histogram(SPEC_DEPTH, proposer="ngram")
    assert ngram_depths.count == 2 and ngram_depths.sum == 6
    batch = metrics.histogram(BATCH_SIZE)
    assert batch.count == 3 and batch.sum == 7


def test_speculation_series_carry_replica_and_policy(metrics: EngineMetrics) -> None:
    assert metrics.value(NUM_DRAFTS, replica="r0", policy="adaptive") == 4
    assert metrics.value(NUM_DRAFTS, policy="fixed") == 0
    metrics.set_policy("fixed")
    metrics.on_step(1, [StepOutcome("draft", 2, 2, 2, 3)])
    assert metrics.value(NUM_DRAFTS, policy="fixed") == 1 and metrics.value(NUM_DRAFTS) == 5


def test_requests_and_load() -> None:
    m = EngineMetrics("tiny", backend="memory")
    full = RequestTimings(e2e=2.0, queue=0.5, prefill=0.25, decode=1.25, inference=1.5, ttft=0.75, tpot=0.04)
    m.on_request_finished(full, 10, 32, "stop")
    m.on_request_finished(RequestTimings(e2e=1.5, queue=0.1, prefill=1.4, decode=0.0, inference=1.4,
                                         ttft=1.5), 7, 1, "length")  # fmt: skip
    m.on_request_finished(RequestTimings(e2e=0.3), 5, 0, None)  # aborted while it waited for a slot
    assert m.value(PROMPT_TOKENS) == 22
    assert m.value(REQUEST_SUCCESS) == 3
    assert m.value(REQUEST_SUCCESS, finished_reason="stop") == 1
    assert m.value(REQUEST_SUCCESS, finished_reason="unknown") == 1
    assert m.histogram(E2E).count == 3 and m.histogram(E2E).sum == pytest.approx(3.8)
    assert m.histogram(QUEUE_TIME).count == 2 and m.histogram(QUEUE_TIME).sum == pytest.approx(0.6)
    assert m.histogram(PREFILL_TIME).sum == pytest.approx(1.65)
    assert m.histogram(DECODE_TIME).count == 2 and m.histogram(INFERENCE_TIME).sum == pytest.approx(2.9)
    assert m.histogram(TTFT).count == 0  # recorded when the first token is made, not here
    assert m.histogram(TPOT).count == 1
    assert m.histogram(REQUEST_GENERATION_TOKENS).sum == 33
    m.set_load(running=3, queued=5, kv_cache_usage=0.5)
    m.set_load(running=2, queued=0, kv_cache_usage=0.25)  # gauges hold the latest value
    assert m.value(NUM_RUNNING) == 2
    assert m.value(NUM_WAITING) == 0
    assert m.value(KV_CACHE_USAGE) == 0.25
    m.on_refused(ENGINE_QUEUE_FULL)
    assert m.value(REQUESTS_REFUSED, reason=ENGINE_QUEUE_FULL) == 1
    m.set_exact(True)
    assert m.value(EXACT_MODE) == 1.0


def test_first_token_and_inter_token_latency_as_they_happen() -> None:
    m = EngineMetrics("tiny", backend="memory")
    m.on_first_token(0.5, 1)
    assert m.histogram(TTFT).count == 1 and m.histogram(TTFT).sum == 0.5
    assert m.value(GENERATION_TOKENS) == 1
    m.on_tokens(0.1, 1)  # a plain step
    m.on_tokens(0.2, 4)  # a speculative step: four tokens share its gap
    m.on_tokens(0.3, 0)  # nothing emitted: nothing recorded
    itl = m.histogram(ITL)
    assert itl.count == 5 and itl.sum == pytest.approx(0.3)
    assert itl.bucket_counts[itl.boundaries.index(0.05)] == 4  # 0.05 each, in the "le 0.05" bucket


def test_snapshot_is_a_copy_with_labels() -> None:
    m = EngineMetrics("tiny", backend="memory", replica="r1", policy="fixed")
    m.on_step(1, [StepOutcome("draft", 2, 2, 1, 2)])
    snap = m.snapshot()
    assert set(snap) == {spec.name for spec in METRICS}
    series = (("model_name", "tiny"), ("policy", "fixed"), ("proposer", "draft"), ("replica", "r1"))
    assert snap[NUM_DRAFTS] == {series: 1}
    assert snap[NUM_ACCEPTED_TOKENS_PER_POS] == {tuple(sorted((*series, ("position", "0")))): 1}
    m.on_step(1, [StepOutcome("draft", 2, 2, 1, 2)])
    assert snap[NUM_DRAFTS][series] == 1  # unchanged copy
    engine_series = (("model_name", "tiny"), ("replica", "r1"))
    assert m.histogram(BATCH_SIZE).count == 2 and snap[BATCH_SIZE][engine_series].count == 1


def test_readers_refuse_wrong_kinds_and_backends() -> None:
    m = EngineMetrics("tiny", backend="memory")
    with pytest.raises(TypeError):
        m.value(TTFT)
    with pytest.raises(TypeError):
        m.histogram(NUM_DRAFTS)
    with pytest.raises(ValueError):
        EngineMetrics("tiny", backend="prometheus")  # type: ignore[arg-type]


def test_metric_names_are_valid_and_unique() -> None:
    names = [spec.name for spec in METRICS]
    assert len(names) == len(set(names))
    for spec in METRICS:
        assert spec.name.startswith("specserve:") and not spec.name.endswith("_total")
        assert spec.tag_keys[:2] == ("model_name", "replica")
        assert ":" not in ray_name(spec.name)  # Ray's pipeline drops names with a colon
        if spec.kind == "histogram":
            assert list(spec.boundaries) == sorted(spec.boundaries) and spec.boundaries[0] > 0
    assert from_ray_name("ray_" + ray_name(TTFT) + "_bucket") == TTFT + "_bucket"
    assert from_ray_name("ray_serve_num_router_requests_total") is None
    assert "specserve:generation_tokens_total" in exported_sample_names()
    assert "specserve:time_to_first_token_seconds_bucket" in exported_sample_names()
    assert "specserve:num_requests_running_total" not in exported_sample_names()


def test_ray_backend_records_inside_local_ray() -> None:
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()  # never shut down a Ray another test started
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        m = EngineMetrics("tiny", backend="ray")
        from ray.util import metrics as ray_metrics

        objects = m._sink.metrics
        assert set(objects) == {spec.name for spec in METRICS}  # recorded under ray_name(...)
        assert isinstance(objects[NUM_DRAFT_TOKENS], ray_metrics.Counter)
        assert isinstance(objects[TTFT], ray_metrics.Histogram)
        assert isinstance(objects[NUM_RUNNING], ray_metrics.Gauge)
        m.on_step(2, [StepOutcome("draft", 4, 4, 2, 3), StepOutcome(None, 0, 0, 0, 1)])
        m.on_step(1, [StepOutcome("ngram", 3, 0, 0, 1)])  # zero increments are skipped, not refused
        m.on_first_token(0.1, 1)
        m.on_tokens(0.03, 3)
        m.on_request_finished(RequestTimings(e2e=0.2, queue=0.01, prefill=0.09, decode=0.1, inference=0.19,
                                             ttft=0.1, tpot=0.01), 12, 4, "stop")  # fmt: skip
        m.on_request_finished(RequestTimings(e2e=0.05), 3, 0, None)
        m.on_refused(ENGINE_QUEUE_FULL)
        m.set_load(1, 0, 0.125)
        m.set_exact(False)
        with pytest.raises(RuntimeError):
            m.snapshot()  # read through Prometheus, not here
    finally:
        if started:
            ray.shutdown()
