"""The proposer protocol: who guesses the next tokens, and how it stays in step with the target.

A proposer drafts up to ``depth`` tokens per row; the target verifies them all in one forward
(``serve_app.engine.verify``) and keeps the longest prefix it agrees with plus one token of its
own. Afterwards the engine calls ``commit(slot, num_accepted)`` so a stateful proposer (a draft
model with its own KV cache) can drop what was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import PositionNoise
from serve_app.engine.tree import TokenTree


@dataclass(frozen=True)
class ProposeRow:
    """One running request as a proposer sees it."""

    slot: int  # the request's KV slot (the same index in every model's cache)
    token_ids: list[int]  # prompt + output so far; the last token is not yet in the target's cache
    depth: int  # how many tokens to draft (>= 1)
    params: SamplingParams  # the request's sampling settings (a sampling draft applies them too)
    generator: torch.Generator | None  # the request's generator; None = greedy or coupled request
    # Coupled sampling (sampling.PositionNoise): the request's noise and the output index of the
    # first token to draft; a model-based proposer drafts argmax q / E under the target's noise.
    noise: PositionNoise | None = None
    first_index: int = 0
    # Alternatives a tree may add beside the chain (``engine.tree``); 0 = a chain. Only a
    # ``TreeProposer`` reads it, and only greedy and coupled rows get a budget.
    nodes: int = 0
    min_score: float = 0.0  # an alternative joins only if the proposer's probability of it is higher


@dataclass(frozen=True)
class Draft:
    """A proposal for one row.

    ``tokens`` may be shorter than the depth asked for (an n-gram proposer with no match proposes
    nothing). ``probs`` is q, the distribution each token was really drawn from (``[len, vocab]``
    float32), or None when the proposal is deterministic (q is then one-hot at each token).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    # The draft as a token tree (its chain is ``tokens``), when the proposer added alternatives.
    tree: TokenTree | None = None

    @property
    def width(self) -> int:
        """Tokens this draft adds to the verify forward (tree nodes, or the chain)."""
        return len(self.tokens) if self.tree is None else len(self.tree)


@runtime_checkable
class Proposer(Protocol):
    """What every proposer implements. Registered by name in ``proposers.registry``."""

    name: str

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        """A request took ``slot``; prepare any per-request state (e.g. prefill a draft cache)."""

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        """Draft tokens for each row (batched); one ``Draft`` per row, in order."""

    def commit(self, slot: int, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` of the tokens last proposed for ``slot``."""

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished; forget it."""


@runtime_checkable
class ModelDrafter(Protocol):
    """A proposer whose draft step is one forward of a model over a slot KV cache.

    The engine's profiler times ``model.logits(model.forward(tokens [rows, 1], cache, slots))`` on
    free slots of ``cache`` to fit the proposer's draft-step cost (the draft model: its own model and
    cache; self-speculation: the target's kept layers and the target's cache).
    """

    model: Any  # forward(tokens, cache, slots) -> hidden; logits(hidden); cfg; device
    cache: Any  # the KVCache that ``model.forward`` writes


@runtime_checkable
class LookaheadProposer(Protocol):
    """A proposer whose draft is a cheap deterministic lookup (n-gram) can say, before the step,
    how many tokens it would draft for a row: ``lookahead(row)`` == ``len(propose([row])[0].tokens)``
    without changing any state that ``propose`` would not. The engine passes it to the policy
    (``RequestView.draftable``), so a lookup without a match is never chosen: it would buy only
    a plain step, where the request's other proposer could have drafted."""

    def lookahead(self, row: ProposeRow) -> int:
        """Tokens ``propose`` would draft for ``row`` now (at most ``row.depth``)."""


@runtime_checkable
class FeatureProposer(Protocol):
    """A proposer that drafts from the target's own hidden states (EAGLE, Medusa heads).

    The engine hands it the target's final normed hidden state of every token the target's cache
    keeps, in order, from the forwards it runs anyway: the prompt's at prefill, then after each
    step the fed token's and the accepted drafts' (``hidden[b, :1 + accepted]``). So when a row's
    sequence is ``x_0 .. x_n`` (``x_n`` not cached yet), it has seen ``feature_0 .. feature_{n-1}``.
    The engine admits it for every request at prefill, so ``release`` always follows."""

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        """``features`` ``[n, hidden]``: the next ``n`` positions' hidden states of ``slot``."""


@runtime_checkable
class TreeProposer(Protocol):
    """A proposer that can add alternatives to its chain (``ProposeRow.nodes`` of them at most),
    returning them as ``Draft.tree``; it says so with ``branches = True``. After the target walks
    the tree, ``commit`` gets how many of the accepted nodes were the chain's (``TokenTree.on_chain``)."""

    branches: bool


def branches(proposer: object) -> bool:
    """Whether ``proposer`` drafts trees when given a node budget."""
    return bool(getattr(proposer, "branches", False))


def needs_prefill(proposer: object) -> bool:
    """Whether admitting a request to ``proposer`` costs a prefill (the draft model reads the whole
    sequence into its own cache). A proposer that drafts from state the target already holds says
    ``prefills = False`` (self-speculation: the target's KV cache); the default is True."""
    return bool(getattr(proposer, "prefills", True))
