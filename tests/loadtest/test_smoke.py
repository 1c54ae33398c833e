"""The load matrix end to end, small: SmolLM2 (as target and draft), two policies, one load level.

`specserve loadtest` runs in a subprocess (it starts its own local Ray cluster, a `specserve serve`
per cell and Locust); the test checks that the report is produced and that its numbers agree:
tokens counted by the client equal the server's counter, no request failed, Locust's own CSVs
count the same requests, replica-seconds cover the measured window.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.pack(MODEL)
def test_smoke_matrix_report_is_consistent(tmp_path: Path, smollm2_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "specserve.cli",
        "loadtest",
        "--model",
        MODEL,
        "--draft",
        MODEL,
        "--policies",
        "plain",
        "static",
        "--users",
        "2",
        "--mixes",
        "structured",
        "--run-time",
        "8",
        "--max-requests",
        "12",
        "--max-tokens",
        "32",
        "--stop-timeout",
        "60",
        "--slots",
        "4",
        "--out",
        str(tmp_path),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    report = (folder / "report.md").read_text()
    assert "## Mix `structured`" in report and "## Counter check" in report
    for name in ("throughput_structured.png", "cost_structured.png", "latency_cdf_structured.png"):
        assert (folder / name).stat().st_size > 1000

    data = json.loads((folder / "cells.json").read_text())
    cells = {c["policy"]: c for c in data["cells"]}
    assert set(cells) == {"plain", "static"}
    for policy, c in cells.items():
        assert c["errors"] == [] and c["requests"] > 0 and c["failures"] == 0, c
        assert abs(c["output_tokens"] - c["server"]["generation_tokens"]) <= max(
            1, 0.01 * c["output_tokens"]
        ), c
        assert c["server"]["requests"] == c["requests"]
        assert 0.5 * c["window_s"] <= c["replica_seconds"] <= 1.5 * c["window_s"]  # one replica, all along
        assert c["cost_per_1m_tokens"] > 0 and c["tokens_per_s"] > 0
        assert c["latency_s"]["p50"] <= c["latency_s"]["p99"] and c["ttft_s"]["p50"] <= c["latency_s"]["p50"]
        cell = folder / "structured" / policy / "u2"
        assert (c["locust_requests"], c["locust_tokens"]) == (c["requests"], c["output_tokens"])
        with open(cell / "locust_stats.csv") as f:  # Locust's CSVs are there (written every second)
            assert "Aggregated" in {r["Name"] for r in csv.DictReader(f)}
        # Per workload in Locust's final statistics: the CSV's last write can come before requests
        # that finish in the stop-timeout drain (all of them on a slow machine); the JSON is final.
        final = json.loads((cell / "locust_stats.json").read_text())
        assert {e["name"] for e in final if e.get("method") == "POST"} >= {"code", "json"}
        assert sum(1 for line in (cell / "records.jsonl").read_text().splitlines() if line) == c["requests"]
        assert "[specserve] shutting down" in (cell / "server.log").read_text()  # stopped cleanly
        # The speculation counters scraped every second add up to the server's over the cell.
        points = json.loads((cell / "timeline.json").read_text())["points"]
        accepted = sum(v for key, v in points[-1][2].items() if key.startswith("accepted|"))
        assert len(points) >= 2 and accepted == pytest.approx(c["server"]["accepted_tokens"], rel=0.02)
    plain, static = cells["plain"], cells["static"]
    assert "![speculation_structured_static_u2.png](speculation_structured_static_u2.png)" in report
    assert (folder / "speculation_structured_static_u2.png").stat().st_size > 10_000
    assert plain["acceptance"] is None and plain["server"]["draft_tokens"] == 0
    assert static["acceptance"] and static["server_acceptance"] == pytest.approx(
        static["acceptance"], abs=0.01
    )
    assert plain["savings_vs_plain"] == 0 and static["speedup_vs_plain"] is not None
