"""Tests for `specserve bench`'s reports (loadtest.bench.run, report, results, sweeps): the summaries,
markdown and JSON built from synthetic data (no models, no timing). Method selection, the CLI and
the measuring functions: ``test_method_selection``."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import report, sweeps
from loadtest.bench.results import BenchResult, PromptResult, Run
from loadtest.bench.sweeps import CostCurve, Sweep, SweepPoint, SweepRun
from loadtest.catalogue import Prompt

N = 10
OURS, D2, AS, HF = "specserve-plain", "specserve-draft-d2", "transformers-assisted", "transformers-plain"
TOKENS = list(range(N))
DIVERGED = [*TOKENS[:3], 99, *TOKENS[4:]]
COMMAND = ["/x/.venv/bin/specserve", "bench", "--model", "smollm2-135m-instruct", "--kinds", "code", "json"]


def _runs(seconds: list[float], tokens: list[int] = TOKENS, decode: float | None = None,
          spec: tuple[int, int, int] | None = None) -> list[Run]:  # fmt: skip
    return [Run(list(tokens), s, decode, *(spec or (None, None, None))) for s in seconds]


def _result(methods: tuple[str, ...] = (OURS, D2, AS), sweep=None, cost_curve=None) -> BenchResult:
    """Four prompts (code x2, json, prose); the comments give tok/s (N / seconds, median of 3)."""
    prompts = [
        PromptResult(Prompt("code", "quicksort", "def quicksort(arr):", False), 6, {
            OURS: _runs([1.0, 2.0, 4.0], decode=0.9),  # 10, 5, 2.5 -> 5; decode 9 / 0.9 = 10
            D2: _runs([0.5, 0.5, 1.0], spec=(8, 6, 4)),  # 20
            AS: _runs([1.0, 1.0, 1.0]),  # 10
            HF: _runs([2.0, 2.0, 2.0]),  # 5
        }),
        PromptResult(Prompt("code", "load_config", "import json", False), 20, {
            OURS: _runs([0.5, 0.5, 0.5], decode=0.45),  # 20; decode 20
            D2: _runs([0.25, 0.25, 0.25], DIVERGED, spec=(10, 5, 5)),  # 40, differs at 3
            AS: _runs([1.0, 1.0, 1.0]),  # 10
            HF: _runs([2.0, 2.0, 2.0]),  # 5
        }),
        PromptResult(Prompt("json", "people", "Extract ...", True), 30, {
            OURS: _runs([2.0, 2.0, 2.0], decode=1.8),  # 5; decode 5
            D2: _runs([0.5, 0.5, 0.5], spec=(8, 8, 4)),  # 20
            AS: _runs([1.0, 1.0, 1.0]),  # 10
            HF: _runs([2.0, 2.0, 2.0]),  # 5
        }),
        PromptResult(Prompt("prose", "press", "The printing press", False), 12, {
            OURS: _runs([1.0, 1.0, 1.0], decode=0.9),  # 10; decode 10
            D2: _runs([2.0, 2.0, 2.0], spec=(10, 0, 5)),  # 5
            AS: _runs([0.5, 0.5, 0.5]),  # 20
            HF: _runs([1.0, 1.0, 1.0]),  # 10
        }),
    ]  # fmt: skip
    for p in prompts:
        p.runs = {m: p.runs[m] for m in methods}
    return BenchResult(
        command=COMMAND, model="smollm2-135m-instruct", dtype="bfloat16", max_tokens=N, repeats=3,
        methods=list(methods), prompts=prompts, bytes_per_token=int(2e9), kv_bytes_per_position=1000,
        copy_bandwidth=20e9, machine={"threads": 2, "cpu": "test cpu"}, draft="tiny-draft",
        method_notes={D2: "our engine, draft, depth 2"}, sweep=sweep, cost_curve=cost_curve,
    )  # fmt: skip


def _sweep() -> Sweep:
    def runs(tokens: int, seconds: list[float], **kw) -> list[SweepRun]:
        return [SweepRun(tokens, s, **kw) for s in seconds]

    return Sweep(max_tokens=N, depth=6, repeats=2, modes=["plain", "draft", "ngram"], points=[
        SweepPoint(1, {"plain": runs(10, [1.0, 2.0]),  # 10, 5 -> 7.5
                       "draft": runs(10, [0.5, 0.5], drafted=6, accepted=3, spec_steps=2, differs=0),  # 20
                       "ngram": runs(10, [1.0, 1.0], drafted=2, accepted=2, spec_steps=1, differs=0)}),  # 10
        SweepPoint(4, {"plain": runs(40, [1.0, 1.0]),  # 40
                       "draft": [SweepRun(40, 2.0, 8, 2, 4, 0), SweepRun(40, 2.0, 8, 2, 4, 1)],  # 20
                       "ngram": runs(40, [0.8, 0.8], differs=0)}),  # 50, nothing drafted
    ])  # fmt: skip


def _cost_curve() -> CostCurve:
    target = {1: {1: [0.2, 0.2, 0.3], 2: [0.21] * 3, 32: [0.3] * 3}, 8: {1: [0.4] * 3, 32: [1.6] * 3}}
    return CostCurve(context=200, repeats=3, target=target, draft={1: [0.05] * 3, 8: [0.1] * 3})


def _section(markdown: str, title: str) -> list[list[str]]:
    """The table under ``### title``: header first, separator dropped."""
    body = markdown.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    table = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return [table[0], *table[2:]]


