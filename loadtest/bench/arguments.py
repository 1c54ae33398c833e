"""The flags of ``specserve bench`` (the command line adds the runtime flags: model, dtype, ...,
and ``--draft``, the draft model of the model-based methods and of transformers' assisted one)."""

from __future__ import annotations

import argparse

from loadtest.bench.sweeps import SWEEP_AUTO, SWEEP_PLAIN, sweep_mode_choices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's own flags to ``parser``."""
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup",
        choices=["each", "first"],
        default="each",
        help="one warm-up run of every method before each prompt (each) or only before the first (first)",
    )
    parser.add_argument("--kinds", nargs="*", help="prompt kinds to run: code json chat prose (default: all)")
    parser.add_argument(
        "--methods",
        nargs="+",
        metavar="METHOD",
        help="methods to run (default: all): specserve-plain, specserve-auto, specserve-<proposer>-d<k> for "
        "a model-based proposer (k of --depths or any), specserve-<proposer> for a lookup, "
        "specserve-<proposer> and specserve-<proposer>-default for a layer-skipping one, "
        "transformers-plain, transformers-assisted, transformers-lookup",
    )
    parser.add_argument(
        "--depths", nargs="+", type=int, default=[2, 4, 6, 8], help="draft depths (default: 2 4 6 8)"
    )
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers methods")
    parser.add_argument(
        "--sweep",
        nargs="+",
        type=int,
        metavar="C",
        help="also measure plain vs speculative throughput at these concurrencies (e.g. 1 2 4 8 16)",
    )
    parser.add_argument(
        "--sweep-modes",
        nargs="+",
        choices=sweep_mode_choices(),
        help=f"modes of --sweep (default: {SWEEP_PLAIN} and every proposer but trained heads; a "
        f"layer-skipping proposer runs at its calibrated depth; {SWEEP_AUTO}: the configured policy decides)",
    )
    parser.add_argument(
        "--cost-curve",
        action="store_true",
        help="also time target forwards of 1..32 tokens per row at batch 1 and 8, and the draft step",
    )
    parser.add_argument(
        "--policies",
        action="store_true",
        help="compare the speculation policies instead: simulated from acceptance traces (and, with "
        "--real-loads, real engine runs); see loadtest/bench/policies.py",
    )
    parser.add_argument(
        "--traces", help="--policies: trace file to replay (default: the shipped Qwen traces)"
    )
    parser.add_argument("--record-traces", metavar="PATH", help="--policies: record traces (and cost) first")
    parser.add_argument("--loads", nargs="+", type=int, help="--policies: simulated load levels (1..32)")
    parser.add_argument("--real-loads", nargs="+", type=int, help="--policies: load levels to run for real")
    parser.add_argument(
        "--mix-repeats",
        type=int,
        help="--policies: interleaved rounds of the real mixed workload (default: --repeats)",
    )
    parser.add_argument(
        "--no-priors",
        action="store_true",
        help="--policies: start every policy from what a fresh engine assumes (each proposer's "
        "cold acceptance, else the estimator's default), not from the traces' pooled acceptance",
    )
    parser.add_argument(
        "--estimator",
        nargs="+",
        metavar="NAME=VALUE",
        help="--policies: acceptance estimator parameters for the simulation (alpha, prior_weight, "
        "pool_alpha, relax, default, decay; see policies/acceptance.py), e.g. pool_alpha=0.05",
    )
    parser.add_argument(
        "--sampling-schemes",
        action="store_true",
        help="compare the sampling schemes instead (coupled vs rejection: acceptance and tok/s of sampled "
        "requests at temperatures 0.7 and 1.0, chat and prose prompts); see loadtest/bench/schemes.py",
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="measure the weight formats' quality instead (perplexity and top-1 agreement with float32 "
        "on 8 x --max-tokens tokens of textwrap.py); see loadtest/bench/quality.py",
    )
    parser.add_argument(
        "--first-minute",
        action="store_true",
        help="measure a new replica's first minute instead, warm from Redis vs cold (--users requests at a "
        "time, --max-tokens each; needs stats.redis_url); see loadtest/bench/first_minute.py",
    )
    parser.add_argument(
        "--users", type=int, default=4, help="--first-minute: concurrent requests (default 4)"
    )
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="--first-minute: seconds measured per replica"
    )
    parser.add_argument(
        "--fill-s", type=float, default=60.0, help="--first-minute: seconds the first replica fills Redis"
    )
    parser.add_argument("--window-s", type=float, default=10.0, help="--first-minute: the table's window")
    parser.add_argument(
        "--server-path",
        action="store_true",
        help="also stream each prompt through `specserve serve` (started here, same settings) with the "
        "openai client, plain and auto, against the same methods in-process (needs --methods with "
        "specserve-plain and specserve-auto); see loadtest/bench/server_path.py",
    )
    parser.add_argument("--out", default="bench-results", help="folder for the JSON and Markdown results")
