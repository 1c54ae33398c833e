"""The /metrics relay: Ray's exposition of our series, renamed, cut to our labels, summed, typed."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from serve_app.observability.metric_names import GENERATION_TOKENS, METRICS_BY_NAME, TTFT
from serve_app.observability.prometheus_relay import PrometheusRelay, relay_samples, render
from tests.serve.conftest import free_port

RAY_LABELS = 'Component="core_worker",NodeAddress="10.0.0.{node}",SessionName="s",WorkerId="w{node}"'


def ray_text(node: int, tokens: float, replica: str) -> str:
    """An exposition as Ray 2.60's exporter writes it for one node (labels as Ray adds them)."""
    tags = f'{RAY_LABELS.format(node=node)},model_name="m",replica="{replica}"'
    return f"""# HELP ray_specserve_generation_tokens_total Tokens generated.
# TYPE ray_specserve_generation_tokens_total counter
ray_specserve_generation_tokens_total{{{tags}}} {tokens}
# HELP ray_specserve_time_to_first_token_seconds Time to first token.
# TYPE ray_specserve_time_to_first_token_seconds histogram
ray_specserve_time_to_first_token_seconds_bucket{{{tags},le="0.1"}} 1.0
ray_specserve_time_to_first_token_seconds_bucket{{{tags},le="+Inf"}} 3.0
ray_specserve_time_to_first_token_seconds_bucket{{{tags},le="0.05"}} 0.0
ray_specserve_time_to_first_token_seconds_sum{{{tags}}} 1.25
ray_specserve_time_to_first_token_seconds_count{{{tags}}} 3.0
# HELP ray_serve_num_router_requests_total Ray Serve's own.
# TYPE ray_serve_num_router_requests_total counter
ray_serve_num_router_requests_total{{{RAY_LABELS.format(node=node)}}} 7.0
"""


def test_series_are_renamed_cut_to_our_labels_and_summed() -> None:
    samples = relay_samples([ray_text(1, 10.0, "a"), ray_text(2, 5.0, "b"), ray_text(3, 1.0, "a")])
    tokens = samples[GENERATION_TOKENS]
    assert tokens == {
        (
            GENERATION_TOKENS + "_total",
            (("model_name", "m"), ("replica", "a")),
        ): 11.0,  # two workers, one replica
        (GENERATION_TOKENS + "_total", (("model_name", "m"), ("replica", "b"))): 5.0,
    }
    assert set(samples) == {GENERATION_TOKENS, TTFT}  # Ray Serve's own series are not ours


def test_rendered_text_parses_with_types_help_and_ordered_buckets() -> None:
    text = render(relay_samples([ray_text(1, 10.0, "a"), ray_text(2, 5.0, "a")])).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {GENERATION_TOKENS, TTFT}
    assert families[GENERATION_TOKENS].type == "counter"
    assert families[GENERATION_TOKENS].documentation == METRICS_BY_NAME[GENERATION_TOKENS].description
    (total,) = families[GENERATION_TOKENS].samples
    assert total.name == GENERATION_TOKENS + "_total" and total.value == 15.0
    assert total.labels == {"model_name": "m", "replica": "a"}
    ttft = families[TTFT]
    assert ttft.type == "histogram"
    buckets = [s for s in ttft.samples if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets] == ["0.05", "0.1", "+Inf"]  # Prometheus' order
    assert [s.value for s in buckets] == [0.0, 2.0, 6.0]
    assert {s.name: s.value for s in ttft.samples if not s.name.endswith("_bucket")} == {
        TTFT + "_sum": 2.5,
        TTFT + "_count": 6.0,
    }
    assert "ray_" not in text and "WorkerId" not in text


def test_a_node_that_does_not_answer_is_left_out() -> None:
    dead = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    relay = PrometheusRelay(lambda: [dead], timeout_s=2.0)
    assert asyncio.run(relay.scrape()) == b""