# ------------------------------------------------------------------------------------ rates
def test_rates_are_medians_over_repeats() -> None:
    assert report.tok_per_s(_runs([1.0, 2.0, 4.0]), N) == pytest.approx(5.0)
    assert report.tok_per_s(_runs([1.0, 2.0]), N) == pytest.approx(7.5)  # median of 10 and 5
    assert report.decode_tok_per_s(_runs([1.0], decode=0.9), N) == pytest.approx(10.0)
    assert report.decode_tok_per_s(_runs([1.0]), N) is None


def test_first_divergence() -> None:
    assert report.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert report.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert report.first_divergence([1, 2, 3], [1, 2]) == 2


def test_spec_totals_are_pooled_over_repeats() -> None:
    assert report.spec_totals(_runs([1.0])) is None
    totals = report.spec_totals(_runs([1.0, 1.0], spec=(8, 6, 4)))
    assert totals == {"drafted": 16, "accepted": 12, "spec_steps": 8, "draft_seconds": 0, "draft_calls": 0,
                      "drafted_at": [], "accepted_at": []}  # fmt: skip
    rates = report.spec_rates(totals)
    assert rates["acceptance_rate"] == pytest.approx(0.75)
    assert rates["mean_accepted_length"] == pytest.approx(2.5)  # (12 + 8) / 8
    assert report.spec_rates({"drafted": 0, "accepted": 0, "spec_steps": 0})["mean_accepted_length"] == 0.0
    # Per draft position: runs of different depths add up position by position.
    runs = [Run(TOKENS, 1.0, None, 6, 4, 4, (4, 2), (3, 1)),
            Run(TOKENS, 1.0, None, 5, 3, 3, (3, 1, 1), (2, 1))]  # fmt: skip  # (as SpecStats counts)
    by_position = report.spec_totals(runs)
    assert by_position["drafted_at"] == [7, 3, 1] and by_position["accepted_at"] == [5, 2]
    assert report.spec_rates(by_position)["acceptance_at"] == pytest.approx([5 / 7, 2 / 3, 0.0])


# ------------------------------------------------------------------------------------ summary
def test_summary_per_prompt() -> None:
    s = report.summary(_result())
    rows = s["rows"]
    assert s["reference"] == OURS and s["speedup_references"] == [OURS, AS]
    assert [r["tok_s"][D2] for r in rows] == pytest.approx([20.0, 40.0, 20.0, 5.0])
    assert [r["speedup"][OURS][D2] for r in rows] == pytest.approx([4.0, 2.0, 4.0, 0.5])
    assert [r["speedup"][AS][D2] for r in rows] == pytest.approx([2.0, 4.0, 2.0, 0.25])
    assert rows[0]["speedup"][OURS][OURS] == 1.0
    assert [r["divergence"][D2] for r in rows] == [None, 3, None, None]
    assert [r["divergence"][AS] for r in rows] == [None] * 4
    assert set(rows[0]["spec"]) == {D2}  # plain and transformers carry no speculation counts
    assert rows[0]["spec"][D2]["acceptance_rate"] == pytest.approx(0.75)
    assert rows[0]["spec"][D2]["mean_accepted_length"] == pytest.approx(2.5)


