"""`specserve bench --policies`: how the speculation policies compare, simulated and for real.

Three parts, one command:

1. **Traces** (``--record-traces PATH``, ``policies_traces``): each prompt of the catalogue's
   ``TRACES`` set (code, JSON, chat and prose, written for this benchmark; ``loadtest.catalogue``)
   runs greedily once per loaded proposer at a fixed depth;
   the draft model's per-position ``matches`` come exactly from a teacher-forced forward over the
   output, the n-gram's from each decode step's (position, drafted, accepted) (a
   ``policies.traces.RecordedTrace``). The cost model is profiled on the same engine (the replica's
   start-up profile, heavy batches included) and saved beside the traces. The repository ships
   one such file for the Qwen2.5-Coder 1.5B / 0.5B pair on the 2-core CPU (``DEFAULT_TRACES``).
2. **Simulation** (``policies_sim``): the traces replayed through every registered policy (static
   at the depth the benchmarks found best, batch-threshold, heuristic, goodput, bandit, plain) at
   each load level (requests kept in flight: 1..32), beside the oracle best static (proposer,
   depth) found by trying every one; then the mixed workload (``mix_phases``): code and prose at
   low load, a burst of heavy batch load, low load again, under one policy instance.
3. **Real runs** (``--real-loads``, ``policies_real``): the same prompts through the engine,
   closed loop (a finished request is replaced at once, as a load-test user would), for plain,
   the best static depth and goodput, at a few load levels and over the mix. Emitted tokens /
   wall time, prefills included. The engine runs on a cost model profiled on this machine first
   (the trace file's, which the simulation replays, may have been measured on other hardware).

What both compare (the policies, the fixed arm, the mix's shape) is in ``policies_setup``; this
module is the command: it records, loads the traces, runs both halves and writes the report.

Priors. A replica reads each (proposer, workload)'s acceptance from the shared statistics when it
admits a request, so in steady state a request starts from the cluster's experience, not from the
estimator's default. Both the simulation and the real runs start every policy from the same priors:
the traces' pooled acceptance per (proposer, workload) (``policies.traces.acceptance_priors``), what
the shared statistics hold after serving these prompts. ``--no-priors`` starts from what a fresh
engine assumes instead (a cold cluster: each proposer's registered cold acceptance, else the
estimator's default). The priors come from the very prompts being run: they are the best case of
the cluster's experience, not a forecast.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import policies
from loadtest.bench.engine import bench_engine
from loadtest.bench.policies_real import real_markdown, real_prompts, run_real
from loadtest.bench.policies_setup import BEST_STATIC, REAL_POLICIES, RECORD_DEPTH, Priors, arm_label
from loadtest.bench.policies_sim import run_simulation, simulation_markdown
from loadtest.bench.policies_traces import record_traces
from loadtest.catalogue import TRACES, of_kinds
from policies import FittedCostModel
from policies.acceptance import ANY, AcceptanceEstimator
from policies.traces import RecordedTrace, TraceSet, acceptance_priors
from serve_app.config import Settings
from serve_app.engine.proposers.registry import DEFAULT_PROPOSER, cold_acceptance, proposer_spec

DEFAULT_TRACES = Path(policies.__file__).parent / "traces" / "qwen2.5-coder-1.5b-0.5b-cpu.json"
LOADS = (1, 2, 4, 8, 16, 32)


def cost_comparison(traces: FittedCostModel, here: FittedCostModel, proposers: Sequence[str]) -> str:
    """One line: the trace file's cost model against the one just profiled for the real runs."""
    shapes = [(1, 1), (1, 5), (16, 1)]
    parts = [
        f"target {rows} row(s) x {tokens} token(s) {here.target_time(rows, tokens, 64) * 1e3:.1f} ms "
        f"(traces: {traces.target_time(rows, tokens, 64) * 1e3:.1f})"
        for rows, tokens in shapes
    ]
    for p in proposers:
        mine, theirs = here.draft_time(p, 1, 64), traces.draft_time(p, 1, 64)
        if max(mine, theirs) < 1e-4:  # free proposers (n-gram)
            continue
        parts.append(f"{p} step {mine * 1e3:.1f} ms (traces: {theirs * 1e3:.1f})")
    return (
        "Real runs: the cost model profiled on this machine at the start, as a replica without a cached "
        "one does (the trace file's may come from other hardware; the simulation keeps it), at context 64: "
        + "; ".join(parts)
        + ".\n"
    )


# The estimator's numeric keyword parameters, read off its signature (max_depth is the benchmark's).
ESTIMATOR_OPTIONS = tuple(
    name
    for name, param in inspect.signature(AcceptanceEstimator).parameters.items()
    if param.kind is param.KEYWORD_ONLY and name not in ("model_pair", "max_depth")
)


