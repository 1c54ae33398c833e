"""`specserve bench --policies`: how the speculation policies compare, simulated and for real.

Three parts, one command:

1. **Traces** (``--record-traces PATH``): each prompt of ``TRACE_PROMPTS`` (code, JSON, chat and
   prose, written for this benchmark) runs greedily once per loaded proposer at a fixed depth;
   the draft model's per-position ``matches`` come exactly from a teacher-forced forward over the
   output, the n-gram's from each decode step's (position, drafted, accepted) (a
   ``policies.traces.RecordedTrace``). The cost model is profiled on the same engine (the replica's
   start-up profile, heavy batches included) and saved beside the traces. The repository ships
   one such file for the Qwen2.5-Coder 1.5B / 0.5B pair on the 2-core CPU (``DEFAULT_TRACES``).
2. **Simulation**: the traces replayed through every registered policy (static at the depth the
   benchmarks found best, batch-threshold, heuristic, goodput, bandit, plain) at each load level
   (requests kept in flight: 1..32), beside the oracle best static (proposer, depth) found by
   trying every one; then the mixed workload (``mix_phases``): code and prose at low load, a burst
   of heavy batch load, low load again, under one policy instance.
3. **Real runs** (``--real-loads``): the same prompts through the engine, closed loop (a finished
   request is replaced at once, as a load-test user would), for plain, the best static depth and
   goodput, at a few load levels and over the mix. Emitted tokens / wall time, prefills included.
   The engine runs on a cost model profiled on this machine first (the trace file's, which the
   simulation replays, may have been measured on other hardware).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import policies
from policies import FittedCostModel, PolicyConfig, classify, create_policy, registered_policies
from policies.acceptance import ANY, AcceptanceEstimator
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
from policies.traces import RecordedTrace, StepRecord, TraceSet, acceptance_priors, matches_from_steps
from serve_app.bench import Prompt
from serve_app.engine.proposers import cold_acceptance

DEFAULT_TRACES = Path(policies.__file__).parent / "traces" / "qwen2.5-coder-1.5b-0.5b-cpu.json"
LOADS = (1, 2, 4, 8, 16, 32)
RECORD_DEPTH = 8
Priors = dict[tuple[str, str], tuple[float, ...]]  # (proposer, workload) -> conditional acceptance
BEST_STATIC = ("draft", 4)  # the benchmarks' best fixed depth on code+json (BENCHMARKS.md)
# The mixed workload: interactive code and prose one request at a time, then a burst of every trace
# twice with up to 32 in flight, then interactive again.
MIX_LOW, MIX_BURST, MIX_REPEAT = 1, 32, 2
REAL_PER_KIND = 2  # real runs use the first prompts of each kind (bounded time)

TRACE_PROMPTS: list[Prompt] = [
    Prompt("code", "quicksort", "def quicksort(arr):", False),
    Prompt("code", "binary search", "def binary_search(items: list[int], target: int) -> int:", False),
    Prompt("code", "LRU cache", "Write a Python class implementing an LRU cache.", True),
    Prompt("code", "word count", "Write a Python function that counts how often each word occurs in a "
           "text file and returns the ten most common words.", True),
    Prompt("json", "people", "Extract each person's name, age, city and job as a JSON list of objects: "
           "Alice is a 34-year-old engineer living in Berlin. Bob, 27, works as a nurse in Madrid. "
           "Carol, a teacher from Toronto, is 45.", True),
    Prompt("json", "orders", "Return a JSON object with keys order_id, items (name, quantity, price) and "
           "total for this order: order 1182 has two notebooks at 3.50 each, one pen at 1.20 and three "
           "folders at 2.10 each.", True),
    Prompt("json", "config", "Write a JSON configuration for a web service with a server block (host, "
           "port, workers), a database block (url, pool size, timeout) and a logging block.", True),
    Prompt("chat", "sea poem", "Write a short poem about the sea at night.", True),
    Prompt("chat", "explain recursion", "Explain recursion to a new programmer, with one example.", True),
    Prompt("chat", "git advice", "How should a small team use git branches? Give practical advice.", True),
    Prompt("prose", "printing press", "The printing press changed Europe in ways that", False),
    Prompt("prose", "lighthouse", "The old lighthouse keeper climbed the stairs one last time, and", False),
    Prompt("prose", "rivers", "Rivers have shaped where people settle because", False),
]


# ------------------------------------------------------------------------------------ recording
def record_traces(engine: Any, prompts: Sequence[Prompt], n: int, depth: int = RECORD_DEPTH,
                  log: Callable[[str], None] = print) -> list[RecordedTrace]:  # fmt: skip
    """Each prompt, greedy, ``n`` tokens (EOS ignored), once per proposer at ``depth``.

    A proposer with a draft ``model`` (the draft model) also gets its matches exactly, by teacher
    forcing (``teacher_forced_matches``) over the output; a lookup proposer (n-gram) its matches
    and draft lengths exactly by replaying the lookup over the output (``lookup_trace``, no run of
    its own); any other from the recorded steps (``policies.traces.matches_from_steps``).
    """
    from serve_app.engine.proposers import LookaheadProposer
    from serve_app.engine.request import SpecOverride
    from serve_app.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    lookups = [p for p, obj in engine.proposers.items() if isinstance(obj, LookaheadProposer)]
    runs = [p for p in engine.proposers if p not in lookups] or ["off"]
    traces = []
    for prompt in prompts:
        ids = engine.encode_prompt(prompt.text, chat=prompt.chat)
        matches, draftable, workload = {}, {}, classify(prompt.text, None)
        for proposer in runs:
            steps, output, accepted, drafted = [], [], 0, 0
            for out in engine.stream(ids, params, SpecOverride(proposer, max_depth=depth)):
                if output:  # the first output is the prefill's token
                    steps.append(StepRecord(len(output) - 1, out.step_drafted, out.step_accepted))
                    accepted, drafted = accepted + out.step_accepted, drafted + out.step_drafted
                output += out.new_token_ids
            if proposer == "off":
                continue
            model = getattr(engine.proposers[proposer], "model", None)
            if model is not None and hasattr(model, "logits"):
                matches[proposer] = teacher_forced_matches(model, ids, output)
            else:
                matches[proposer] = matches_from_steps(steps, n - 1)
            log(f"[traces] {prompt.kind}/{prompt.name} {proposer}: accepted {accepted}/{drafted}")
        for proposer in lookups:
            matches[proposer], draftable[proposer] = lookup_trace(
                engine.proposers[proposer], ids, output, engine.config.max_depth
            )
            log(f"[traces] {prompt.kind}/{prompt.name} {proposer}: a draft at "
                f"{sum(d > 0 for d in draftable[proposer])} of {n - 1} positions")  # fmt: skip
        traces.append(RecordedTrace(f"{prompt.kind}/{prompt.name}", workload, len(ids), n - 1, matches,
                                    draftable))  # fmt: skip
    return traces


def lookup_trace(proposer: Any, prompt: Sequence[int], output: Sequence[int], depth: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """A lookup proposer's exact (matches, draftable) per output position g = 0 .. len(output) - 2:
    what it drafts after prompt + output[:g + 1] (at most ``depth`` tokens), and how many of those
    equal the output that follows. Runs on slot 0 of an idle engine; the proposer's state for it is
    released afterwards."""
    from serve_app.engine.proposers import ProposeRow
    from serve_app.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=len(output), temperature=0.0)
    matches, draftable = [], []
    proposer.admit(0, list(prompt))
    try:
        for g in range(len(output) - 1):
            sequence = [*prompt, *output[: g + 1]]
            [draft] = proposer.propose([ProposeRow(0, sequence, depth, params, None)])
            kept = 0
            while kept < len(draft.tokens) and g + 1 + kept < len(output) and \
                    draft.tokens[kept] == output[g + 1 + kept]:  # fmt: skip
                kept += 1
            matches.append(kept)
            draftable.append(len(draft.tokens))
    finally:
        proposer.release(0)
    return tuple(matches), tuple(draftable)


def teacher_forced_matches(model: Any, prompt: Sequence[int], output: Sequence[int]) -> tuple[int, ...]:
    """Exact matches of a greedy draft model, from ONE forward over prompt + output.

    A greedy draft that starts after ``g + 1`` output tokens proposes output[g + 1], then keeps
    proposing from its own tokens, which equal the output's while they match: so its accepted run
    is the number of consecutive k >= g + 1 where the draft's next-token guess from the TRUE prefix
    (prompt + output[:k]) is output[k]. Every such guess comes out of one teacher-forced forward.
    No depth cap, and no unknown position after a fully accepted draft (which recording has).
    """
    import torch

    cache = model.new_cache(1, len(prompt) + len(output))
    slot = cache.allocate()
    tokens = torch.tensor([list(prompt) + list(output[:-1])], device=model.device)
    hidden = model.forward(tokens, cache, [slot])  # [1, P + n - 1, hidden]
    guesses = model.logits(hidden[0, len(prompt) - 1 :]).argmax(-1).tolist()  # [n]: guess of output[k]
    run = [0] * (len(output) + 1)
    for k in range(len(output) - 1, -1, -1):
        run[k] = run[k + 1] + 1 if guesses[k] == output[k] else 0
    return tuple(run[g + 1] for g in range(len(output) - 1))


def kind_of(trace: RecordedTrace) -> str:
    return trace.name.split("/", 1)[0]


# ------------------------------------------------------------------------------------ simulation
def compared_policies() -> list[str]:
    """Every registered policy; static runs at ``BEST_STATIC``."""
    return sorted(registered_policies())


def make_policy(name: str, max_depth: int) -> Any:
    if name == "static":
        return static_policy(BEST_STATIC, max_depth)
    proposer, depth = BEST_STATIC
    config = PolicyConfig(default_proposer=proposer, default_depth=depth, max_depth=max_depth)
    return create_policy(name, config)


def mix_phases(traces: Sequence[Trace], kinds: Sequence[str], repeat: int = MIX_REPEAT) -> list[Phase]:
    """Code and prose at low load, a burst of heavy batch load (every trace), low load again."""
    quiet = [t for t, k in zip(traces, kinds, strict=True) if k in ("code", "prose")]
    return [Phase(quiet, MIX_LOW), Phase(list(traces) * repeat, MIX_BURST), Phase(quiet, MIX_LOW)]


@dataclass
class SimTable:
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


# ------------------------------------------------------------------------------------ real runs
@dataclass
class RealRun:
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
    from serve_app.engine.request import SpecOverride
    from serve_app.engine.sampling import SamplingParams

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


def real_policy(label: str) -> tuple[str, tuple[str | None, int]]:
    """A real run's label as (policy, static arm): a policy name (``static`` at ``BEST_STATIC``), or
    an arm as ``_arm`` writes it (``"draft d1"``: the static policy at that proposer and depth)."""
    proposer, _, depth = label.partition(" d")
    if depth.isdigit():
        return "static", (proposer, int(depth))
    return label, BEST_STATIC


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
    warm = policy_engine(base, "plain", cost)
    closed_loop(warm, encoded[:2], 2, 8)  # warm-up
    for load in loads:
        requests = [encoded[i % len(encoded)] for i in range(max(2 * load, len(encoded)))]
        runs: dict[str, list[RealRun]] = {p: [] for p in policies_}
        for round_ in range(repeats):
            for policy in rotated(policies_, round_):
                run = closed_loop(policy_engine(base, policy, cost, priors), requests, load, n)
                run.policy = policy
                runs[policy].append(run)
                log(f"[real] load {load} round {round_ + 1} {policy}: {run.rate:.2f} tok/s, "
                    f"accepted {run.accepted}/{run.drafted}")
        for policy in policies_:
            results[policy][load] = median_run(runs[policy])
    quiet = [e for e, p in zip(encoded, prompts, strict=True) if p.kind in ("code", "prose")]
    phases = [(quiet, MIX_LOW), (encoded * MIX_REPEAT, MIX_BURST), (quiet, MIX_LOW)]
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


# ------------------------------------------------------------------------------------ report
def _arm(arm: tuple[str | None, int]) -> str:
    return "plain" if arm[0] is None else f"{arm[0]} d{arm[1]}"


def simulation_markdown(table: SimTable, traces: TraceSet) -> str:
    kinds = statistics_of(traces)
    lines = [
        "### Simulated (recorded traces, measured cost model)", "",
        f"{len(traces.traces)} traces ({kinds}) on {traces.model_pair}; each load level keeps that many "
        "requests in flight. Cells: emitted tok/s (mean draft depth per request-step).", "",
    ]  # fmt: skip
    head = ["load", *table.policies, "oracle best static", "goodput / best static", "goodput / plain"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for load in table.loads:
        arm, best = table.oracle[load]
        cells = [str(load)]
        cells += [f"{table.rate[p][load]:.2f} ({table.depth[p][load]:.1f})" for p in table.policies]
        good = table.rate.get("goodput", {}).get(load)
        cells += [f"{best:.2f} ({_arm(arm)})", f"{good / best:.3f}x" if good else "-",
                  f"{good / table.rate['plain'][load]:.3f}x" if good else "-"]  # fmt: skip
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
    lines.append(f"| oracle best single static ({_arm(arm)}) | {best:.2f} | 1.000x |")
    return "\n".join([*lines, ""])


def statistics_of(traces: TraceSet) -> str:
    counts: dict[str, int] = {}
    for t in traces.traces:
        counts[kind_of(t)] = counts.get(kind_of(t), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def paired_ratio(good: RealRun, other: RealRun) -> float | None:
    """The median over rounds of goodput's rate / the other's in the same round (None: no rounds)."""
    ratios = sorted(g / o for g, o in zip(good.rounds, other.rounds, strict=False) if o > 0)
    return ratios[len(ratios) // 2] if ratios else None


def _ratio_cells(good: RealRun, best: RealRun, plain: RealRun | None) -> list[str]:
    paired = paired_ratio(good, best)
    cells = [f"{good.rate / best.rate:.3f}x", "-" if paired is None else f"{paired:.3f}x"]
    return [*cells, f"{good.rate / plain.rate:.3f}x" if plain else "-"]


def real_markdown(
    results: dict[str, dict[int, RealRun]], mix: dict[str, RealRun], n: int, repeats: int,
    mix_repeats: int | None = None,
) -> str:
    names = list(results)
    loads = sorted({load for r in results.values() for load in r})
    lines = [
        "### Real engine runs (closed loop)", "",
        f"Greedy, {n} tokens per request, EOS ignored; tok/s = emitted tokens / wall time (prefills "
        f"included), median of {repeats} interleaved rounds (each round runs every policy once). "
        f"static = {_arm(BEST_STATIC)}. Paired: the median over rounds of goodput / best other "
        "within the round (robust to the machine's speed drifting between rounds).", "",
    ]  # fmt: skip
    ratios = ["goodput / best other", "paired", "goodput / plain"]
    head = ["load", *names, *(ratios if "goodput" in names else [])]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(str(load), {p: results[p][load] for p in names}) for load in loads]
    if mix:
        rows.append(("mix", mix))
    for label, runs in rows:
        cells = [label] + [f"{runs[p].rate:.2f}" for p in names]
        if "goodput" in names:
            best = max((runs[p] for p in names if p != "goodput"), key=lambda r: r.rate)
            cells += _ratio_cells(runs["goodput"], best, runs.get("plain"))
        lines.append("| " + " | ".join(cells) + " |")
    if mix:
        rounds = repeats if mix_repeats is None else mix_repeats
        lines += ["", f"mix (median of {rounds} rounds): code and prose one request at a time, a burst of "
                  f"every prompt {MIX_REPEAT}x with up to {MIX_BURST} in flight, then code and prose again; "
                  "one engine a run."]
    return "\n".join([*lines, ""])


# ------------------------------------------------------------------------------------ command
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
        + "; ".join(parts) + ".\n"
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


def run_policy_bench(args: Any, settings: Any, build_engine: Callable[..., Any]) -> int:
    """The `--policies` mode of `specserve bench` (see the module docstring)."""
    loads = sorted(set(args.loads or LOADS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"Command: `{' '.join(['specserve', *sys.argv[1:]])}`", ""]
    engine = None
    if args.record_traces or args.real_loads:
        slots = max([*loads, *(args.real_loads or [])])
        engine = build_engine(settings, True, slots, RECORD_DEPTH, args.max_tokens)
    if args.record_traces:
        print("profiling the cost model ...", file=sys.stderr)
        cost = engine.profile_cost_model()
        prompts = [p for p in TRACE_PROMPTS if not args.kinds or p.kind in args.kinds]
        traces = TraceSet(
            f"{settings.model.target}+{settings.model.draft}",
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
                    "would hold them (see serve_app/bench_policies.py).") + "\n")  # fmt: skip
    sections.append(simulation_markdown(table, traces))
    if args.real_loads:
        names = ["plain", "static", "goodput"]
        mix_best = table.mix_oracle[0]  # the simulation's best single static over the mix, run too
        if mix_best[0] is not None and mix_best != BEST_STATIC:
            names.insert(2, _arm(mix_best))
        prompts = [p for p in TRACE_PROMPTS if not args.kinds or p.kind in args.kinds]
        kinds = [p.kind for p in prompts]
        prompts = [p for i, p in enumerate(prompts) if i < kinds.index(p.kind) + REAL_PER_KIND]
        real_cost = cost
        if not args.record_traces:  # the trace file's cost model may come from other hardware
            print("profiling the cost model on this machine ...", file=sys.stderr)
            real_cost = engine.profile_cost_model()
            sections.append(cost_comparison(cost, real_cost, list(engine.proposers)))
        real, mix = run_real(engine, prompts, real_cost, sorted(set(args.real_loads)), args.max_tokens, names,
                             args.repeats, lambda s: print(s, file=sys.stderr), priors,
                             args.mix_repeats)  # fmt: skip
        sections.append(real_markdown(real, mix, args.max_tokens, args.repeats, args.mix_repeats))
    markdown = "\n".join(sections)
    stem = out / f"policies-{time.strftime('%Y%m%d-%H%M%S')}.md"
    stem.write_text(markdown)
    print(markdown)
    print(f"wrote {stem}", file=sys.stderr)
    return 0
