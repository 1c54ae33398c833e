"""Builders for policy tests: request and step views, outcomes, and a cost model shaped like the
Qwen2.5-Coder 1.5B target / 0.5B int8 draft pair on this 2-core CPU."""

from __future__ import annotations

from policies import FittedCostModel, Outcome, RequestOutcome, RequestView, StepView

PROPOSERS = ("draft", "ngram")


def qwen_cpu_cost() -> FittedCostModel:
    """Target: 1 token 132 ms .. 32 tokens 290 ms at ctx 200 (flat to 4 tokens, then ~5.3 ms per
    token); draft: 36 ms per step at 1 row, +6 ms per row; n-gram free."""
    return FittedCostModel(target=(0.1313, 0.0053, 0.0, 1.2e-6), knee=4, draft={"draft": (0.030, 0.006, 0.0)})


def request(
    rid: str = "r0",
    *,
    draft: float = 0.9,
    ngram: float = 0.3,
    prompt: int = 200,
    generated: int = 0,
    left: int = 100,
    mode: str = "auto",
    max_depth: int | None = None,
    workload: str = "code",
    positions: int = 16,
    draftable: dict[str, int] | None = None,
) -> RequestView:
    return RequestView(
        request_id=rid,
        prompt_len=prompt,
        generated=generated,
        tokens_left=left,
        temperature=0.0,
        workload=workload,
        acceptance={"draft": (draft,) * positions, "ngram": (ngram,) * positions},
        override_mode=mode,
        override_max_depth=max_depth,
        draftable=dict(draftable or {}),
    )


def step(
    requests,
    *,
    proposers: tuple[str, ...] = PROPOSERS,
    max_depth: int = 8,
    cost: FittedCostModel | None = None,
    queue: int = 0,
) -> StepView:
    return StepView(tuple(requests), queue, proposers, max_depth, cost or qwen_cpu_cost())


def batch(size: int, **kwargs) -> StepView:
    step_kwargs = {k: kwargs.pop(k) for k in ("proposers", "max_depth", "cost", "queue") if k in kwargs}
    return step([request(f"r{i}", **kwargs) for i in range(size)], **step_kwargs)


def outcome(decisions, view: StepView, accepted, seconds: float = 0.2) -> Outcome:
    """The step's outcome when request i kept ``accepted[i]`` of its draft."""
    rows = []
    for r, d, a in zip(view.requests, decisions, accepted, strict=True):
        kept = min(a, d.depth)
        rows.append(RequestOutcome(r.request_id, r.workload, d.proposer, d.depth, d.depth, kept, kept + 1))
    width = 1 + max((d.depth for d in decisions), default=0)
    return Outcome(tuple(rows), seconds, {}, {}, width, 200, seconds)
