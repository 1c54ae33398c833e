"""The engine's Prometheus metrics, declared once: names, types, labels and buckets.

Names follow vLLM's (``vllm:num_requests_running`` -> ``specserve:num_requests_running``), so a
vLLM dashboard or alert ports by changing the prefix. They are given here as declared; the
exposition adds Prometheus' suffixes: ``_total`` to a counter, ``_bucket`` / ``_sum`` / ``_count``
to a histogram. Two places export them:

- ``GET /metrics`` on the API port (the ingress re-exposes every node's series under these names:
  ``serve_app.observability.prometheus_relay``);
- Ray's own exporter on each node (``metrics_export_port``, 8080 on KubeRay pods). Ray's metrics
  pipeline drops names with a colon, so a replica records ``specserve_<name>`` (:func:`ray_name`)
  and Ray exports it with its own prefix: ``ray_specserve_generation_tokens_total``.

Every series carries ``model_name`` and ``replica`` (the engine replica that recorded it: vLLM's
``engine`` label); speculation series also carry ``proposer`` and ``policy``.

Serving (as vLLM):

- gauges ``num_requests_running`` (holding a KV slot), ``num_requests_waiting`` (queued for one),
  ``kv_cache_usage_perc`` (KV rows held / rows allocated, 0..1);
- counters ``prompt_tokens``, ``generation_tokens`` (every token emitted, the first included),
  ``request_success`` (``finished_reason``: stop, length, abort, error, timeout), and ours,
  ``requests_refused`` (``reason``: ``engine_queue_full`` when a replica's waiting queue is full,
  ``serve_queue_full`` when Serve's queue in front of the replicas is; both answer 503);
- histograms ``time_to_first_token_seconds`` (recorded when the first token is made),
  ``inter_token_latency_seconds`` (recorded as tokens are made: a step that gives a request ``n``
  tokens ``g`` seconds after its previous ones records ``g / n`` ``n`` times, so the sum is the
  decode time and the count the tokens after the first, speculating or not),
  ``request_time_per_output_token_seconds`` (per finished request, its mean),
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds`` (arrival at the replica to a KV
  slot), ``request_prefill_time_seconds`` (slot to first token), ``request_decode_time_seconds``
  (first token to last), ``request_inference_time_seconds`` (slot to last token),
  ``request_prompt_tokens``, ``request_generation_tokens``.

Speculation (vLLM's family, labels ``proposer`` and ``policy``):

- ``spec_decode_num_drafts``: request-steps that verified a non-empty draft;
- ``spec_decode_num_draft_tokens`` / ``spec_decode_num_accepted_tokens``: draft tokens verified /
  accepted; ``spec_decode_num_accepted_tokens_per_pos`` (``position``, 0-based; acceptance is a
  prefix, so position j counts the drafts that kept more than j tokens);
- ours: ``spec_decode_fallbacks`` (request-steps decoded plain: no proposer or depth 0 is
  ``proposer="none"``; an empty draft carries the proposer's name), ``spec_decode_num_tree_drafts``
  / ``spec_decode_num_tree_alternatives`` (request-steps that verified a token tree; the
  alternatives they verified beside their chains, counted in ``num_draft_tokens`` too),
  ``spec_decode_depth``
  (histogram: depth chosen per speculative request-step), ``batch_size`` (histogram: requests
  decoded per step), ``exact_mode`` (gauge: 1 when every product runs row-invariant, i.e.
  speculative output is bit-identical to plain decoding).

Acceptance rate is ``accepted_tokens / draft_tokens``; mean accepted length is
``(accepted_tokens + num_drafts) / num_drafts``; per-position acceptance is
``accepted_tokens_per_pos{position=j} / num_drafts`` (for a fixed depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "histogram", "gauge"]

PREFIX = "specserve:"
RAY_PREFIX = "ray_specserve_"  # how Ray's exporter shows our names (see ray_name)
ENGINE_QUEUE_FULL = "engine_queue_full"  # requests_refused reasons
SERVE_QUEUE_FULL = "serve_queue_full"
NO_PROPOSER = "none"  # the proposer label of plain decoding
UNKNOWN_REASON = "unknown"  # the finished_reason label when none was given

# Bucket upper bounds (Ray requires them positive; Prometheus adds +Inf).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip
DEPTH_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
TOKEN_COUNT_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
)  # fmt: skip

ENGINE_LABELS = ("model_name", "replica")
SPEC_LABELS = ("model_name", "replica", "proposer", "policy")


@dataclass(frozen=True)
class MetricSpec:
    """One metric as declared once and created once per backend."""

    name: str
    kind: Kind
    description: str
    tag_keys: tuple[str, ...] = ENGINE_LABELS
    boundaries: tuple[float, ...] = ()

    def exported_names(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric (without Ray's ``ray_`` prefix)."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return tuple(f"{self.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        return (self.name,)


NUM_RUNNING = PREFIX + "num_requests_running"
NUM_WAITING = PREFIX + "num_requests_waiting"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
EXACT_MODE = PREFIX + "exact_mode"
PROMPT_TOKENS = PREFIX + "prompt_tokens"
GENERATION_TOKENS = PREFIX + "generation_tokens"
REQUEST_SUCCESS = PREFIX + "request_success"
REQUESTS_REFUSED = PREFIX + "requests_refused"
TTFT = PREFIX + "time_to_first_token_seconds"
ITL = PREFIX + "inter_token_latency_seconds"
TPOT = PREFIX + "request_time_per_output_token_seconds"
E2E = PREFIX + "e2e_request_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
PREFILL_TIME = PREFIX + "request_prefill_time_seconds"
DECODE_TIME = PREFIX + "request_decode_time_seconds"
INFERENCE_TIME = PREFIX + "request_inference_time_seconds"
REQUEST_PROMPT_TOKENS = PREFIX + "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = PREFIX + "request_generation_tokens"
NUM_DRAFTS = PREFIX + "spec_decode_num_drafts"
NUM_DRAFT_TOKENS = PREFIX + "spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = PREFIX + "spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos"
NUM_TREE_DRAFTS = PREFIX + "spec_decode_num_tree_drafts"
NUM_TREE_ALTERNATIVES = PREFIX + "spec_decode_num_tree_alternatives"
FALLBACKS = PREFIX + "spec_decode_fallbacks"
SPEC_DEPTH = PREFIX + "spec_decode_depth"
BATCH_SIZE = PREFIX + "batch_size"


def _latency(name: str, description: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> MetricSpec:
    return MetricSpec(name, "histogram", description, ENGINE_LABELS, buckets)


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(NUM_RUNNING, "gauge", "Requests running (holding a KV slot)."),
    MetricSpec(NUM_WAITING, "gauge", "Requests waiting for a KV slot."),
    MetricSpec(KV_CACHE_USAGE, "gauge", "KV-cache usage: rows held / rows allocated (1 = full)."),
    MetricSpec(EXACT_MODE, "gauge", "1 when speculative output is bit-identical to plain decoding."),
    MetricSpec(PROMPT_TOKENS, "counter", "Prompt tokens of finished requests."),
    MetricSpec(GENERATION_TOKENS, "counter", "Tokens generated (emitted to clients)."),
    MetricSpec(
        REQUEST_SUCCESS,
        "counter",
        "Finished requests by finished reason.",
        (*ENGINE_LABELS, "finished_reason"),
    ),
    MetricSpec(
        REQUESTS_REFUSED, "counter", "Requests refused with 503 (overload).", (*ENGINE_LABELS, "reason")
    ),
    _latency(TTFT, "Time to first token in seconds (arrival at the replica to the first token)."),
    _latency(
        ITL, "Inter-token latency in seconds, one sample per token after the first.", TOKEN_LATENCY_BUCKETS
    ),
    _latency(TPOT, "Mean time per output token of a finished request, in seconds.", TOKEN_LATENCY_BUCKETS),
    _latency(E2E, "End-to-end request latency in the replica, in seconds."),
    _latency(QUEUE_TIME, "Time a request waited for a KV slot, in seconds."),
    _latency(PREFILL_TIME, "Time from a KV slot to the first token, in seconds."),
    _latency(DECODE_TIME, "Time from the first token to the last, in seconds."),
    _latency(INFERENCE_TIME, "Time from a KV slot to the last token, in seconds."),
    MetricSpec(
        REQUEST_PROMPT_TOKENS, "histogram", "Prompt tokens per request.", ENGINE_LABELS, TOKEN_COUNT_BUCKETS
    ),
    MetricSpec(
        REQUEST_GENERATION_TOKENS,
        "histogram",
        "Generated tokens per request.",
        ENGINE_LABELS,
        TOKEN_COUNT_BUCKETS,
    ),
    MetricSpec(NUM_DRAFTS, "counter", "Request-steps that verified a non-empty draft.", SPEC_LABELS),
    MetricSpec(NUM_DRAFT_TOKENS, "counter", "Draft tokens verified by the target.", SPEC_LABELS),
    MetricSpec(NUM_ACCEPTED_TOKENS, "counter", "Draft tokens accepted by the target.", SPEC_LABELS),
    MetricSpec(NUM_TREE_DRAFTS, "counter", "Request-steps that verified a token tree.", SPEC_LABELS),
    MetricSpec(
        NUM_TREE_ALTERNATIVES, "counter", "Tree alternatives verified beside the drafts' chains.", SPEC_LABELS
    ),
    MetricSpec(
        NUM_ACCEPTED_TOKENS_PER_POS,
        "counter",
        "Draft tokens accepted at each draft position (0-based).",
        (*SPEC_LABELS, "position"),
    ),
    MetricSpec(
        FALLBACKS,
        "counter",
        "Request-steps decoded plain: no proposer or depth 0 (proposer=none), or an empty draft.",
        SPEC_LABELS,
    ),
    MetricSpec(
        SPEC_DEPTH,
        "histogram",
        "Speculation depth chosen per speculative request-step.",
        SPEC_LABELS,
        DEPTH_BUCKETS,
    ),
    MetricSpec(
        BATCH_SIZE, "histogram", "Requests decoded per engine step.", ENGINE_LABELS, BATCH_SIZE_BUCKETS
    ),
)

METRICS_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def ray_name(name: str) -> str:
    """The name a metric is recorded under in Ray (``specserve:x`` -> ``specserve_x``): Ray 2.60's
    OpenTelemetry pipeline silently drops instruments whose name has a colon."""
    return name.replace(":", "_", 1)


def from_ray_name(sample: str) -> str | None:
    """Our name of a sample Ray exported (``ray_specserve_x_total`` -> ``specserve:x_total``), or None
    when the sample is not ours."""
    if not sample.startswith(RAY_PREFIX):
        return None
    return PREFIX + sample[len(RAY_PREFIX) :]


def exported_sample_names() -> frozenset[str]:
    """Every sample name ``GET /metrics`` can show (a dashboard or alert may reference only these)."""
    return frozenset(name for spec in METRICS for name in spec.exported_names())
