"""Engine metrics: exact counts through the memory backend, and the Ray backend inside a local Ray."""

from __future__ import annotations

import pytest

from serve_app.observability.metrics import (
    BATCH_SIZE,
    FALLBACKS,
    GENERATION_TOKENS,
    METRICS,
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    NUM_RUNNING,
    NUM_WAITING,
    PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_SUCCESS,
    SPEC_DEPTH,
    TPOT,
    TTFT,
    EngineMetrics,
    StepOutcome,
)


@pytest.fixture
def metrics() -> EngineMetrics:
    m = EngineMetrics("tiny", backend="memory")
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


def test_requests_and_load() -> None:
    m = EngineMetrics("tiny", backend="memory")
    m.on_request_finished(0.25, 0.02, 10, 32, "stop")
    m.on_request_finished(1.5, None, 7, 1, "length")
    m.on_request_finished(None, None, 5, 0, None)  # aborted before its first token
    assert m.value(PROMPT_TOKENS) == 22
    assert m.value(REQUEST_SUCCESS) == 3
    assert m.value(REQUEST_SUCCESS, finish_reason="stop") == 1
    assert m.value(REQUEST_SUCCESS, finish_reason="unknown") == 1
    ttft = m.histogram(TTFT)
    assert ttft.count == 2 and ttft.sum == pytest.approx(1.75)
    assert sum(ttft.bucket_counts) == 2
    assert m.histogram(TPOT).count == 1
    assert m.histogram(REQUEST_GENERATION_TOKENS).sum == 33
    m.set_load(running=3, queued=5)
    m.set_load(running=2, queued=0)  # gauges hold the latest value
    assert m.value(NUM_RUNNING) == 2
    assert m.value(NUM_WAITING) == 0


def test_snapshot_is_a_copy_with_labels() -> None:
    m = EngineMetrics("tiny", backend="memory")
    m.on_step(1, [StepOutcome("draft", 2, 2, 1, 2)])
    snap = m.snapshot()
    assert set(snap) == {spec.name for spec in METRICS}
    assert snap[NUM_DRAFTS] == {(("model_name", "tiny"), ("proposer", "draft")): 1}
    assert snap[NUM_ACCEPTED_TOKENS_PER_POS] == {
        (("model_name", "tiny"), ("position", "0"), ("proposer", "draft")): 1
    }
    m.on_step(1, [StepOutcome("draft", 2, 2, 1, 2)])
    assert snap[NUM_DRAFTS][(("model_name", "tiny"), ("proposer", "draft"))] == 1  # unchanged copy
    assert m.histogram(BATCH_SIZE).count == 2 and snap[BATCH_SIZE][(("model_name", "tiny"),)].count == 1


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
        assert spec.name.startswith("specserve_") and not spec.name.endswith("_total")
        assert spec.tag_keys[0] == "model_name"
        if spec.kind == "histogram":
            assert list(spec.boundaries) == sorted(spec.boundaries) and spec.boundaries[0] > 0


def test_ray_backend_records_inside_local_ray() -> None:
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()  # never shut down a Ray another test started
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        m = EngineMetrics("tiny", backend="ray")
        from ray.util import metrics as ray_metrics

        objects = m._sink.metrics
        assert set(objects) == {spec.name for spec in METRICS}
        assert isinstance(objects[NUM_DRAFT_TOKENS], ray_metrics.Counter)
        assert isinstance(objects[TTFT], ray_metrics.Histogram)
        assert isinstance(objects[NUM_RUNNING], ray_metrics.Gauge)
        m.on_step(2, [StepOutcome("draft", 4, 4, 2, 3), StepOutcome(None, 0, 0, 0, 1)])
        m.on_step(1, [StepOutcome("ngram", 3, 0, 0, 1)])  # zero increments are skipped, not refused
        m.on_request_finished(0.1, 0.01, 12, 4, "stop")
        m.on_request_finished(None, None, 3, 0, None)
        m.set_load(1, 0)
        with pytest.raises(RuntimeError):
            m.snapshot()  # read through Prometheus, not here
    finally:
        if started:
            ray.shutdown()
