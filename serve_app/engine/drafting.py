"""The drafting half of a speculative step: what each request looks like to the planner and to the
proposers, and each proposer drafting for its rows in one batched call."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from policies.base import Decision
from serve_app.engine.planner import PlannedRequest
from serve_app.engine.proposers.base import (
    Draft,
    FeatureProposer,
    LookaheadProposer,
    Proposer,
    ProposeRow,
    branches,
)
from serve_app.engine.request import Request


def propose_row(request: Request, depth: int, nodes: int = 0, min_score: float = 0.0) -> ProposeRow:
    """``request`` as a proposer sees it, asked for ``depth`` tokens (and up to ``nodes``
    alternatives): the whole sequence so far (the last token not yet in the target's cache), its
    sampling and, for coupled sampling, its noise from the next output position on."""
    return ProposeRow(
        request.slot,
        request.prompt_ids + request.output_ids,
        depth,
        request.params,
        request.generator,
        request.noise,
        len(request.output_ids),
        nodes,
        min_score,
    )


def tree_row(request: Request) -> bool:
    """Whether ``request`` may verify a token tree: greedy or coupled sampling (walking a tree is
    exact for both, ``engine.tree``), and no penalties or grammar (which score each position after
    its prefix, and a tree's positions have many prefixes)."""
    greedy_or_coupled = request.params.greedy or request.noise is not None
    return greedy_or_coupled and request.penalties is None and request.grammar is None


def admit(proposer: Proposer, name: str, request: Request) -> None:
    """Let ``proposer`` take ``request`` on (once): it sees the sequence its cache would hold."""
    if name not in request.proposers_admitted:
        proposer.admit(request.slot, request.prompt_ids + request.output_ids[:-1])
        request.proposers_admitted.add(name)


def hand_features(heads: Mapping[str, FeatureProposer], request: Request, features: torch.Tensor) -> None:
    """Give every feature proposer (EAGLE, Medusa) the target's hidden states ``[n, H]`` of the
    ``n`` tokens the target's cache just kept for ``request``; the first time, admit it for the
    request, so its state is released with the request."""
    for name, proposer in heads.items():
        admit(proposer, name, request)  # type: ignore[arg-type]
        proposer.observe_features(request.slot, features)


def lookahead(lookups: Mapping[str, LookaheadProposer], request: Request, max_depth: int) -> dict[str, int]:
    """What each lookahead proposer (n-gram) would draft for ``request`` now; it is admitted for the
    request first (free: it indexes the prompt), so its state is released with it."""
    if not lookups or request.speculation.mode == "off":
        return {}
    for name, proposer in lookups.items():
        admit(proposer, name, request)  # type: ignore[arg-type]
    row = propose_row(request, max_depth)
    return {name: proposer.lookahead(row) for name, proposer in lookups.items()}


def planned_request(request: Request, max_seq_len: int, draftable: dict[str, int]) -> PlannedRequest:
    """What the planner (and through it the policy) knows of ``request`` this step."""
    return PlannedRequest(
        request_id=request.request_id,
        prompt_len=len(request.prompt_ids),
        generated=len(request.output_ids),
        tokens_left=request.tokens_left,
        temperature=request.params.temperature,
        mode=request.speculation.mode,
        max_depth=request.speculation.max_depth,
        tree_nodes=request.speculation.tree_nodes,
        tree_row=tree_row(request),
        room=max_seq_len - request.num_tokens,
        draftable=draftable,
    )


def draft_rows(
    proposers: Mapping[str, Proposer], requests: list[Request], decisions: list[Decision], trees: bool = True
) -> tuple[list[Draft], dict[str, float], dict[str, int]]:
    """Each proposer drafts for its rows in one call; also its time (admission prefill excluded)
    and its draft steps (the longest draft it made). A decision's tree budget reaches a proposer
    that branches, for a ``tree_row``, where ``trees`` (the engine's attention keeps them exact)."""
    drafts = [Draft(tokens=[]) for _ in requests]
    seconds: dict[str, float] = {}
    steps: dict[str, int] = {}
    groups: dict[str, list[int]] = {}
    for i, decision in enumerate(decisions):
        if decision.proposer is not None:
            groups.setdefault(decision.proposer, []).append(i)
    for name, indices in groups.items():
        proposer = proposers[name]
        for i in indices:
            admit(proposer, name, requests[i])
        branching = trees and branches(proposer)
        rows = []
        for i in indices:
            nodes = decisions[i].nodes if branching and tree_row(requests[i]) else 0
            rows.append(propose_row(requests[i], decisions[i].depth, nodes, decisions[i].min_score))
        start = time.perf_counter()
        for i, draft in zip(indices, proposer.propose(rows), strict=True):
            drafts[i] = draft
        seconds[name] = time.perf_counter() - start
        steps[name] = max(len(drafts[i].tokens) for i in indices)
    return drafts, seconds, steps
