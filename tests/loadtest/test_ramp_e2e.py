"""The load test's autoscaling cell end to end, small: ``specserve loadtest --ramp --max-replicas 2``
on SmolLM2 (prompt lookup), with second-long scaling delays.

The users climb from 1 to 6 and back over 75 s against replicas of 2 slots: Serve adds the second
replica on the way up and removes it on the way down; the report's timeline shows both, no request
fails, and the cell's replica-seconds (what its cost is computed from) lie between one replica and
two over the window.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = "smollm2-135m-instruct"
SECONDS_DELAYS = {  # the autoscaling test's delays (tests/serve/test_autoscaling_e2e.py)
    "SPECSERVE_AUTOSCALING__UPSCALE_DELAY_S": "1",
    "SPECSERVE_AUTOSCALING__DOWNSCALE_DELAY_S": "3",
    "SPECSERVE_AUTOSCALING__LOOK_BACK_PERIOD_S": "2",
    "SPECSERVE_AUTOSCALING__REPLICA_NUM_CPUS": "1",
    "SPECSERVE_RUNTIME__THREADS": "1",
    "SPECSERVE_RUNTIME__DTYPE": "float32",
}


@pytest.mark.slow
@pytest.mark.pack(MODEL)
def test_a_ramp_scales_up_and_down_and_the_cost_counts_the_replica_seconds(
    tmp_path: Path, smollm2_path: Path
) -> None:
    command = [
        sys.executable, "-m", "specserve.cli", "loadtest", "--model", MODEL, "--method", "ngram",
        "--policies", "goodput", "--users", "6", "--ramp", "--max-replicas", "2", "--slots", "2",
        "--run-time", "75", "--max-requests", "0", "--max-tokens", "48", "--mixes", "mixed",
        "--cpus", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")} | SECONDS_DELAYS
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert "a ramp per cell" in (folder / "report.md").read_text()
    (cell,) = json.loads((folder / "cells.json").read_text())["cells"]
    assert cell["errors"] == [] and cell["failures"] == 0 and cell["requests"] > 0, cell

    points = json.loads((folder / "mixed" / "goodput" / "u6" / "timeline.json").read_text())["points"]
    replicas = [p[1] for p in points]
    up = replicas.index(2)  # the second replica came under the load
    assert replicas[up:].count(1) > 0, replicas  # and went once the users fell back to one
    waiting = [p[3]["waiting"] + p[3]["running"] for p in points]
    assert max(waiting) >= 3, waiting  # more requests than one replica's slots at the peak
    window = cell["window_s"]
    assert window < cell["replica_seconds"] < 2 * window, (cell["replica_seconds"], window)
