"""The real half of ``specserve bench --policies``: the prompts through the engine, closed loop (a
finished request is replaced at once, as a load-test user would), per policy at a few load
levels and over the mixed workload; emitted tokens / wall time, prefills included. Policies run
in interleaved rounds (``run_real``), each on an engine over the same model, proposers and KV
cache, with the measured cost model and the same priors (``policy_engine``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from loadtest.bench.policies_setup import (
    BEST_STATIC,
    MIX_BURST,
    MIX_LOW,
    MIX_REPEAT,
    Priors,
    arm_label,
    quiet,
    real_policy,
)
from loadtest.catalogue import Prompt
from policies import DEFAULT_POLICY, FIXED_POLICY, PLAIN_POLICY, FittedCostModel

REAL_PER_KIND = 2  # real runs use the first prompts of each kind (bounded time)


def real_prompts(prompts: Sequence[Prompt], per_kind: int = REAL_PER_KIND) -> list[Prompt]:
    """The first ``per_kind`` prompts of each kind, in order."""
    kinds = [p.kind for p in prompts]
    return [p for i, p in enumerate(prompts) if i < kinds.index(p.kind) + per_kind]


@dataclass
class RealRun:
    """One policy's closed-loop run (or the median of its rounds, with every round's rate)."""

    policy: str
    load: int
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    rounds: tuple[float, ...] = ()  # every repeat's tok/s, in round order (see ``run_real``)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def closed_loop(engine: Any, requests: Sequence[list[int]], load: int, n: int, mode: str = "auto") -> RealRun:
    """Keep ``load`` requests in flight until all ``requests`` are done; emitted tokens / wall time."""
    from serve_app.engine.params import SamplingParams, SpecOverride

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    pending, running = list(reversed(requests)), set()
    tokens = drafted = accepted = 0
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < load:
            running.add(engine.add_request(pending.pop(), params, speculation=SpecOverride(mode)))
        for out in engine.step():
            tokens += len(out.new_token_ids)
            drafted, accepted = drafted + out.step_drafted, accepted + out.step_accepted
            if out.finished:
                running.discard(out.request_id)
    return RealRun("", load, tokens, time.perf_counter() - start, drafted, accepted)


def policy_engine(base: Any, policy: str, cost: FittedCostModel, priors: Priors | None = None) -> Any:
    """An engine over ``base``'s model, proposers and KV cache (run one at a time) under ``policy``
    (a ``real_policy`` label), with the measured cost model (as a replica takes the cluster's cached
    one) and ``priors`` per (proposer, workload) (as a replica reads them from the shared statistics)."""
    from serve_app.engine.engine import SpecEngine

    policy, (proposer, depth) = real_policy(policy)
    config = replace(base.config, spec_method=proposer, spec_depth=depth, policy=policy, policy_params={})
    engine = SpecEngine(base.model, base.tokenizer, config, base.eos_ids, base.proposers, cache=base.cache)
    engine.use_cost_model(FittedCostModel.from_dict(cost.to_dict()))
    for (proposer, workload), rates in (priors or {}).items():
        if proposer in engine.proposers:
            engine.planner.estimator.set_prior(proposer, workload, rates)
    return engine


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift``: round r of a real run takes the policies in this order."""
    k = shift % len(items) if items else 0
    return [*items[k:], *items[:k]]


