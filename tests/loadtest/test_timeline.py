"""The speculation panels over time, from synthetic Ray expositions (no server, no Ray).

The expositions are spelled as Ray's exporter shows the engine's series (``ray_specserve_*``, Ray's
own labels beside ``model_name``, ``replica``, ``proposer``, ``policy``, ``position``), so a renamed
metric or label breaks these tests rather than silently emptying the report's plots.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from loadtest.analysis import CellResult
from loadtest.cluster import LocalCluster, ReplicaSampler, parse_prometheus
from loadtest.report import write_report
from loadtest.speculation_plots import plot_file
from loadtest.timeline import SpeculationTimeline, series_key, speculation_rates

ROOT = Path(__file__).resolve().parents[2]
DRAFT, NGRAM, NONE = "draft", "ngram", "none"  # proposer label values


def tags(replica: str, proposer: str | None = None, **extra: str) -> str:
    """A series' labels as Ray shows them: Ray's bookkeeping, then ours."""
    labels = {"Component": "core_worker", "SessionName": "s", "WorkerId": f"w-{replica}"}
    labels |= {"model_name": "m", "replica": replica}
    if proposer is not None:
        labels |= {"proposer": proposer, "policy": "adaptive"}
    labels |= extra
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def replica_text(replica: str, proposer: str, step: float, *, fallbacks: float = 0.0) -> str:
    """One replica's exposition after ``step`` units of a steady load: per unit, 10 drafts of depth 4
    (40 draft tokens), 20 accepted (8 / 6 / 4 / 2 at positions 0..3), 6 decode steps of 12 requests
    in all, 60 tokens generated, and ``fallbacks`` plain request-steps (proposer none)."""
    lines = [
        "# TYPE ray_specserve_spec_decode_num_drafts_total counter",
        f"ray_specserve_spec_decode_num_drafts_total{tags(replica, proposer)} {10 * step}",
        f"ray_specserve_spec_decode_num_draft_tokens_total{tags(replica, proposer)} {40 * step}",
        f"ray_specserve_spec_decode_num_accepted_tokens_total{tags(replica, proposer)} {20 * step}",
        f"ray_specserve_spec_decode_fallbacks_total{tags(replica, NONE)} {fallbacks * step}",
        f"ray_specserve_spec_decode_depth_sum{tags(replica, proposer)} {40 * step}",
        f"ray_specserve_spec_decode_depth_count{tags(replica, proposer)} {10 * step}",
        f"ray_specserve_spec_decode_depth_bucket{tags(replica, proposer, le='4.0')} {10 * step}",
        f"ray_specserve_batch_size_sum{tags(replica)} {12 * step}",
        f"ray_specserve_batch_size_count{tags(replica)} {6 * step}",
        f"ray_specserve_generation_tokens_total{tags(replica)} {60 * step}",
        f"ray_specserve_num_requests_running{tags(replica)} 3.0",
        'ray_serve_num_http_requests_total{route="/"} 9.0',
    ]
    for position, kept in enumerate((8, 6, 4, 2)):
        labels = tags(replica, proposer, position=str(position))
        lines.append(f"ray_specserve_spec_decode_num_accepted_tokens_per_pos_total{labels} {kept * step}")
    return "\n".join(lines) + "\n"


def scrape(*texts: str) -> dict[tuple[str, str], float]:
    return parse_prometheus("".join(texts))


def test_series_keys_follow_the_catalogue_names() -> None:
    assert series_key("ray_specserve_spec_decode_num_drafts_total", tags("a", DRAFT)) == "drafts|draft|"
    key = series_key(
        "ray_specserve_spec_decode_num_accepted_tokens_per_pos_total", tags("a", DRAFT, position="2")
    )
    assert key == "accepted_at|draft|2"
    assert series_key("ray_specserve_generation_tokens_total", tags("a")) == "generated||"
    assert series_key("ray_specserve_spec_decode_depth_bucket", tags("a", DRAFT, le="4.0")) is None
    assert series_key("ray_specserve_num_requests_running", tags("a")) is None
    assert series_key("specserve_spec_decode_num_drafts_total", tags("a", DRAFT)) is None  # not Ray's name


def test_rates_over_a_sliding_window_per_proposer() -> None:
    timeline = SpeculationTimeline()
    # The baseline carries the warm-up's counts (step 5 on replica a): none of it is plotted.
    for t in range(11):
        texts = [replica_text("a", DRAFT, 5 + t, fallbacks=3.0)]
        if t >= 4:  # replica b starts at t=4 with another proposer: it counts from 0
            texts.append(replica_text("b", NGRAM, 2 * (t - 3)))
        timeline.observe(1000.0 + t, scrape(*texts), replicas=1 if t < 4 else 2)
    assert timeline.points[0].totals["accepted|draft|"] == 0
    assert timeline.points[-1].totals["accepted|draft|"] == 20 * 10
    assert timeline.points[-1].totals["accepted|ngram|"] == 20 * 14  # from 0 at its first value (2 units)

    rates = speculation_rates(timeline, window_s=5.0)
    assert rates.t == [float(t) for t in range(1, 11)]
    assert rates.replicas == [1, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert set(rates.acceptance) == {DRAFT, NGRAM}  # "none" never drafted: no acceptance line
    assert rates.acceptance[DRAFT] == [pytest.approx(0.5)] * 10
    assert rates.acceptance[NGRAM][:3] == [None, None, None]  # no ngram drafts in those windows
    assert rates.acceptance[NGRAM][-1] == pytest.approx(0.5)
    assert rates.acceptance_by_position[(DRAFT, 0)][-1] == pytest.approx(0.8)
    assert rates.acceptance_by_position[(DRAFT, 3)][-1] == pytest.approx(0.2)
    assert rates.mean_accepted_length[DRAFT][-1] == pytest.approx((20 + 10) / 10)
    assert rates.mean_depth[DRAFT][-1] == pytest.approx(4.0)
    assert rates.mean_batch_size[-1] == pytest.approx(2.0)
    assert rates.tokens_saved_per_s[DRAFT] == [pytest.approx(20.0)] * 10
    # At t=10 the window is t=5..10, where b grew 2 units a second: 40 accepted tokens/s.
    assert rates.tokens_saved_per_s[NGRAM][-1] == pytest.approx(40.0)
    # At t=4 (window t=0..4), b's first 2 units land in 4 s: a new series counts from 0, not skipped.
    assert rates.tokens_saved_per_s[NGRAM][3] == pytest.approx(20 * 2 / 4)
    assert rates.fallbacks_per_s == {NONE: [pytest.approx(3.0)] * 10}
    assert rates.fallback_share[0] == pytest.approx(3 / (3 + 10))
    assert rates.generated_tokens_per_s[0] == pytest.approx(60.0)
    assert rates.generated_tokens_per_s[-1] == pytest.approx(60.0 + 120.0)


@pytest.mark.parametrize("same_labels", [True, False], ids=["restarted-in-place", "replica-replaced"])
def test_a_restarted_counter_never_goes_backwards(same_labels: bool) -> None:
    timeline = SpeculationTimeline()
    for t in range(6):
        timeline.observe(float(t), scrape(replica_text("a", DRAFT, 50 + t)), replicas=1)
    # The replica is replaced: its counters start again from 0 (the old series vanish or drop).
    new = "a" if same_labels else "c"
    for t in range(6, 12):
        timeline.observe(float(t), scrape(replica_text(new, DRAFT, t - 5)), replicas=1)
    accepted = [p.totals["accepted|draft|"] for p in timeline.points]
    assert accepted == [20.0 * t for t in range(12)]  # 20 a second throughout, the restart included
    rates = speculation_rates(timeline, window_s=1.0)
    assert rates.tokens_saved_per_s[DRAFT] == [pytest.approx(20.0)] * 11
    assert rates.acceptance[DRAFT] == [pytest.approx(0.5)] * 11


def test_memory_is_bounded_and_the_whole_cell_stays() -> None:
    timeline = SpeculationTimeline(max_points=16)
    for t in range(200):
        timeline.observe(float(t), scrape(replica_text("a", DRAFT, t)), replicas=1)
    times = [p.t for p in timeline.points]
    assert len(times) <= 16 and times[0] == 0.0 and times[-1] == 199.0 and times == sorted(times)
    rates = speculation_rates(timeline, window_s=5.0)  # points further apart than the window: still rates
    assert rates.tokens_saved_per_s[DRAFT] == [pytest.approx(20.0)] * (len(times) - 1)


def test_timeline_json_round_trip_and_too_few_points() -> None:
    timeline = SpeculationTimeline()
    assert speculation_rates(timeline).empty()
    timeline.observe(0.0, scrape(replica_text("a", DRAFT, 1)), replicas=1)
    assert speculation_rates(timeline).empty()  # one scrape: no window yet
    timeline.observe(1.0, scrape(replica_text("a", DRAFT, 2)), replicas=1)
    again = SpeculationTimeline.from_dict(json.loads(json.dumps(timeline.to_dict())))
    assert again.points == timeline.points
    assert speculation_rates(again) == speculation_rates(timeline)


def test_sampler_keeps_the_timeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LocalCluster, "running_replicas", staticmethod(lambda app: 2))
    scrapes = [scrape(replica_text("a", DRAFT, step)) for step in (3, 4, 5)]
    done = threading.Event()

    class FakeCluster:
        def scrape(self) -> dict[tuple[str, str], float]:
            if len(scrapes) == 1:
                done.set()
            return scrapes.pop(0) if scrapes else {}  # {}: the exporter did not answer, no point

    with ReplicaSampler("app", FakeCluster(), interval_s=0.01) as sampler:  # type: ignore[arg-type]
        assert done.wait(10)
    assert [p.totals["accepted|draft|"] for p in sampler.timeline.points] == [0.0, 20.0, 40.0]
    assert {p.replicas for p in sampler.timeline.points} == {2}


def test_report_plots_the_panels_per_cell(tmp_path: Path) -> None:
    timeline = SpeculationTimeline()
    for t in range(8):
        timeline.observe(float(t), scrape(replica_text("a", DRAFT, t, fallbacks=1.0)), replicas=1)
    results = [CellResult("plain", 2, "mixed"), CellResult("adaptive", 2, "mixed")]
    meta = {"started": "2026-01-01T00-00-00Z", "price": 0.15, "wall_s": 60}
    # A plain cell's timeline with one scrape only: no window, so no plot and no link.
    short = SpeculationTimeline()
    short.observe(0.0, scrape(replica_text("a", DRAFT, 0)), replicas=1)
    timelines = {("adaptive", 2, "mixed"): timeline, ("plain", 2, "mixed"): short}
    report = write_report(tmp_path, results, {}, meta, timelines).read_text()
    name = plot_file("adaptive", 2, "mixed")
    assert (tmp_path / name).stat().st_size > 10_000
    assert f"![{name}]({name})" in report
    assert not (tmp_path / plot_file("plain", 2, "mixed")).exists()
    section = report[report.index("### Speculation over time") :]
    assert re.search(r"server's own Prometheus counters.*as the Grafana dashboard's do", section)
    assert (
        report.index("## Mix `mixed`")
        < report.index("### Speculation over time")
        < report.index("## Counter check")
    )
    (tmp_path / "old").mkdir()
    without = write_report(tmp_path / "old", results, {}, meta).read_text()  # timelines are optional
    assert "Speculation over time" not in without


def test_every_speculation_series_of_the_dashboard_is_followed() -> None:
    """The dashboard's speculation row reads only series the timeline follows (quantile buckets aside)."""
    dashboard = json.loads((ROOT / "k8s" / "monitoring" / "dashboard.json").read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    row = dashboard["panels"][titles.index("Speculation") + 1 : titles.index("Serving")]
    exprs = " ".join(target["expr"] for panel in row for target in panel.get("targets", []))
    names = {n for n in re.findall(r"specserve:[a-z_]+", exprs) if not n.endswith("_bucket")}
    assert names and "specserve:spec_decode_num_drafts_total" in names
    for name in names:
        assert series_key("ray_" + name.replace(":", "_", 1), tags("a", DRAFT)) is not None, name


def test_running_and_waiting_requests_are_summed_over_replicas_at_each_scrape() -> None:
    timeline = SpeculationTimeline()
    waiting = lambda replica, n: f"ray_specserve_num_requests_waiting{tags(replica)} {n}\n"  # noqa: E731
    timeline.observe(0.0, scrape(replica_text("a", DRAFT, 1), waiting("a", 5)), replicas=1)
    two = scrape(replica_text("a", DRAFT, 2), waiting("a", 2), replica_text("b", DRAFT, 1), waiting("b", 1))
    timeline.observe(1.0, two, replicas=2)
    timeline.observe(2.0, scrape(replica_text("a", DRAFT, 3), waiting("a", 0)), replicas=1)
    rates = speculation_rates(timeline)
    assert rates.replicas == [2, 1]
    assert rates.running == [6.0, 3.0]  # 3 per replica (replica_text), as each scrape had them
    assert rates.waiting == [3.0, 0.0]  # gauges: the value at the scrape, never a growth
    assert SpeculationTimeline.from_dict(json.loads(json.dumps(timeline.to_dict()))).points == timeline.points
