"""Engine metrics for Prometheus, through Ray's metrics API, named like vLLM's.

Every series carries the tag ``model_name``; speculation series also carry ``proposer``. Names are
given here without Ray's decoration: Ray's Prometheus exporter prefixes every application metric
with ``ray_`` and exports a counter with the suffix ``_total`` (histograms as ``_bucket``,
``_sum`` and ``_count``), so ``specserve_spec_decode_num_draft_tokens`` is scraped as
``ray_specserve_spec_decode_num_draft_tokens_total`` and
``specserve_time_to_first_token_seconds`` as ``ray_specserve_time_to_first_token_seconds_bucket``.

Counters:

- ``specserve_spec_decode_num_drafts`` (proposer): request-steps that verified a non-empty draft.
- ``specserve_spec_decode_num_draft_tokens`` (proposer): draft tokens verified by the target.
- ``specserve_spec_decode_num_accepted_tokens`` (proposer): draft tokens the target accepted.
- ``specserve_spec_decode_num_accepted_tokens_per_pos`` (proposer, position): draft tokens accepted
  at draft position ``position`` (0-based; acceptance is a prefix, so position j counts the drafts
  that kept more than j tokens).
- ``specserve_spec_decode_fallbacks`` (proposer): request-steps decoded plain: the policy chose no
  proposer or depth 0 (``proposer="none"``), or the chosen proposer drafted nothing (its name).
- ``specserve_generation_tokens``: tokens emitted (every token of a request, the first one included).
- ``specserve_prompt_tokens``: prompt tokens of finished requests.
- ``specserve_request_success`` (finish_reason): finished requests, aborts included.

Histograms: ``specserve_time_to_first_token_seconds``, ``specserve_time_per_output_token_seconds``,
``specserve_request_prompt_tokens`` and ``specserve_request_generation_tokens`` (per finished
request), ``specserve_spec_decode_depth`` (proposer; the depth chosen for each request-step that
had a proposer and depth >= 1 -- plain ones count as fallbacks), ``specserve_batch_size`` (requests
decoded per engine step).

Gauges: ``specserve_num_requests_running`` (holding a KV slot), ``specserve_num_requests_waiting``
(queued for one).

Acceptance rate is ``accepted_tokens / draft_tokens``; the mean accepted length is
``(accepted_tokens + num_drafts) / num_drafts``; per-position acceptance is
``accepted_tokens_per_pos{position=j} / num_drafts`` (for a fixed depth).

Two backends sit behind one small interface: ``"ray"`` records through ``ray.util.metrics`` (inside
a Ray worker, e.g. a Serve replica); ``"memory"`` keeps plain Python sums, for tests and for running
outside Ray, and can be read back with :meth:`EngineMetrics.snapshot` and :meth:`EngineMetrics.value`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Kind = Literal["counter", "histogram", "gauge"]
Labels = tuple[tuple[str, str], ...]  # sorted (tag, value) pairs: one series of a metric

NO_PROPOSER = "none"  # the proposer tag of plain decoding
UNKNOWN_REASON = "unknown"  # the finish_reason tag when none was given

# Bucket upper bounds (Ray requires them positive; Prometheus adds +Inf).
TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip
DEPTH_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
TOKEN_COUNT_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricSpec:
    """One metric as declared once and created once per backend."""

    name: str
    kind: Kind
    description: str
    tag_keys: tuple[str, ...] = ("model_name",)
    boundaries: tuple[float, ...] = ()


_MODEL = ("model_name",)
_PROPOSER = ("model_name", "proposer")

NUM_DRAFTS = "specserve_spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "specserve_spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "specserve_spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "specserve_spec_decode_num_accepted_tokens_per_pos"
FALLBACKS = "specserve_spec_decode_fallbacks"
GENERATION_TOKENS = "specserve_generation_tokens"
PROMPT_TOKENS = "specserve_prompt_tokens"
REQUEST_SUCCESS = "specserve_request_success"
TTFT = "specserve_time_to_first_token_seconds"
TPOT = "specserve_time_per_output_token_seconds"
REQUEST_PROMPT_TOKENS = "specserve_request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "specserve_request_generation_tokens"
SPEC_DEPTH = "specserve_spec_decode_depth"
BATCH_SIZE = "specserve_batch_size"
NUM_RUNNING = "specserve_num_requests_running"
NUM_WAITING = "specserve_num_requests_waiting"

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(NUM_DRAFTS, "counter", "Request-steps that verified a non-empty draft.", _PROPOSER),
    MetricSpec(NUM_DRAFT_TOKENS, "counter", "Draft tokens verified by the target.", _PROPOSER),
    MetricSpec(NUM_ACCEPTED_TOKENS, "counter", "Draft tokens accepted by the target.", _PROPOSER),
    MetricSpec(
        NUM_ACCEPTED_TOKENS_PER_POS,
        "counter",
        "Draft tokens accepted at each draft position (0-based).",
        ("model_name", "proposer", "position"),
    ),
    MetricSpec(
        FALLBACKS,
        "counter",
        "Request-steps decoded plain: no proposer or depth 0 (proposer=none), or an empty draft.",
        _PROPOSER,
    ),
    MetricSpec(GENERATION_TOKENS, "counter", "Tokens generated (emitted to clients).", _MODEL),
    MetricSpec(PROMPT_TOKENS, "counter", "Prompt tokens of finished requests.", _MODEL),
    MetricSpec(REQUEST_SUCCESS, "counter", "Finished requests.", ("model_name", "finish_reason")),
    MetricSpec(TTFT, "histogram", "Time to first token in seconds.", _MODEL, TTFT_BUCKETS),
    MetricSpec(TPOT, "histogram", "Time per output token in seconds.", _MODEL, TPOT_BUCKETS),
    MetricSpec(REQUEST_PROMPT_TOKENS, "histogram", "Prompt tokens per request.", _MODEL, TOKEN_COUNT_BUCKETS),
    MetricSpec(
        REQUEST_GENERATION_TOKENS, "histogram", "Generated tokens per request.", _MODEL, TOKEN_COUNT_BUCKETS
    ),
    MetricSpec(
        SPEC_DEPTH,
        "histogram",
        "Speculation depth chosen per speculative request-step.",
        _PROPOSER,
        DEPTH_BUCKETS,
    ),
    MetricSpec(BATCH_SIZE, "histogram", "Requests decoded per engine step.", _MODEL, BATCH_SIZE_BUCKETS),
    MetricSpec(NUM_RUNNING, "gauge", "Requests running (holding a KV slot).", _MODEL),
    MetricSpec(NUM_WAITING, "gauge", "Requests waiting for a KV slot.", _MODEL),
)


@dataclass(frozen=True)
class StepOutcome:
    """One request in one engine step: what the policy chose and what verification kept.

    ``proposer`` None or ``depth`` 0 means the policy chose plain decoding; ``drafted`` may be
    below ``depth`` (a proposer may stop early or find nothing); ``emitted`` counts the accepted
    drafts plus the target's own token, cut by stop conditions.
    """

    proposer: str | None
    depth: int
    drafted: int
    accepted: int
    emitted: int

    @classmethod
    def of(cls, output: Any) -> StepOutcome:
        """From a ``RequestOutput`` of the step."""
        drafted = output.step_drafted
        return cls(output.step_proposer, drafted, drafted, output.step_accepted, len(output.new_token_ids))


# --- backends -------------------------------------------------------------------------------------


class _Sink(Protocol):
    """What EngineMetrics records through; tags always carry every key the metric declares."""

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None: ...

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None: ...

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None: ...


class _RaySink:
    """``ray.util.metrics`` objects, created once; exported by Ray's metrics agent."""

    def __init__(self, specs: Sequence[MetricSpec]) -> None:
        from ray.util import metrics as ray_metrics  # only this backend needs Ray

        self.metrics: dict[str, Any] = {}
        for spec in specs:
            if spec.kind == "counter":
                metric = ray_metrics.Counter(spec.name, spec.description, spec.tag_keys)
            elif spec.kind == "gauge":
                metric = ray_metrics.Gauge(spec.name, spec.description, spec.tag_keys)
            else:
                metric = ray_metrics.Histogram(
                    spec.name, spec.description, list(spec.boundaries), spec.tag_keys
                )
            self.metrics[spec.name] = metric

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.metrics[name].inc(float(value), dict(tags))

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.metrics[name].observe(float(value), dict(tags))

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.metrics[name].set(float(value), dict(tags))


