"""Tests for serve_app.bench: the report builders (no models, no timing)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from serve_app import bench
from serve_app.bench import PROMPTS, BenchResult, Prompt, PromptResult, Run
from serve_app.config import Settings

N = 10
OURS, HF = "specserve-plain", "transformers-plain"
TOKENS = list(range(N))
COMMAND = ["/x/.venv/bin/specserve", "bench", "--model", "smollm2-135m-instruct", "--kinds", "code", "json"]


def _runs(seconds: list[float], tokens: list[int] = TOKENS, decode: float | None = None) -> list[Run]:
    return [Run(list(tokens), s, decode) for s in seconds]


def _result(methods: tuple[str, ...] = (OURS, HF)) -> BenchResult:
    diverged = [*TOKENS[:3], 99, *TOKENS[4:]]
    prompts = [
        PromptResult(Prompt("code", "quicksort", "def quicksort(arr):", False), 6, {
            OURS: _runs([1.0, 2.0, 4.0], decode=0.9),  # 10, 5, 2.5 tok/s -> 5; decode 9/0.9 = 10
            HF: _runs([4.0, 5.0, 2.0]),  # 2.5, 2, 5 -> 2.5; ratio 2.0
        }),
        PromptResult(Prompt("json", "people", "Extract ...", True), 30, {
            OURS: _runs([0.5, 0.5, 0.5], decode=0.45),  # 20 tok/s; decode 20
            HF: _runs([1.0, 1.0, 1.0], diverged),  # 10 tok/s; ratio 2.0; differs at 3
        }),
        PromptResult(Prompt("prose", "press", "The printing press", False), 12, {
            OURS: _runs([2.0, 2.0, 2.0], decode=1.8),  # 5 tok/s; decode 5
            HF: _runs([1.0, 1.0, 1.0]),  # 10 tok/s; ratio 0.5
        }),
    ]  # fmt: skip
    for p in prompts:
        p.runs = {m: p.runs[m] for m in methods}
    return BenchResult(
        command=COMMAND, model="smollm2-135m-instruct", dtype="bfloat16", max_tokens=N, repeats=3,
        methods=list(methods), prompts=prompts, bytes_per_token=int(2e9), kv_bytes_per_position=1000,
        copy_bandwidth=20e9, machine={"threads": 2, "cpu": "test cpu"},
    )  # fmt: skip


def _table(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_rates_are_medians_over_repeats() -> None:
    assert bench.tok_per_s(_runs([1.0, 2.0, 4.0]), N) == pytest.approx(5.0)
    assert bench.tok_per_s(_runs([1.0, 2.0]), N) == pytest.approx(7.5)  # median of 10 and 5
    assert bench.decode_tok_per_s(_runs([1.0], decode=0.9), N) == pytest.approx(10.0)
    assert bench.decode_tok_per_s(_runs([1.0]), N) is None


def test_first_divergence() -> None:
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_divergence([1, 2, 3], [1, 2]) == 2


def test_summary_per_prompt_and_overall() -> None:
    s = bench.summary(_result())
    assert [r["tok_s"][OURS] for r in s["rows"]] == pytest.approx([5.0, 20.0, 5.0])
    assert [r["tok_s"][HF] for r in s["rows"]] == pytest.approx([2.5, 10.0, 10.0])
    assert [r["ratio"][OURS] for r in s["rows"]] == pytest.approx([2.0, 2.0, 0.5])
    assert [r["divergence"][HF] for r in s["rows"]] == [None, 3, None]
    assert s["tok_s"] == pytest.approx({OURS: 5.0, HF: 10.0})  # medians over prompts
    assert s["ratio"][OURS] == pytest.approx(0.5)  # ratio of the medians
    assert s["decode_tok_s"][OURS] == pytest.approx(10.0)  # median of 10, 20, 5
    assert s["decode_tok_s"][HF] is None
    assert s["identical"] == {HF: 2}
    assert s["roofline_tok_s"] == pytest.approx(10.0)  # 20 GB/s / 2 GB per token
    assert s["fraction"] == pytest.approx({OURS: 0.5, HF: 1.0})
    assert s["kv_bytes_mean"] == pytest.approx(1000 * (16 + N / 2))  # mean prompt 16 + half the output


def test_markdown_table() -> None:
    markdown = bench.to_markdown(_result())
    assert markdown.splitlines()[0] == "`specserve bench --model smollm2-135m-instruct --kinds code json`"
    table = _table(markdown)
    header, rows = table[0], table[2:]
    assert header == ["prompt", "kind", "prompt tokens", f"{OURS} tok/s", f"{HF} tok/s",
                      f"{OURS} decode tok/s", f"{OURS} / {HF}", f"{HF} output vs {OURS}"]  # fmt: skip
    assert len(rows) == 4  # one per prompt + overall
    assert rows[0] == ["quicksort (raw)", "code", "6", "5.00", "2.50", "10.00", "2.00x", "identical"]
    assert rows[1] == ["people (chat)", "json", "30", "20.00", "10.00", "20.00", "2.00x", "differs at 3"]
    assert rows[3] == ["**overall (median)**", "", "", "5.00", "10.00", "10.00", "0.50x", "2/3 identical"]
    assert "10.0 tok/s" in markdown and "20.0 GB/s" in markdown and "2.000 GB" in markdown


def test_markdown_without_transformers() -> None:
    table = _table(bench.to_markdown(_result((OURS,))))
    assert table[0] == ["prompt", "kind", "prompt tokens", f"{OURS} tok/s", f"{OURS} decode tok/s"]
    assert table[-1] == ["**overall (median)**", "", "", "5.00", "10.00"]


def test_json_is_complete_and_serialisable() -> None:
    data = json.loads(json.dumps(bench.to_json(_result())))
    assert data["command"] == COMMAND
    assert data["prompts"][1]["runs"][HF][0]["token_ids"][3] == 99
    assert [r["seconds"] for r in data["prompts"][0]["runs"][OURS]] == [1.0, 2.0, 4.0]
    assert data["summary"]["ratio"][OURS] == pytest.approx(0.5)


def test_prompts_cover_the_kinds() -> None:
    assert {p.kind for p in PROMPTS} == {"code", "json", "chat", "prose"}
    assert any(p.chat for p in PROMPTS) and any(not p.chat for p in PROMPTS)


def test_copy_bandwidth_is_positive() -> None:
    assert bench.measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=2) > 0


def test_unknown_kind_is_an_error() -> None:
    args = argparse.Namespace(kinds=["nope"], max_tokens=16, repeats=1)
    with pytest.raises(ValueError, match="no prompts"):
        bench.run_bench(args, Settings())
