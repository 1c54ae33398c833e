"""The load test's chaos cell end to end, small: ``specserve loadtest --chaos kill-replica`` on two
SmolLM2 replicas (prompt lookup) under 4 users.

Halfway through the load one engine replica is killed. What must hold (issue 21's first chaos
case, as a load-test cell): the report has the fault's row; Serve brings the deployment back to two
replicas within the cell; every failure is clean (an error event or an HTTP error in OpenAI's shape,
never a cut stream); requests fail only if they were in flight at the kill or started within the
two seconds the router needs to drop the dead replica; and every later request succeeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.analysis import read_records
from loadtest.chaos import clean_failure
from tests.loadtest.test_ramp_e2e import MODEL, SECONDS_DELAYS

ROUTER_GRACE_S = 2.0  # tests/serve/test_replica_failure_e2e.py: requests succeed from 2 s after a kill


@pytest.mark.slow
@pytest.mark.pack(MODEL)
def test_a_replica_killed_mid_cell_costs_only_its_requests(tmp_path: Path, smollm2_path: Path) -> None:
    command = [
        sys.executable, "-m", "specserve.cli", "loadtest", "--model", MODEL, "--method", "ngram",
        "--policies", "goodput", "--users", "4", "--min-replicas", "2", "--max-replicas", "2",
        "--slots", "2", "--run-time", "40", "--max-requests", "0", "--max-tokens", "48",
        "--mixes", "mixed", "--chaos", "kill-replica", "--chaos-at", "0.3", "--cpus", "2",
        "--out", str(tmp_path),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")} | SECONDS_DELAYS
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]  # failures clean: survived
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (cell,) = json.loads((folder / "cells.json").read_text())["cells"]
    chaos = cell["chaos"]
    assert chaos["error"] is None and "killed" in chaos["detail"], (chaos, run.stdout[-3000:])
    # Two replicas again: Serve saw one fewer and started a replacement (a model load: seconds).
    assert chaos["recovered_after_s"] is not None and chaos["recovered_after_s"] > 1.0, chaos
    assert chaos["unclean_failures"] == 0, chaos
    assert "Chaos: the fault injected" in (folder / "report.md").read_text()

    records = read_records(folder / "mixed" / "goodput" / "u4" / "records.jsonl")
    kill = chaos["at"]
    failed = [r for r in records if not r.ok]
    assert all(clean_failure(r) for r in failed), [r.error for r in failed]
    assert all(r.start <= kill + ROUTER_GRACE_S for r in failed), [(r.start - kill, r.error) for r in failed]
    later = [r for r in records if r.start > kill + ROUTER_GRACE_S]
    assert later and all(r.ok for r in later)
    assert cell["requests"] - cell["failures"] > len(later) > 0
