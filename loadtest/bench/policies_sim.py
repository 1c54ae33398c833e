"""The simulated half of ``specserve bench --policies``: recorded traces replayed through every
registered policy (the fixed one at ``BEST_STATIC``) at each load level (requests kept in
flight), beside the oracle best fixed arm (proposer, depth) found by trying every one; then the
mixed workload (``mix_phases``) under one policy instance. Emitted tok/s comes from the measured
cost model (``policies.simulate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.bench.policies_setup import (
    BEST_STATIC,
    MIX_BURST,
    MIX_LOW,
    MIX_REPEAT,
    RECORD_DEPTH,
    Priors,
    arm_label,
    compared_policies,
    quiet,
)
from loadtest.bench.policies_traces import kind_of
from policies import DEFAULT_POLICY, FIXED_POLICY, PLAIN_POLICY, FittedCostModel, PolicyConfig, create_policy
from policies.simulate import (
    Phase,
    SimResult,
    Trace,
    oracle_best_static,
    replay,
    simulate,
    simulate_mix,
    static_policy,
)
from policies.traces import RecordedTrace, TraceSet


def make_policy(name: str, max_depth: int) -> Any:
    """The policy ``name``, its default arm ``BEST_STATIC`` (the fixed policy: that arm alone)."""
    if name == FIXED_POLICY:
        return static_policy(BEST_STATIC, max_depth)
    proposer, depth = BEST_STATIC
    config = PolicyConfig(default_proposer=proposer, default_depth=depth, max_depth=max_depth)
    return create_policy(name, config)


def mix_phases(traces: Sequence[Trace], kinds: Sequence[str], repeat: int = MIX_REPEAT) -> list[Phase]:
    """Code and prose at low load, a burst of heavy batch load (every trace), low load again."""
    calm = quiet(traces, kinds)
    return [Phase(calm, MIX_LOW), Phase(list(traces) * repeat, MIX_BURST), Phase(calm, MIX_LOW)]


@dataclass
class SimTable:
    """Simulated tok/s (and draft depth) per policy and load, the oracle, the mix."""

    loads: list[int]
    policies: list[str]
    rate: dict[str, dict[int, float]]  # policy -> load -> tok/s
    depth: dict[str, dict[int, float]]  # policy -> load -> mean draft depth per request-step
    oracle: dict[int, tuple[tuple[str | None, int], float]]  # load -> (best static arm, tok/s)
    mix: dict[str, float]  # policy -> tok/s over the mix
    mix_oracle: tuple[tuple[str | None, int], float]


def run_simulation(traces: Sequence[RecordedTrace], cost: FittedCostModel, loads: Sequence[int],
                   max_depth: int = RECORD_DEPTH, seed: int = 0, priors: Priors | None = None,
                   estimator: dict[str, float] | None = None) -> SimTable:  # fmt: skip
    """Every compared policy at every load, and over the mix, from the same ``priors`` (and
    acceptance ``estimator`` options); the oracle best fixed arm beside each."""
    base = replay(traces)
    names = compared_policies()
    rate: dict[str, dict[int, float]] = {p: {} for p in names}
    depth: dict[str, dict[int, float]] = {p: {} for p in names}
    oracle = {}
    for load in loads:
        sim = base * max(1, -(-2 * load // len(base)))  # at least two requests per slot
        for name in names:
            result = simulate(make_policy(name, max_depth), sim, cost, load, max_depth=max_depth, seed=seed,
                              priors=priors, estimator_options=estimator)  # fmt: skip
            rate[name][load], depth[name][load] = result.tokens_per_second, result.mean_draft_depth
        arm, best, _ = oracle_best_static(sim, cost, load, max_depth=max_depth, seed=seed)
        oracle[load] = (arm, best.tokens_per_second)
    phases = mix_phases(base, [kind_of(t) for t in traces])
    mix = {n: simulate_mix(make_policy(n, max_depth), phases, cost, max_depth=max_depth, seed=seed,
                           priors=priors, estimator_options=estimator) for n in names}  # fmt: skip
    arms = [(None, 0)] + [(p, d) for p in base[0].proposers() for d in range(1, max_depth + 1)]
    mixed: dict[tuple[str | None, int], SimResult] = {
        arm: simulate_mix(static_policy(arm, max_depth), phases, cost, max_depth=max_depth, seed=seed)
        for arm in arms
    }
    best_arm = max(mixed, key=lambda a: mixed[a].tokens_per_second)
    return SimTable(list(loads), names, rate, depth, oracle, {n: r.tokens_per_second for n, r in mix.items()},
                    (best_arm, mixed[best_arm].tokens_per_second))  # fmt: skip


def simulation_markdown(table: SimTable, traces: TraceSet) -> str:
    """The per-load table (every policy, the oracle, the default policy's ratios) and the mix's."""
    kinds = statistics_of(traces)
    lines = [
        "### Simulated (recorded traces, measured cost model)", "",
        f"{len(traces.traces)} traces ({kinds}) on {traces.model_pair}; each load level keeps that many "
        "requests in flight. Cells: emitted tok/s (mean draft depth per request-step).", "",
    ]  # fmt: skip
    ratios = [f"{DEFAULT_POLICY} / best static", f"{DEFAULT_POLICY} / {PLAIN_POLICY}"]
    head = ["load", *table.policies, "oracle best static", *ratios]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for load in table.loads:
        arm, best = table.oracle[load]
        cells = [str(load)]
        cells += [f"{table.rate[p][load]:.2f} ({table.depth[p][load]:.1f})" for p in table.policies]
        good = table.rate.get(DEFAULT_POLICY, {}).get(load)
        cells += [f"{best:.2f} ({arm_label(arm)})", f"{good / best:.3f}x" if good else "-",
                  f"{good / table.rate[PLAIN_POLICY][load]:.3f}x" if good else "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    arm, best = table.mix_oracle
    lines += [
        "", f"Mixed workload (code + prose prompts at {MIX_LOW} in flight, a burst of every trace "
        f"{MIX_REPEAT}x at up to {MIX_BURST} in flight, code + prose again; one policy instance "
        "throughout):", "",
        "| policy | tok/s | / best single static |", "|---|---|---|",
    ]  # fmt: skip
    for name in table.policies:
        lines.append(f"| {name} | {table.mix[name]:.2f} | {table.mix[name] / best:.3f}x |")
    lines.append(f"| oracle best single static ({arm_label(arm)}) | {best:.2f} | 1.000x |")
    return "\n".join([*lines, ""])


def statistics_of(traces: TraceSet) -> str:
    """How many traces of each prompt kind: ``"code 4, json 3, ..."``."""
    counts: dict[str, int] = {}
    for t in traces.traces:
        counts[kind_of(t)] = counts.get(kind_of(t), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
