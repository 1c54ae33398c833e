"""The engine's metrics, recorded by its loop thread: Ray's metrics API in a replica, or memory.

What each metric means, its labels and buckets live in ``serve_app.observability.metric_names``
(vLLM's names under ``specserve:``); this module records them. Two backends sit behind one small
interface: ``"ray"`` records through ``ray.util.metrics`` (inside a Ray worker, e.g. a Serve
replica; Ray's exporter shows them as ``ray_specserve_*``, and ``GET /metrics`` on the API port
re-exposes them under our names); ``"memory"`` keeps plain Python sums, for tests and for running
outside Ray, read back with :meth:`EngineMetrics.snapshot`, :meth:`EngineMetrics.value` and
:meth:`EngineMetrics.histogram`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from serve_app.observability.metric_names import (
    BATCH_SIZE,
    DECODE_TIME,
    E2E,
    EXACT_MODE,
    FALLBACKS,
    GENERATION_TOKENS,
    INFERENCE_TIME,
    ITL,
    KV_CACHE_USAGE,
    METRICS,
    NO_PROPOSER,
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    NUM_RUNNING,
    NUM_TREE_ALTERNATIVES,
    NUM_TREE_DRAFTS,
    NUM_WAITING,
    PREFILL_TIME,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUEST_GENERATION_TOKENS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_SUCCESS,
    REQUESTS_REFUSED,
    SPEC_DEPTH,
    TPOT,
    TTFT,
    UNKNOWN_REASON,
    MetricSpec,
    ray_name,
)

Labels = tuple[tuple[str, str], ...]  # sorted (tag, value) pairs: one series of a metric


@dataclass(frozen=True)
class RequestTimings:
    """One finished request's latencies in seconds (None where the request never got that far).

    ``queue``: arrival at the replica to its KV slot; ``prefill``: slot to first token; ``decode``:
    first token to last; ``inference``: slot to last; ``e2e``: arrival to finish; ``ttft``: arrival
    to first token; ``tpot``: ``decode`` over the tokens after the first.
    """

    e2e: float
    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    inference: float | None = None
    ttft: float | None = None
    tpot: float | None = None


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
    alternatives: int = 0  # of ``drafted``, a token tree's alternatives beside its chain

    @classmethod
    def of(cls, output: Any) -> StepOutcome:
        """From a ``RequestOutput`` of the step."""
        drafted = output.step_drafted
        return cls(output.step_proposer, drafted, drafted, output.step_accepted, len(output.new_token_ids),
                   output.step_alternatives)  # fmt: skip


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
            name = ray_name(spec.name)
            if spec.kind == "counter":
                metric = ray_metrics.Counter(name, spec.description, spec.tag_keys)
            elif spec.kind == "gauge":
                metric = ray_metrics.Gauge(name, spec.description, spec.tag_keys)
            else:
                metric = ray_metrics.Histogram(name, spec.description, list(spec.boundaries), spec.tag_keys)
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
    """The engine's Prometheus metrics; one per engine (replica).

    Every series is tagged with the model and the replica; speculation series also with the policy.
    The replica's loop thread calls :meth:`on_step` after every step for the requests it decoded,
    :meth:`on_first_token` when a request's prefill made its first token, :meth:`on_tokens` when a
    later step gave a request tokens, :meth:`on_request_finished` once per request,
    :meth:`on_refused` for a request it refused, and :meth:`set_load` whenever its queues change.
    """

    def __init__(
        self,
        model_name: str,
        backend: Literal["ray", "memory"] = "ray",
        *,
        replica: str = "0",
        policy: str = NO_PROPOSER,
    ) -> None:
        self.model_name = model_name
        self.backend = backend
        self._model_tags = {"model_name": model_name, "replica": replica}
        self._exact: float | None = None  # re-set with the load: Ray evicts gauges not set again
        self._spec_tags = {**self._model_tags, "policy": policy}
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

    def _observe(self, name: str, value: float | None) -> None:
        if value is not None:
            self._sink.observe(name, float(value), self._model_tags)

    def set_policy(self, policy: str) -> None:
        """The policy label of the speculation series (known once the engine is built)."""
        self._spec_tags = {**self._model_tags, "policy": policy}

    def on_step(self, batch_size: int, outputs: Sequence[StepOutcome]) -> None:
        """Record one engine step: ``outputs`` has one outcome per request the step decoded."""
        if batch_size > 0:
            self._sink.observe(BATCH_SIZE, float(batch_size), self._model_tags)
        emitted = 0
        for out in outputs:
            emitted += out.emitted
            if out.proposer is None or out.depth <= 0:
                self._sink.inc(FALLBACKS, 1, {**self._spec_tags, "proposer": NO_PROPOSER})
                continue
            tags = {**self._spec_tags, "proposer": out.proposer}
            self._sink.observe(SPEC_DEPTH, float(out.depth), tags)
            if out.drafted <= 0:
                self._sink.inc(FALLBACKS, 1, tags)
                continue
            self._sink.inc(NUM_DRAFTS, 1, tags)
            self._inc(NUM_DRAFT_TOKENS, out.drafted, tags)
            self._inc(NUM_ACCEPTED_TOKENS, out.accepted, tags)
            if out.alternatives > 0:
                self._sink.inc(NUM_TREE_DRAFTS, 1, tags)
                self._inc(NUM_TREE_ALTERNATIVES, out.alternatives, tags)
            for position in range(out.accepted):  # acceptance is a prefix: position j kept iff accepted > j
                self._sink.inc(NUM_ACCEPTED_TOKENS_PER_POS, 1, {**tags, "position": str(position)})
        self._inc(GENERATION_TOKENS, emitted, self._model_tags)

    def on_first_token(self, ttft_s: float, tokens: int) -> None:
        """A request's prefill made its first ``tokens`` (1) tokens ``ttft_s`` after it arrived:
        time to first token, recorded now, and generated tokens no decode step made."""
        self._observe(TTFT, ttft_s)
        self._inc(GENERATION_TOKENS, tokens, self._model_tags)

    def on_tokens(self, gap_s: float, tokens: int) -> None:
        """A step gave a request ``tokens`` tokens ``gap_s`` after its previous ones: ``tokens``
        inter-token samples of ``gap_s / tokens`` (a speculative step's tokens share its gap)."""
        if tokens > 0:
            per_token = gap_s / tokens
            for _ in range(tokens):
                self._sink.observe(ITL, per_token, self._model_tags)

    def on_request_finished(
        self, timings: RequestTimings, prompt_tokens: int, completion_tokens: int, finished_reason: str | None
    ) -> None:
        """Record a finished request (any reason, aborts included: ``finished_reason`` tags it).

        Generated tokens and TTFT were counted as they happened (:meth:`on_step`,
        :meth:`on_first_token`); here go the per-request histograms and counters.
        """
        self._observe(E2E, timings.e2e)
        self._observe(QUEUE_TIME, timings.queue)
        self._observe(PREFILL_TIME, timings.prefill)
        self._observe(DECODE_TIME, timings.decode)
        self._observe(INFERENCE_TIME, timings.inference)
        self._observe(TPOT, timings.tpot)
        self._inc(PROMPT_TOKENS, prompt_tokens, self._model_tags)
        self._observe(REQUEST_PROMPT_TOKENS, prompt_tokens)
        self._observe(REQUEST_GENERATION_TOKENS, completion_tokens)
        reason = finished_reason or UNKNOWN_REASON
        self._sink.inc(REQUEST_SUCCESS, 1, {**self._model_tags, "finished_reason": reason})

    def on_refused(self, reason: str) -> None:
        """A request refused with 503 (``metric_names.ENGINE_QUEUE_FULL`` / ``SERVE_QUEUE_FULL``)."""
        self._sink.inc(REQUESTS_REFUSED, 1, {**self._model_tags, "reason": reason})

    def set_load(self, running: int, queued: int, kv_cache_usage: float = 0.0) -> None:
        """Set the gauges of running and waiting requests and of the KV cache's usage (0..1), and
        the exact-mode gauge again (Ray 2.60 evicts a gauge that is not set for a few seconds, so the
        replica's loop calls this at least every second, idle or not)."""
        self._sink.set(NUM_RUNNING, float(running), self._model_tags)
        self._sink.set(NUM_WAITING, float(queued), self._model_tags)
        self._sink.set(KV_CACHE_USAGE, float(kv_cache_usage), self._model_tags)
        if self._exact is not None:
            self._sink.set(EXACT_MODE, self._exact, self._model_tags)

    def set_exact(self, exact: bool) -> None:
        """Set the exact-mode gauge: 1 when speculative output is bit-identical to plain decoding."""
        self._exact = 1.0 if exact else 0.0
        self._sink.set(EXACT_MODE, self._exact, self._model_tags)

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
