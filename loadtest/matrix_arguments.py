"""The ``specserve loadtest`` flags (the runner is ``loadtest.run_matrix``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.chaos import CHAOS_KINDS
from loadtest.workloads import MIXES
from policies.registry import DEFAULT_POLICY, FIXED_POLICY, PLAIN_POLICY
from serve_app.config import OFF
from serve_app.engine.proposers.registry import registered_proposers

RESULTS = Path(__file__).resolve().parent / "results"
FIRST_POLICIES = (PLAIN_POLICY, FIXED_POLICY, DEFAULT_POLICY)  # then every other registered policy
STATIC_DEPTH = 4  # the best fixed draft depth in BENCHMARKS.md (Qwen pair, draft model)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``specserve loadtest`` flags (defaults: the full matrix on the settings' models)."""
    p.add_argument("--model", help="target model (default: settings)")
    p.add_argument("--draft", dest="draft_model", help="draft model (default: settings)")
    p.add_argument(
        "--method", choices=[OFF, *registered_proposers()], help="proposer for 'auto' (default: settings)"
    )
    p.add_argument(
        "--policies",
        nargs="+",
        help=f"policies (default: {' '.join(FIRST_POLICIES)}, then every other registered)",
    )
    p.add_argument(
        "--users", nargs="+", type=int, default=[1, 4, 16, 32], help="load levels (default: 1 4 16 32)"
    )
    p.add_argument(
        "--mixes", nargs="+", default=["mixed"], choices=sorted(MIXES), help="workload mixes (default: mixed)"
    )
    p.add_argument("--run-time", type=float, default=90.0, help="seconds of load per cell (default: 90)")
    p.add_argument(
        "--max-requests", type=int, default=500, help="at most this many requests per cell (0: no bound)"
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=240.0,
        help="seconds requests running at the end of --run-time may take to finish (default: 240)",
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds (one request per workload) per cell")
    p.add_argument("--max-tokens", type=int, default=0, help="cap every workload's max_tokens (0: no cap)")
    p.add_argument(
        "--static-depth",
        type=int,
        default=STATIC_DEPTH,
        help=f"depth of the fixed-depth policy {FIXED_POLICY!r} (default: 4)",
    )
    p.add_argument(
        "--policy-params",
        action="append",
        default=[],
        metavar="POLICY=JSON",
        help='params of one policy, e.g. \'batch-threshold={"table": {"1": 6, "8": 2}}\'',
    )
    p.add_argument("--slots", type=int, help="KV slots per replica (default: settings)")
    p.add_argument("--min-replicas", type=int, help="fewest engine replicas per cell (default: settings)")
    p.add_argument(
        "--max-replicas",
        type=int,
        help="most engine replicas per cell: autoscaling above min (default: settings)",
    )
    p.add_argument(
        "--ramp",
        action="store_true",
        help="users climb from 1 to each load level and back over --run-time (loadtest.ramp), to watch "
        "autoscaling; the level is the peak",
    )
    p.add_argument(
        "--chaos",
        choices=CHAOS_KINDS,
        help="inject one fault into every cell (loadtest.chaos): kill an engine replica (use with "
        "--min-replicas 2) or kill and restart the cell's own Redis of shared statistics",
    )
    p.add_argument(
        "--chaos-at", type=float, default=0.5, help="when the fault comes, as a fraction of --run-time"
    )
    p.add_argument(
        "--chaos-outage-s", type=float, default=5.0, help="seconds Redis stays down (restart-redis)"
    )
    p.add_argument(
        "--price", type=float, help="USD per replica-hour (default: settings loadtest.replica_hour_price)"
    )
    p.add_argument(
        "--until-saturation", action="store_true", help="skip a policy's higher loads once saturated"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompt choice and sampling")
    p.add_argument("--cpus", type=int, help="CPUs of the local Ray cluster (default: the machine's)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--out", default=str(RESULTS), help="results root folder")
