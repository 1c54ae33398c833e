"""The benchmark's comparisons beyond our own methods: llama.cpp's server in the batch sweep, and
the server path (``specserve serve`` with one streaming client against the engine in-process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadtest.bench import llama_server, server_path
from loadtest.bench.sweeps import Sweep, SweepPoint, SweepRun, sweep_markdown
from loadtest.catalogue import Prompt


def _table(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for i, row in enumerate(rows) if i != 1]


def test_the_sweep_table_puts_llama_cpp_server_beside_ours() -> None:
    points = [
        SweepPoint(1, {"plain": [SweepRun(10, 1.0)], "draft": [SweepRun(10, 0.5, 6, 3, 2, 0)]}),  # 10 / 20
        SweepPoint(8, {"plain": [SweepRun(80, 1.0)], "draft": [SweepRun(80, 2.0, 8, 2, 4, 0)]}),  # 80 / 40
    ]
    sweep = Sweep(max_tokens=10, depth=4, repeats=1, modes=["plain", "draft"], points=points,
                  peer={1: [(10, 1.0), (10, 0.5)], 8: [(80, 2.0)]}, peer_name=llama_server.NAME)  # fmt: skip
    table = _table(sweep_markdown(sweep))
    assert table[0][-3:] == ["llama.cpp-server tok/s", "best of ours / llama.cpp-server",
                             "outputs differing from plain"]  # fmt: skip
    assert table[1][-3:-1] == ["15.00", "1.33x"]  # median of 10 and 20; ours at best 20 (draft)
    assert table[2][-3:-1] == ["40.00", "2.00x"]  # ours at best 80 (plain)


def test_without_a_peer_the_sweep_table_is_ours_alone() -> None:
    sweep = Sweep(10, 4, 1, ["plain"], [SweepPoint(1, {"plain": [SweepRun(10, 1.0)]})])
    assert _table(sweep_markdown(sweep))[0] == [
        "concurrent requests",
        "plain tok/s",
        "outputs differing from plain",
    ]


def test_no_server_binary_skips_the_peer_with_a_message(monkeypatch, capsys) -> None:
    monkeypatch.delenv(llama_server.ENV, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert llama_server.peer_sweep(object(), "any-pack", [[1, 2]], [1], 4, 1, 1) == {}
    assert "skipping llama.cpp-server: no llama-server" in capsys.readouterr().err


@pytest.mark.slow
def test_llama_cpp_server_answers_every_slot_at_once() -> None:
    """Where a llama-server binary and the default pack's GGUF are here (never in CI): two slots
    generate two full completions at once."""
    binary = os.environ.get(llama_server.ENV)
    gguf = Path.home() / ".cache/specserve/gguf/qwen2.5-coder-1.5b-instruct.gguf"
    if not binary or not gguf.is_file():
        pytest.skip(f"needs {llama_server.ENV} and {gguf}")
    runs = llama_server.measure_server_sweep(Path(binary), gguf, [[785, 3974, 315], [750, 1273]], [2], n=8,
                                             repeats=1, threads=2, context=64)  # fmt: skip
    ((tokens, seconds),) = runs[2]
    assert tokens == 16 and seconds > 0


def test_the_server_path_table_has_a_ratio_per_prompt_and_mode() -> None:
    common = {"prompt": "quicksort", "kind": "code"}
    rows = [
        {**common, "mode": "off", "inproc": 10.0, "server": 9.0, "ratio": 0.9, "identical": True},
        {**common, "mode": "auto", "inproc": 20.0, "server": 19.0, "ratio": 0.95, "identical": False},
    ]
    table = _table(server_path.server_path_markdown(rows, 48, 3))
    assert table[1] == ["quicksort", "code", "off", "10.00", "9.00", "0.90x", "identical"]
    assert table[2][-1] == "DIFFERS"
    assert table[3] == ["**all**", "", "off", "", "", "0.90x (median)", ""]


@pytest.mark.slow
def test_the_server_path_streams_the_in_process_output(smollm2_path, tmp_path) -> None:
    """A real `specserve serve` (its own local Ray cluster) on SmolLM2 and the same engine in-process:
    the streamed text is the in-process tokens' text, plain and speculative."""
    from loadtest.bench.engine import bench_engine
    from loadtest.bench.methods import specserve_method
    from serve_app.config import Settings

    settings = Settings.model_validate({
        "model": {"target": str(smollm2_path), "draft": None}, "runtime": {"threads": 1, "dtype": "float32"},
        "speculation": {"method": "ngram"}, "stats": {"redis_url": None},
        "autoscaling": {"replica_num_cpus": 1},
    })  # fmt: skip
    engine = bench_engine(settings, ["ngram"], max_slots=1, depth=4, n=16)
    methods = {"off": specserve_method(engine, 12, "specserve-plain"),
               "auto": specserve_method(engine, 12, "specserve-auto", "ngram", 4)}  # fmt: skip
    prompt = Prompt("code", "add", "def add(a, b):\n    return", False)
    encoded = {prompt: engine.encode_prompt(prompt.text)}
    rows = server_path.measure_server_path(methods, settings, [prompt], encoded, 12, 1, tmp_path,
                                           engine.tokenizer.decode)  # fmt: skip
    assert {r["mode"] for r in rows} == {"off", "auto"}
    assert all(r["identical"] and r["server"] > 0 and r["inproc"] > 0 for r in rows)
