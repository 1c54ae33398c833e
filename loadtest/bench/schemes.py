"""`specserve bench --sampling-schemes`: what coupled sampling costs in acceptance, against rejection
sampling, for sampled requests speculating with the default proposer.

Coupled (``EngineConfig.sampling = "coupled"``, the default): each token is the exponential race of
the target's p under noise fixed by (seed, position); the draft races q under the same noise and a
draft token is kept iff both races have the same winner. Rejection: the draft samples from q and
the target keeps it with probability min(1, p/q). The second keeps more drafts in theory (its
acceptance is 1 - TV(p, q) per token, the race's at most that), the first makes seeded output the
same with speculation on or off. Both engines share the weights, proposers and KV cache, one run
after the other: for every (temperature, prompt, seed) both schemes run back to back, in
alternating order, so a drifting machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from loadtest.bench.engine import bench_engine
from loadtest.bench.results import write_table
from loadtest.catalogue import TRACES, of_kinds
from serve_app.config import Settings
from serve_app.engine.engine_config import SAMPLING_SCHEMES
from serve_app.engine.proposers.registry import DEFAULT_PROPOSER

TEMPERATURES = (0.7, 1.0)
KINDS = ("chat", "prose")  # the creative and chat workloads: where sampling is asked for


def scheme_engines(engine: Any) -> dict[str, Any]:
    """One engine per sampling scheme over the same weights, proposers and cache."""
    from serve_app.engine.engine import SpecEngine

    def with_scheme(scheme: str) -> Any:
        config = replace(engine.config, sampling=scheme)
        return SpecEngine(
            engine.model, engine.tokenizer, config, engine.eos_ids, engine.proposers, cache=engine.cache
        )

    return {scheme: with_scheme(scheme) for scheme in SAMPLING_SCHEMES}


def run_once(
    engine: Any, ids: list[int], n: int, temperature: float, seed: int, depth: int
) -> dict[str, float]:
    """One sampled request speculating with the default proposer: its time and draft counts."""
    from serve_app.engine.params import SamplingParams, SpecOverride

    params = SamplingParams(max_tokens=n, temperature=temperature, seed=seed, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate([ids], params, [SpecOverride(DEFAULT_PROPOSER, depth)])[0]
    stats = done.spec_stats
    return {
        "seconds": time.perf_counter() - start,
        "tokens": len(done.token_ids),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "steps": stats.spec_steps,
    }


def summary(scheme: str, temperature: float, results: list[dict[str, float]]) -> dict[str, Any]:
    """One table row: acceptance over every draft token, mean accepted length, median tok/s."""
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    steps = sum(r["steps"] for r in results)
    return {
        "scheme": scheme,
        "temperature": temperature,
        "requests": len(results),
        "drafted": drafted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
        "median_tok_s": statistics.median(r["tokens"] / r["seconds"] for r in results),
    }


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    lines = [title, "", "| temperature | scheme | requests | drafted | acceptance | mean accepted length | "
             "median tok/s |", "|---" * 7 + "|"]  # fmt: skip
    for r in rows:
        cells = [r["temperature"], r["scheme"], r["requests"], r["drafted"], f"{r['acceptance']:.3f}",
                 f"{r['mean_accepted_length']:.2f}", f"{r['median_tok_s']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def compare_schemes(args: argparse.Namespace, settings: Settings) -> int:
    """Run the comparison (see the module docstring), print and write a Markdown table."""
    kinds = args.kinds or list(KINDS)
    prompts = of_kinds(TRACES, kinds)  # the policy traces' set: three chat and three prose prompts
    depth, n = settings.speculation.depth, args.max_tokens
    engine = bench_engine(settings, [DEFAULT_PROPOSER], max_slots=1, depth=depth, n=n)
    engines = scheme_engines(engine)
    runs: dict[tuple[float, str], list[dict[str, float]]] = {}
    order = list(SAMPLING_SCHEMES)
    for temperature in TEMPERATURES:
        for prompt in prompts:
            ids = engine.encode_prompt(prompt.text, chat=prompt.chat)
            for seed in range(args.repeats):
                order.reverse()
                for scheme in order:
                    result = run_once(engines[scheme], ids, n, temperature, seed, depth)
                    runs.setdefault((temperature, scheme), []).append(result)
                    print(
                        f"[schemes] T={temperature} {prompt.name} seed {seed} {scheme}: {result}",
                        file=sys.stderr,
                    )
    rows = [summary(scheme, temperature, results) for (temperature, scheme), results in sorted(runs.items())]
    title = (f"Sampling schemes: {settings.model.target} + {DEFAULT_PROPOSER} at depth {depth}, {n} tokens, "
             f"{', '.join(kinds)} prompts, {args.repeats} seed(s) each")  # fmt: skip
    text = markdown(rows, title)
    write_table(args.out, "schemes", text, rows)
    return 0