def test_summary_groups_per_kind_code_json_and_overall() -> None:
    groups = {g["group"]: g for g in report.summary(_result())["groups"]}
    assert list(groups) == ["code", "json", "prose", "code+json", "overall"]  # kinds in KINDS order
    code = groups["code"]
    assert code["prompts"] == 2
    assert code["tok_s"] == pytest.approx({OURS: 12.5, D2: 30.0, AS: 10.0})  # medians over prompts
    assert code["speedup"][OURS][D2] == pytest.approx(30.0 / 12.5)  # ratio of the medians
    assert code["speedup"][AS][D2] == pytest.approx(3.0)
    assert code["spec"][D2]["drafted"] == 54 and code["spec"][D2]["accepted"] == 33  # pooled: 3x(8+10)
    assert code["spec"][D2]["acceptance_rate"] == pytest.approx(33 / 54)
    assert code["spec"][D2]["mean_accepted_length"] == pytest.approx((33 + 27) / 27)
    assert code["identical"] == {D2: 1, AS: 2}
    assert groups["json"]["spec"][D2]["mean_accepted_length"] == pytest.approx(3.0)
    assert groups["prose"]["spec"][D2]["acceptance_rate"] == 0.0
    both = groups["code+json"]
    assert both["prompts"] == 3
    assert both["speedup"][OURS][D2] == pytest.approx(4.0)  # 20 / 5
    assert both["speedup"][AS][D2] == pytest.approx(2.0)  # 20 / 10
    overall = groups["overall"]
    assert overall["tok_s"] == pytest.approx({OURS: 7.5, D2: 20.0, AS: 10.0})
    assert overall["identical"] == {D2: 3, AS: 4}


def test_summary_headline_and_roofline() -> None:
    s = report.summary(_result())
    assert s["headline"] == {"group": "code+json", "method": D2, "targets": {OURS: 2.0, AS: 1.3},
                             "speedup": pytest.approx({OURS: 4.0, AS: 2.0})}  # fmt: skip
    assert s["tok_s"] == pytest.approx({OURS: 7.5, D2: 20.0, AS: 10.0})
    assert s["speedup"][OURS][D2] == pytest.approx(20.0 / 7.5)
    assert s["decode_tok_s"][OURS] == pytest.approx(10.0)  # median of 10, 20, 5, 10
    assert s["decode_tok_s"][AS] is None
    assert s["roofline_tok_s"] == pytest.approx(10.0)  # 20 GB/s / 2 GB per token
    assert s["fraction"] == pytest.approx({OURS: 0.75, D2: 2.0, AS: 1.0})
    assert s["kv_bytes_mean"] == pytest.approx(1000 * (17 + N / 2))  # mean prompt 17 + half the output


def test_a_method_on_quantized_weights_meets_its_own_roofline() -> None:
    result = _result()
    result.method_bytes = {OURS: int(2e9), D2: int(1e9)}  # D2's target reads half the bytes
    s = report.summary(result)
    assert s["fraction"] == pytest.approx({OURS: 0.75, D2: 1.0, AS: 1.0})  # 20 tok/s of its own 20
    assert f"{D2} 1.000 GB" in report.to_markdown(result)


def test_summary_without_plain_or_drafts() -> None:
    s = report.summary(_result((D2, AS)))
    assert s["reference"] == D2 and s["speedup_references"] == [AS]
    assert s["headline"]["speedup"] == pytest.approx({AS: 2.0})
    s = report.summary(_result((OURS, HF)))
    assert s["headline"] is None and s["speedup_references"] == [OURS, HF]
    assert s["speedup"][HF][OURS] == pytest.approx(7.5 / 5.0)  # transformers-plain: in the JSON only
    assert all(not r["spec"] for r in s["rows"])


# ------------------------------------------------------------------------------------ markdown
def test_markdown_header_and_notes() -> None:
    markdown = report.to_markdown(_result())
    lines = markdown.splitlines()
    assert lines[0] == "`specserve bench --model smollm2-135m-instruct --kinds code json`"
    assert lines[2].startswith("smollm2-135m-instruct target, tiny-draft draft, bfloat16, batch 1, greedy")
    assert f"- `{D2}`: our engine, draft, depth 2" in lines
    assert "Headline (code+json prompts, best draft depth): `specserve-draft-d2` 4.00x specserve-plain " \
           "(target >= 2.0x), 2.00x transformers-assisted (target >= 1.3x)." in markdown  # fmt: skip
    assert "10.0 tok/s" in markdown and "20.0 GB/s" in markdown and "2.000 GB" in markdown