@dataclass
class HistogramData:
    """A histogram series as Prometheus keeps it: count, sum and per-bucket (non-cumulative) counts."""

    boundaries: tuple[float, ...]
    count: int = 0
    sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=list)  # len(boundaries) + 1; the last is +Inf

    def __post_init__(self) -> None:
        if not self.bucket_counts:
            self.bucket_counts = [0] * (len(self.boundaries) + 1)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        self.bucket_counts[bisect.bisect_left(self.boundaries, value)] += 1  # buckets are "le"

    def merge(self, other: HistogramData) -> None:
        self.count += other.count
        self.sum += other.sum
        self.bucket_counts = [a + b for a, b in zip(self.bucket_counts, other.bucket_counts, strict=True)]


class _MemorySink:
    """Plain Python sums per series; bounded memory (histograms keep buckets, not samples)."""

    def __init__(self, specs: Sequence[MetricSpec]) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.values: dict[str, dict[Labels, float]] = {s.name: {} for s in specs if s.kind != "histogram"}
        self.histograms: dict[str, dict[Labels, HistogramData]] = {
            s.name: {} for s in specs if s.kind == "histogram"
        }
        self.lock = threading.Lock()

    @staticmethod
    def _labels(tags: Mapping[str, str]) -> Labels:
        return tuple(sorted(tags.items()))

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        series = self.values[name]
        labels = self._labels(tags)
        with self.lock:
            series[labels] = series.get(labels, 0) + value

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        series = self.histograms[name]
        labels = self._labels(tags)
        with self.lock:
            if labels not in series:
                series[labels] = HistogramData(self.specs[name].boundaries)
            series[labels].observe(value)

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        with self.lock:
            self.values[name][self._labels(tags)] = value


