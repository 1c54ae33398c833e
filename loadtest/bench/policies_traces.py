"""Acceptance traces for ``specserve bench --policies``: each prompt run greedily once per loaded
proposer at a fixed depth, what every proposer would have had accepted at every output position
(a ``policies.traces.RecordedTrace``), which the simulation replays through every policy.

A proposer with a draft ``model`` (the draft model) gets its per-position ``matches`` exactly
from one teacher-forced forward over the output (``teacher_forced_matches``); a lookup proposer
(n-gram) its matches and draft lengths exactly by replaying the lookup over the output
(``lookup_trace``); any other from each decode step's (position, drafted, accepted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from loadtest.bench.policies_setup import RECORD_DEPTH
from loadtest.catalogue import Prompt
from policies import classify
from policies.traces import RecordedTrace, StepRecord, matches_from_steps
from serve_app.config import OFF


def record_traces(engine: Any, prompts: Sequence[Prompt], n: int, depth: int = RECORD_DEPTH,
                  log: Callable[[str], None] = print) -> list[RecordedTrace]:  # fmt: skip
    """Each prompt, greedy, ``n`` tokens (EOS ignored), once per proposer at ``depth``.

    A proposer with a draft ``model`` (the draft model) also gets its matches exactly, by teacher
    forcing (``teacher_forced_matches``) over the output; a lookup proposer (n-gram) its matches
    and draft lengths exactly by replaying the lookup over the output (``lookup_trace``, no run of
    its own); any other from the recorded steps (``policies.traces.matches_from_steps``).
    """
    from serve_app.engine.params import SamplingParams, SpecOverride
    from serve_app.engine.proposers.base import LookaheadProposer

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    lookups = [p for p, obj in engine.proposers.items() if isinstance(obj, LookaheadProposer)]
    runs = [p for p in engine.proposers if p not in lookups] or [OFF]
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
            if proposer == OFF:
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
    from serve_app.engine.params import SamplingParams
    from serve_app.engine.proposers.base import ProposeRow

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
    """The prompt kind of a trace (its name is ``kind/name``)."""
    return trace.name.split("/", 1)[0]