def test_markdown_throughput_table() -> None:
    table = _section(report.to_markdown(_result()), "Throughput")
    assert table[0] == ["prompt", "kind", "prompt tokens", OURS, D2, AS]
    assert len(table) == 1 + 4 + 5  # prompts, then code, json, prose, code+json, overall
    assert table[1] == ["quicksort (raw)", "code", "6", "5.00 / 1.00x / 0.50x", "20.00 / 4.00x / 2.00x",
                        "10.00 / 2.00x / 1.00x"]  # fmt: skip
    assert table[5] == ["**code** (2 prompts)", "", "", "12.50 / 1.00x / 1.25x", "30.00 / 2.40x / 3.00x",
                        "10.00 / 0.80x / 1.00x"]  # fmt: skip
    assert table[7][0] == "**prose** (1 prompt)"
    assert table[8][0] == "**code+json** (3 prompts)" and table[8][4] == "20.00 / 4.00x / 2.00x"
    assert table[9][0] == "**overall** (4 prompts)" and table[9][3] == "7.50 / 1.00x / 0.75x"


def test_markdown_speculation_and_identity_tables() -> None:
    markdown = report.to_markdown(_result())
    spec = _section(markdown, "Speculation")
    assert spec[0] == ["prompt", "kind", D2]  # only methods that speculate
    assert spec[1] == ["quicksort (raw)", "code", "75% / 2.50"]
    assert spec[4] == ["press (raw)", "prose", "0% / 1.00"]  # drafted, nothing accepted
    result = _result()
    result.prompts[3].runs[D2] = _runs([2.0, 2.0, 2.0], spec=(0, 0, 0))
    assert _section(report.to_markdown(result), "Speculation")[4] == ["press (raw)", "prose", "no drafts"]
    assert spec[5] == ["**code** (2 prompts)", "", "61% / 2.22"]
    same = _section(markdown, f"Output vs {OURS}")
    assert same[0] == ["prompt", "kind", D2, AS]
    assert same[2] == ["load_config (raw)", "code", "differs at 3", "identical"]
    assert same[-1] == ["**overall** (4 prompts)", "", "3/4 identical", "4/4 identical"]


def test_draft_cost_is_propose_time_per_call_against_plain_time_per_token() -> None:
    result = _result()
    # quicksort: 3 runs of 4 propose calls in 20 ms each -> 5 ms a call; load_config: not timed
    result.prompts[0].runs[D2] = [Run(TOKENS, 0.5, None, 8, 6, 4, draft_seconds=0.02, draft_calls=4)] * 3
    s = report.summary(result)
    code = next(g for g in s["groups"] if g["group"] == "code")
    assert code["plain_ms_per_token"] == pytest.approx(75.0)  # median of 100 and 50 ms (decode 10, 20 tok/s)
    assert code["spec"][D2]["draft_ms_per_call"] == pytest.approx(5.0)
    table = _section(report.to_markdown(result), "Draft cost")
    assert table[0] == ["kind", f"{OURS} ms / token", D2]
    assert table[1] == ["**code** (2 prompts)", "75.00", "5.00 ms / 0.067"]
    assert table[2][2] == "-"  # json: no propose timed
    result.methods = [D2, AS]
    for p in result.prompts:
        p.runs.pop(OURS, None)
    assert "### Draft cost" not in report.to_markdown(result)  # no plain time to weigh it against


def test_markdown_without_transformers_or_speculation() -> None:
    markdown = report.to_markdown(_result((OURS, D2)))
    table = _section(markdown, "Throughput")
    assert table[0] == ["prompt", "kind", "prompt tokens", OURS, D2]
    assert table[1][3:] == ["5.00 / 1.00x", "20.00 / 4.00x"]  # no assisted ratio
    markdown = report.to_markdown(_result((OURS,)))
    assert (
        "### Speculation" not in markdown and "### Output vs" not in markdown and "Headline" not in markdown
    )
    assert _section(markdown, "Throughput")[-1] == ["**overall** (4 prompts)", "", "", "7.50 / 1.00x"]