# --- the engine's metrics -------------------------------------------------------------------------


class EngineMetrics:
    """The engine's Prometheus metrics; one per engine (replica), all series tagged with the model.

    The engine calls :meth:`on_step` after every step, :meth:`on_request_finished` once per
    request and :meth:`set_load` whenever its queues change (or once per step).
    """

    def __init__(self, model_name: str, backend: Literal["ray", "memory"] = "ray") -> None:
        self.model_name = model_name
        self.backend = backend
        self._model_tags = {"model_name": model_name}
        if backend == "ray":
            self._sink: _Sink = _RaySink(METRICS)
        elif backend == "memory":
            self._sink = _MemorySink(METRICS)
        else:
            raise ValueError(f"unknown metrics backend {backend!r}; expected 'ray' or 'memory'")

    # recording ---------------------------------------------------------------------------------

    def _inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        if value > 0:  # Ray counters refuse 0; a zero increment changes nothing anyway
            self._sink.inc(name, value, tags)

    def on_step(self, batch_size: int, outputs: Sequence[StepOutcome]) -> None:
        """Record one engine step: ``outputs`` has one outcome per request the step decoded."""
        model = self._model_tags
        if batch_size > 0:
            self._sink.observe(BATCH_SIZE, float(batch_size), model)
        emitted = 0
        for out in outputs:
            emitted += out.emitted
            if out.proposer is None or out.depth <= 0:
                self._sink.inc(FALLBACKS, 1, {**model, "proposer": NO_PROPOSER})
                continue
            tags = {**model, "proposer": out.proposer}
            self._sink.observe(SPEC_DEPTH, float(out.depth), tags)
            if out.drafted <= 0:
                self._sink.inc(FALLBACKS, 1, tags)
                continue
            self._sink.inc(NUM_DRAFTS, 1, tags)
            self._inc(NUM_DRAFT_TOKENS, out.drafted, tags)
            self._inc(NUM_ACCEPTED_TOKENS, out.accepted, tags)
            for position in range(out.accepted):  # acceptance is a prefix: position j kept iff accepted > j
                self._sink.inc(NUM_ACCEPTED_TOKENS_PER_POS, 1, {**tags, "position": str(position)})
        self._inc(GENERATION_TOKENS, emitted, model)

    def on_prefill(self, tokens: int) -> None:
        """Count the tokens a step's prefills emitted (each request's first token): generated tokens
        too, though no decode step made them (``on_step`` covers the decoding requests)."""
        self._inc(GENERATION_TOKENS, tokens, self._model_tags)

    def on_request_finished(
        self,
        ttft_s: float | None,
        tpot_s: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str | None,
    ) -> None:
        """Record a finished request (any reason, aborts included: ``finish_reason`` tags it).

        Generated tokens are counted step by step in :meth:`on_step`; here ``completion_tokens``
        only feeds the per-request length histogram. ``ttft_s``/``tpot_s`` None (no token, or a
        single one) are not observed.
        """
        model = self._model_tags
        if ttft_s is not None:
            self._sink.observe(TTFT, float(ttft_s), model)
        if tpot_s is not None:
            self._sink.observe(TPOT, float(tpot_s), model)
        self._inc(PROMPT_TOKENS, prompt_tokens, model)
        self._sink.observe(REQUEST_PROMPT_TOKENS, float(prompt_tokens), model)
        self._sink.observe(REQUEST_GENERATION_TOKENS, float(completion_tokens), model)
        self._sink.inc(REQUEST_SUCCESS, 1, {**model, "finish_reason": finish_reason or UNKNOWN_REASON})

    def set_load(self, running: int, queued: int) -> None:
        """Set the gauges of running and waiting requests."""
        self._sink.set(NUM_RUNNING, float(running), self._model_tags)
        self._sink.set(NUM_WAITING, float(queued), self._model_tags)

    # reading back (memory backend) -------------------------------------------------------------

    def _memory(self) -> _MemorySink:
        if not isinstance(self._sink, _MemorySink):
            raise RuntimeError("metrics recorded through Ray are read by scraping Prometheus, not here")
        return self._sink

    def snapshot(self) -> dict[str, dict[Labels, float | HistogramData]]:
        """Every metric's series: ``{name: {labels: value}}``; labels are sorted (tag, value) pairs.

        Counters and gauges map to numbers, histograms to :class:`HistogramData` copies. Memory
        backend only.
        """
        sink = self._memory()
        with sink.lock:
            out: dict[str, dict[Labels, float | HistogramData]] = {
                name: dict(series) for name, series in sink.values.items()
            }
            for name, series in sink.histograms.items():
                out[name] = {
                    labels: HistogramData(h.boundaries, h.count, h.sum, list(h.bucket_counts))
                    for labels, h in series.items()
                }
        return out

    def value(self, name: str, **tags: str) -> float:
        """A counter's or gauge's value summed over the series matching ``tags`` (memory backend)."""
        sink = self._memory()
        if sink.specs[name].kind == "histogram":
            raise TypeError(f"{name} is a histogram; use histogram()")
        with sink.lock:
            return sum(v for labels, v in sink.values[name].items() if _matches(labels, tags))

    def histogram(self, name: str, **tags: str) -> HistogramData:
        """A histogram merged over the series matching ``tags`` (memory backend)."""
        sink = self._memory()
        spec = sink.specs[name]
        if spec.kind != "histogram":
            raise TypeError(f"{name} is a {spec.kind}; use value()")
        merged = HistogramData(spec.boundaries)
        with sink.lock:
            for labels, data in sink.histograms[name].items():
                if _matches(labels, tags):
                    merged.merge(data)
        return merged


def _matches(labels: Labels, tags: Mapping[str, str]) -> bool:
    present = dict(labels)
    return all(present.get(key) == value for key, value in tags.items())