def cold_priors(traces: Sequence[RecordedTrace]) -> Priors:
    """What a cold cluster starts from (``--no-priors``): each traced proposer's registered cold
    acceptance for every workload, as ``SpecEngine`` seeds its planner; other proposers get the
    estimator's default."""
    names = list(dict.fromkeys(p for t in traces for p in t.matches))
    return {(name, ANY): rates for name, rates in cold_acceptance(names).items()}


def estimator_options(items: Sequence[str]) -> dict[str, float]:
    """``NAME=VALUE`` items (``--estimator``) as ``AcceptanceEstimator`` keyword arguments."""
    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in ESTIMATOR_OPTIONS:
            names = ", ".join(ESTIMATOR_OPTIONS)
            raise ValueError(f"--estimator wants NAME=VALUE with NAME one of {names}: {item!r}")
        try:
            options[name] = float(value)
        except ValueError:
            raise ValueError(f"--estimator {name}: not a number: {value!r}") from None
    return options


def model_pair(settings: Settings) -> str:
    """``target+model`` of the traces: the target and the model the default proposer drafts with."""
    role = proposer_spec(DEFAULT_PROPOSER).model_role
    second = getattr(settings.model, role) if role else None
    return "+".join(m for m in (settings.model.target, second) if m)


def run_policy_bench(args: Any, settings: Settings) -> int:
    """The `--policies` mode of `specserve bench` (see the module docstring)."""
    loads = sorted(set(args.loads or LOADS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"Command: `{' '.join(['specserve', *sys.argv[1:]])}`", ""]
    prompts = of_kinds(TRACES, args.kinds)
    engine = None
    if args.record_traces or args.real_loads:
        # The fixed arm's proposer, and what a replica of these settings loads.
        engine = bench_engine(settings, [BEST_STATIC[0]], optional=settings.speculation.loaded_proposers(),
                              max_slots=max([*loads, *(args.real_loads or [])]), depth=RECORD_DEPTH,
                              n=args.max_tokens)  # fmt: skip
    if args.record_traces:
        print("profiling the cost model ...", file=sys.stderr)
        cost = engine.profile_cost_model()
        traces = TraceSet(
            model_pair(settings),
            tuple(record_traces(engine, prompts, args.max_tokens, log=lambda s: print(s, file=sys.stderr))),
            cost.to_dict(), notes=f"recorded by: specserve {' '.join(sys.argv[1:])}",
        )  # fmt: skip
        traces.save(args.record_traces)
        print(f"wrote {args.record_traces}", file=sys.stderr)
    trace_path = Path(args.record_traces or args.traces or DEFAULT_TRACES)
    traces = TraceSet.load(trace_path)
    cost = FittedCostModel.from_dict(traces.cost_model)
    cost.reset_corrections()  # the profile's fit; online corrections are the recording run's
    priors = cold_priors(traces.traces) if args.no_priors else acceptance_priors(traces.traces, RECORD_DEPTH)
    options = estimator_options(args.estimator or [])
    table = run_simulation(traces.traces, cost, loads, priors=priors, estimator=options)
    if options:
        given = ", ".join(f"{k}={v:g}" for k, v in options.items())
        sections.append(f"Estimator (simulation only; the real runs use the defaults): {given}\n")
    sections.append("Priors: " + ("what each proposer registered as its cold acceptance, else the "
                    "estimator's default (a cold cluster, `--no-priors`)." if args.no_priors
                    else "the traces' pooled acceptance per (proposer, workload), as the shared statistics "
                    "would hold them (see loadtest/bench/policies.py).") + "\n")  # fmt: skip
    sections.append(simulation_markdown(table, traces))
    if args.real_loads:
        names = list(REAL_POLICIES)
        mix_best = table.mix_oracle[0]  # the simulation's best single static over the mix, run too
        if mix_best[0] is not None and mix_best != BEST_STATIC:
            names.insert(2, arm_label(mix_best))
        real_cost = cost
        if not args.record_traces:  # the trace file's cost model may come from other hardware
            print("profiling the cost model on this machine ...", file=sys.stderr)
            real_cost = engine.profile_cost_model()
            sections.append(cost_comparison(cost, real_cost, list(engine.proposers)))
        real, mix = run_real(engine, real_prompts(prompts), real_cost, sorted(set(args.real_loads)),
                             args.max_tokens, names, args.repeats, lambda s: print(s, file=sys.stderr),
                             priors, args.mix_repeats)  # fmt: skip
        sections.append(real_markdown(real, mix, args.max_tokens, args.repeats, args.mix_repeats))
    markdown = "\n".join(sections)
    stem = out / f"policies-{time.strftime('%Y%m%d-%H%M%S')}.md"
    stem.write_text(markdown)
    print(markdown)
    print(f"wrote {stem}", file=sys.stderr)
    return 0