def test_json_is_complete_and_serialisable() -> None:
    data = json.loads(json.dumps(report.to_json(_result(sweep=_sweep(), cost_curve=_cost_curve()))))
    assert data["command"] == COMMAND
    assert data["prompts"][1]["runs"][D2][0]["token_ids"][3] == 99
    assert data["prompts"][0]["runs"][D2][0]["drafted"] == 8
    assert [r["seconds"] for r in data["prompts"][0]["runs"][OURS]] == [1.0, 2.0, 4.0]
    assert data["summary"]["speedup"][OURS][D2] == pytest.approx(20.0 / 7.5)
    assert data["summary"]["groups"][-1]["group"] == "overall"
    assert data["sweep"]["points"][1]["runs"]["draft"][1]["differs"] == 1
    assert data["sweep_summary"]["stops_paying_at"] == {"draft": 4, "ngram": None}
    assert data["cost_curve"]["target"]["8"]["32"] == [1.6] * 3
    assert data["cost_curve_summary"]["unit_ms"] == pytest.approx(200.0)


# ------------------------------------------------------------------------------------ sweep, cost curve
def test_sweep_summary() -> None:
    s = sweeps.sweep_summary(_sweep())
    one, four = s["rows"]
    assert one["tok_s"] == pytest.approx({"plain": 7.5, "draft": 20.0, "ngram": 10.0})
    assert one["ratio"] == pytest.approx({"draft": 20 / 7.5, "ngram": 10 / 7.5})
    assert one["acceptance"] == pytest.approx({"draft": 0.5, "ngram": 1.0})
    assert four["ratio"] == pytest.approx({"draft": 0.5, "ngram": 1.25})
    assert four["acceptance"] == pytest.approx({"draft": 0.25})  # ngram drafted nothing
    assert four["differs"] == {"draft": 1, "ngram": 0}  # worst repeat
    assert s["stops_paying_at"] == {"draft": 4, "ngram": None}


def test_sweep_markdown() -> None:
    markdown = report.to_markdown(_result(sweep=_sweep()))
    table = _section(markdown, "Batch sweep")
    assert table[0] == ["concurrent requests", "plain tok/s", "draft d6 tok/s", "draft d6 / plain",
                        "draft acceptance", "ngram d6 tok/s", "ngram d6 / plain", "ngram acceptance",
                        "outputs differing from plain"]  # fmt: skip
    assert table[1] == [
        "1",
        "7.50",
        "20.00",
        "2.67x",
        "50%",
        "10.00",
        "1.33x",
        "100%",
        "draft 0/1, ngram 0/1",
    ]
    assert table[2] == ["4", "40.00", "20.00", "0.50x", "25%", "50.00", "1.25x", "-", "draft 1/4, ngram 0/4"]
    assert "draft d6 at 4 concurrent requests; ngram d6: pays at every concurrency." in markdown
    sweep = _sweep()
    sweep.modes = ["plain", "auto"]
    for point, by in zip(sweep.points, ({"eagle": 3, "ngram": 5}, {}), strict=True):
        point.runs = {"plain": point.runs["plain"], "auto": [SweepRun(10, 1.0, 4, 2, 2, 0, by)] * 2}
    markdown = report.to_markdown(_result(sweep=sweep))
    assert _section(markdown, "Batch sweep")[0][2:4] == ["auto tok/s", "auto / plain"]  # the policy's depth
    picks = "speculative steps by proposer (all repeats), by concurrency: 1: ngram 10, eagle 6; 4: none."
    assert picks in markdown


def test_cost_curve_table() -> None:
    s = sweeps.cost_curve_summary(_cost_curve())
    assert s["unit_ms"] == pytest.approx(200.0)  # median of the target's 1-token forward at batch 1
    assert s["target_ratio"][8][32] == pytest.approx(8.0)
    assert s["draft_ratio"] == pytest.approx({1: 0.25, 8: 0.5})
    markdown = report.to_markdown(_result(cost_curve=_cost_curve()))
    table = _section(markdown, "Cost curve")
    assert table[0] == ["forward", "batch 1 ms", "batch 1 ratio", "batch 8 ms", "batch 8 ratio"]
    assert table[1] == ["target, 1 token/row", "200.0", "1.00x", "400.0", "2.00x"]
    assert table[2] == ["target, 2 tokens/row", "210.0", "1.05x", "-", "-"]  # not measured at batch 8
    assert table[3] == ["target, 32 tokens/row", "300.0", "1.50x", "1600.0", "8.00x"]
    assert table[4] == ["draft step, 1 token/row", "50.0", "0.25x", "100.0", "0.50x"]
    assert "(200.0 ms)" in markdown
