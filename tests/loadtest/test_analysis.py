"""Cell figures, cost, server counters and the report, from synthetic records (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.analysis import (
    GENERATION_TOKENS,
    CellResult,
    ServerCounters,
    cell_result,
    compare_to_plain,
    percentile,
    read_records,
    saturated,
)
from loadtest.cluster import ReplicaSampler, counter_delta, integrate_samples, parse_prometheus
from loadtest.report import write_report
from loadtest.streaming import RequestRecord

EXPOSITION = """\
# HELP ray_specserve_generation_tokens_total Tokens generated.
# TYPE ray_specserve_generation_tokens_total counter
ray_specserve_generation_tokens_total{Component="core_worker",WorkerId="a",model_name="m"} 100.0
ray_specserve_generation_tokens_total{Component="core_worker",WorkerId="b",model_name="m"} 40.0
ray_specserve_spec_decode_num_draft_tokens_total{WorkerId="b",model_name="m",proposer="draft"} 12.0
ray_serve_num_http_requests_total{route="/"} 3.0
ray_specserve_time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 2.0
"""


def test_prometheus_text_and_counter_deltas() -> None:
    before = parse_prometheus(EXPOSITION)
    assert len(before) == 4  # only ray_specserve_* samples
    after = dict(before)
    gone = next(k for k in before if 'WorkerId="a"' in k[1])
    del after[gone]  # an earlier cell's replica is gone: ignored
    after[(GENERATION_TOKENS, '{WorkerId="b",model_name="m"}')] = 0  # unrelated label string
    after[(GENERATION_TOKENS, '{Component="core_worker",WorkerId="b",model_name="m"}')] = 55.0
    after[(GENERATION_TOKENS, '{WorkerId="c",model_name="m"}')] = 7.0  # a new replica counts from 0
    assert counter_delta(before, after, GENERATION_TOKENS) == 15.0 + 7.0


def test_replica_seconds_integrate_the_samples() -> None:
    samples = [(10.0, 1), (12.0, 2), (15.0, 1)]
    assert integrate_samples(samples, 10.0, 20.0) == 2 * 1 + 3 * 2 + 5 * 1
    assert integrate_samples(samples, 11.0, 13.0) == 1 + 2
    assert integrate_samples(samples, 5.0, 10.0) == 5.0  # the first sample holds before it
    assert integrate_samples([], 0.0, 1.0) == 0.0 and integrate_samples(samples, 3.0, 3.0) == 0.0


def test_sampler_rates_over_the_load_phase() -> None:
    sampler = ReplicaSampler("app")
    sampler.tokens = [(100.0 + t, 10.0 * t) for t in range(0, 30)]  # 10 tokens/s
    sampler.tokens += [(130.0 + t, 290.0 + t) for t in range(0, 20)]  # the drain: 1 token/s
    assert sampler.tokens_per_s(100.0, 129.0) == pytest.approx(10.0)
    assert sampler.tokens_per_s(500.0, 600.0) is None


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 95) == 95


def records(
    workload: str,
    n: int,
    tokens: int,
    latency: float,
    drafted: int = 0,
    accepted: int = 0,
    start: float = 1000.0,
) -> list[RequestRecord]:
    return [
        RequestRecord(
            workload,
            i,
            start + i,
            latency_s=latency,
            ttft_s=latency / 10,
            tpot_s=latency / tokens,
            output_tokens=tokens,
            finish_reason="length",
            status=200,
            drafted=drafted,
            accepted=accepted,
        )
        for i in range(n)
    ]


def test_cell_figures_and_cost() -> None:
    rows = records("code", 10, 100, 10.0, drafted=40, accepted=30) + records("bulk", 5, 20, 2.0, start=1005.0)
    rows.append(RequestRecord("bulk", 9, 1001.0, latency_s=0.02, status=503, error="HTTP 503: overloaded"))
    rows.append(RequestRecord("bulk", 8, 1002.0, latency_s=1.0, status=500, error="HTTP 500: boom"))
    server = ServerCounters(generation_tokens=1100, draft_tokens=400, accepted_tokens=300, requests=15)
    cell = cell_result("static", 4, "mixed", rows, server, replica_seconds=38.0, replica_hour_price=0.36)
    assert (cell.requests, cell.failures, cell.refused) == (17, 1, 1)  # an overload refusal is no failure
    assert cell.refusal_latency_s["p50"] == pytest.approx(0.02)
    assert cell.window_s == pytest.approx(1019.0 - 1000.0)
    assert cell.output_tokens == 1100 and cell.tokens_per_s == pytest.approx(1100 / 19)
    assert cell.latency_s["p50"] == 10.0 and cell.ttft_s["p99"] == pytest.approx(1.0)
    assert cell.acceptance == pytest.approx(0.75) and cell.server_acceptance == pytest.approx(0.75)
    assert cell.token_mismatch == 0
    assert cell.cost_per_1m_tokens == pytest.approx(38 / 3600 * 0.36 / 1100 * 1e6)
    assert cell.per_workload["code"]["acceptance"] == pytest.approx(0.75)
    assert cell.per_workload["bulk"]["failures"] == 1 and cell.per_workload["bulk"]["refused"] == 1
    assert cell.errors == ["HTTP 500: boom"]
    empty = cell_result("plain", 1, "mixed", [], ServerCounters(), 0.0, 0.36)
    assert empty.errors and empty.cost_per_1m_tokens is None


def test_savings_and_saturation_against_plain() -> None:
    cells = [
        CellResult("plain", 1, "m", tokens_per_s=10.0, cost_per_1m_tokens=4.0),
        CellResult("static", 1, "m", tokens_per_s=20.0, cost_per_1m_tokens=2.0),
        CellResult("static", 4, "m", tokens_per_s=20.5, cost_per_1m_tokens=1.9),
    ]
    compare_to_plain(cells)
    assert cells[1].savings_vs_plain == pytest.approx(0.5) and cells[1].speedup_vs_plain == pytest.approx(2.0)
    assert cells[2].savings_vs_plain is None  # no plain cell at 4 users
    assert saturated(cells, "static", "m") and not saturated(cells, "plain", "m")
    assert CellResult.from_dict(json.loads(json.dumps(cells[1].to_dict()))) == cells[1]


def test_report_has_tables_and_plots(tmp_path: Path) -> None:
    results, recs = [], {}
    for policy, tps_scale in (("plain", 1.0), ("static", 2.0)):
        for users in (1, 4):
            rows = records("code", 6, 50, 5.0 / tps_scale, drafted=10, accepted=8) + records(
                "chat", 3, 80, 8.0
            )
            cell = cell_result(
                policy, users, "mixed", rows, ServerCounters(generation_tokens=540), 20.0, 0.15
            )
            results.append(cell)
            recs[(policy, users, "mixed")] = rows
    compare_to_plain(results)
    (tmp_path / "records.jsonl").write_text(
        "\n".join(r.to_json() for r in recs[("plain", 1, "mixed")]) + "\n"
    )
    assert len(read_records(tmp_path / "records.jsonl")) == 9
    meta = {"started": "2026-01-01T00-00-00Z", "command": "specserve loadtest", "price": 0.15, "wall_s": 60}
    report = write_report(tmp_path, results, recs, meta).read_text()
    assert "## Mix `mixed`" in report and "| static | 4 |" in report and "## Counter check" in report
    for name in ("throughput_mixed.png", "cost_mixed.png", "latency_cdf_mixed.png"):
        assert (tmp_path / name).stat().st_size > 1000
        assert f"![{name}]({name})" in report


def test_the_report_shows_refusals_and_how_fast_they_came(tmp_path: Path) -> None:
    rows = records("code", 4, 50, 5.0)
    rows += [RequestRecord("code", 9, 1001.0 + i, latency_s=0.01 * (i + 1), status=503, error="HTTP 503: x")
             for i in range(3)]  # fmt: skip
    cell = cell_result("plain", 32, "mixed", rows, ServerCounters(generation_tokens=200), 10.0, 0.15)
    report = write_report(tmp_path, [cell], {("plain", 32, "mixed"): rows}, {"price": 0.15}).read_text()
    assert "| plain | 32 | 7 (0, 3) |" in report
    assert "| plain | 32 | 3 | 20 / 29 / 30 |" in report  # refusal latency p50 / p95 / p99 in ms