def median_run(runs: Sequence[RealRun]) -> RealRun:
    """The median run by rate, carrying every run's rate in round order."""
    middle = sorted(runs, key=lambda r: r.rate)[len(runs) // 2]
    return replace(middle, rounds=tuple(r.rate for r in runs))


def run_real(base: Any, prompts: Sequence[Prompt], cost: FittedCostModel, loads: Sequence[int], n: int,
             policies_: Sequence[str], repeats: int, log: Callable[[str], None] = print,
             priors: Priors | None = None, mix_repeats: int | None = None,
             ) -> tuple[dict[str, dict[int, RealRun]], dict[str, RealRun]]:  # fmt: skip
    """Closed-loop runs per (policy, load), then the mix; each the median of ``repeats`` by rate
    (``mix_repeats`` for the mix, default ``repeats``).

    The repeats are interleaved: round r runs every policy once, in ``rotated`` order, before round
    r + 1 starts. A shared machine's speed drifts over minutes (a neighbour's memory traffic halves
    the bandwidth here at times); policy after policy in blocks would charge a slow spell to
    whichever policy ran in it, while rounds spread it over all of them, and each round's ratios
    compare runs minutes apart at most (``real_markdown`` reports the median of those too)."""
    encoded = [base.encode_prompt(p.text, chat=p.chat) for p in prompts]
    results: dict[str, dict[int, RealRun]] = {p: {} for p in policies_}
    warm = policy_engine(base, PLAIN_POLICY, cost)
    closed_loop(warm, encoded[:2], 2, 8)  # warm-up
    for load in loads:
        requests = [encoded[i % len(encoded)] for i in range(max(2 * load, len(encoded)))]
        runs: dict[str, list[RealRun]] = {p: [] for p in policies_}
        for round_ in range(repeats):
            for policy in rotated(policies_, round_):
                run = closed_loop(policy_engine(base, policy, cost, priors), requests, load, n)
                run.policy = policy
                runs[policy].append(run)
                log(
                    f"[real] load {load} round {round_ + 1} {policy}: {run.rate:.2f} tok/s, "
                    f"accepted {run.accepted}/{run.drafted}"
                )
        for policy in policies_:
            results[policy][load] = median_run(runs[policy])
    calm = quiet(encoded, [p.kind for p in prompts])
    phases = [(calm, MIX_LOW), (encoded * MIX_REPEAT, MIX_BURST), (calm, MIX_LOW)]
    mixes: dict[str, list[RealRun]] = {p: [] for p in policies_}
    for round_ in range(repeats if mix_repeats is None else mix_repeats):
        for policy in rotated(policies_, round_):
            # One engine through all phases: what it learns carries across them.
            engine = policy_engine(base, policy, cost, priors)
            parts = [closed_loop(engine, reqs, load, n) for reqs, load in phases]
            run = RealRun(policy, MIX_BURST, sum(p.tokens for p in parts), sum(p.seconds for p in parts),
                          sum(p.drafted for p in parts), sum(p.accepted for p in parts))  # fmt: skip
            mixes[policy].append(run)
            log(f"[real] mix round {round_ + 1} {policy}: {run.rate:.2f} tok/s")
    return results, {p: median_run(runs) for p, runs in mixes.items()}


def paired_ratio(good: RealRun, other: RealRun) -> float | None:
    """The median over rounds of ``good``'s rate (the default policy's) / the other's in the same
    round (None: no rounds)."""
    ratios = sorted(g / o for g, o in zip(good.rounds, other.rounds, strict=False) if o > 0)
    return ratios[len(ratios) // 2] if ratios else None


def _ratio_cells(good: RealRun, best: RealRun, plain: RealRun | None) -> list[str]:
    """The default policy against the best other (overall and paired) and against plain."""
    paired = paired_ratio(good, best)
    cells = [f"{good.rate / best.rate:.3f}x", "-" if paired is None else f"{paired:.3f}x"]
    return [*cells, f"{good.rate / plain.rate:.3f}x" if plain else "-"]


def real_markdown(
    results: dict[str, dict[int, RealRun]],
    mix: dict[str, RealRun],
    n: int,
    repeats: int,
    mix_repeats: int | None = None,
) -> str:
    """The table of the real runs: tok/s per policy and load (then the mix), and the default
    policy's ratios when it ran."""
    names = list(results)
    loads = sorted({load for r in results.values() for load in r})
    lines = [
        "### Real engine runs (closed loop)", "",
        f"Greedy, {n} tokens per request, EOS ignored; tok/s = emitted tokens / wall time (prefills "
        f"included), median of {repeats} interleaved rounds (each round runs every policy once). "
        f"{FIXED_POLICY} = {arm_label(BEST_STATIC)}. Paired: the median over rounds of {DEFAULT_POLICY} / "
        "best other within the round (robust to the machine's speed drifting between rounds).", "",
    ]  # fmt: skip
    ratios = [f"{DEFAULT_POLICY} / best other", "paired", f"{DEFAULT_POLICY} / {PLAIN_POLICY}"]
    head = ["load", *names, *(ratios if DEFAULT_POLICY in names else [])]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(str(load), {p: results[p][load] for p in names}) for load in loads]
    if mix:
        rows.append(("mix", mix))
    for label, runs in rows:
        cells = [label] + [f"{runs[p].rate:.2f}" for p in names]
        if DEFAULT_POLICY in names:
            best = max((runs[p] for p in names if p != DEFAULT_POLICY), key=lambda r: r.rate)
            cells += _ratio_cells(runs[DEFAULT_POLICY], best, runs.get(PLAIN_POLICY))
        lines.append("| " + " | ".join(cells) + " |")
    if mix:
        rounds = repeats if mix_repeats is None else mix_repeats
        lines += [
            "",
            f"mix (median of {rounds} rounds): code and prose one request at a time, a burst of "
            f"every prompt {MIX_REPEAT}x with up to {MIX_BURST} in flight, then code and prose again; "
            "one engine a run.",
        ]
    return "\n".join([*lines, ""])
