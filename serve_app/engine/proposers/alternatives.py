"""Alternatives beside a chain draft: the runner-up token at each drafted position, kept where the
proposer's own probability of the path makes it worth a verify slot (``engine.tree``).

At draft position ``j`` a model-based proposer chose ``d_j``; its runner-up ``x_j`` (the second
highest probability for a greedy row, the race's second place for a coupled one) becomes a sibling
of ``d_j``. Each candidate is scored by the proposer's probability of reaching it: the product of
the chosen tokens' probabilities before ``j`` times ``q(x_j)``, the order in which SpecInfer /
EAGLE-2 grow trees; the best ``nodes`` of a row's candidates are kept. Any rule that looks only at
the proposer's distribution keeps verification exact (the target decides every node).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serve_app.engine.proposers.base import ProposeRow
from serve_app.engine.proposers.choice import Choice
from serve_app.engine.sampling import process_logits
from serve_app.engine.tree import ROOT, TokenTree


def runner_up(rows: list[ProposeRow], logits: torch.Tensor, chosen: list[Choice],
              drafted: list[int]) -> list[tuple[int, float, float]]:  # fmt: skip
    """Per row: (runner-up token, its probability, the chosen token's probability) under the
    proposer's distribution ``logits`` ``[B, V]``; ``drafted[b]`` is row b's output offset."""
    out: list[tuple[int, float, float]] = []
    greedy = [b for b, row in enumerate(rows) if row.params.greedy]
    if greedy:  # the two best of each greedy row, their probabilities without a softmax over V
        flat = logits[greedy].float()  # [G, V]
        top = flat.topk(2, dim=-1)  # [G, 2]
        probs = (top.values - flat.logsumexp(dim=-1, keepdim=True)).exp().tolist()
        seconds = dict(zip(greedy, zip(top.indices[:, 1].tolist(), probs, strict=True), strict=True))
    for b, (row, choice) in enumerate(zip(rows, chosen, strict=True)):
        if row.params.greedy:
            token, (first, second) = seconds[b]
            out.append((token, second, first))
            continue
        settings = [torch.tensor([v]) for v in (row.params.temperature, row.params.top_k, row.params.top_p)]
        q = process_logits(logits[b][None].float(), *settings)[0].cpu()  # [V]
        assert row.noise is not None, "only greedy and coupled rows draft trees"
        race = q / row.noise.exponentials(row.first_index + drafted[b], q.shape[-1])  # [V]
        second = int(race.topk(2).indices[1])
        out.append((second, float(q[second]), float(q[choice.token])))
    return out


@dataclass
class Alternatives:
    """One row's candidates while its chain is drafted."""

    budget: int  # how many to keep (ProposeRow.nodes)
    floor: float = 0.0  # the score a candidate must pass (ProposeRow.min_score, policies.trees)
    reach: float = 1.0  # the proposer's probability of the chain so far
    found: list[tuple[float, int, int]] = field(default_factory=list)  # (score, position, token)

    def worth_asking(self, confidence: float) -> bool:
        """Whether a runner-up could pass the floor: it has at most ``1 - confidence`` (the chosen
        token's share) times the reach. Else the caller only ``passes`` the position."""
        return self.reach * (1.0 - confidence) > self.floor

    def passes(self, chosen_probability: float) -> None:
        """The chain goes on through a position whose runner-up was not worth asking for."""
        self.reach *= chosen_probability

    def add(self, position: int, token: int, probability: float, chosen_probability: float) -> None:
        """The runner-up at ``position`` (0-based), then the chain goes on through the chosen token."""
        if probability > 0.0:
            self.found.append((self.reach * probability, position, token))
        self.reach *= chosen_probability

    def tree(self, chain: list[int]) -> TokenTree | None:
        """The chain with its best ``budget`` alternatives that hang under it, or None if none do."""
        kept = sorted(c for c in self.found if c[1] < len(chain) and c[0] > self.floor)[::-1][: self.budget]
        if not kept:
            return None
        kept.sort(key=lambda c: c[1])  # by position: reads top to bottom
        tokens = (*chain, *(token for _, _, token in kept))
        parents = (*range(-1, len(chain) - 1), *(ROOT if j == 0 else j - 1 for _, j, _ in kept))
        return TokenTree(tokens, parents, len(chain))


def offer_runner_ups(alternatives: dict[int, Alternatives], active: list[int], rows: list[ProposeRow],
                     logits: torch.Tensor, chosen: list[Choice], drafted: list[int]) -> None:  # fmt: skip
    """One drafted position of every active row: where row ``i = active[k]`` has a budget in
    ``alternatives``, its runner-up joins as a candidate if it could pass the floor, else the chain
    only passes through ``chosen[k]``. ``logits`` ``[A, V]``: the proposer's, of the active rows at
    this position; ``drafted[k]``: that position (0-based) in row ``i``'s draft."""
    asking = []
    for k, i in enumerate(active):
        if i not in alternatives:
            continue
        if alternatives[i].worth_asking(chosen[k].confidence):
            asking.append(k)
        else:
            alternatives[i].passes(chosen[k].confidence)
    if not asking:
        return
    seconds = runner_up([rows[active[k]] for k in asking], logits[asking], [chosen[k] for k in asking],
                        [drafted[k] for k in asking])  # fmt: skip
    for k, (token, q, q_chosen) in zip(asking, seconds, strict=True):
        alternatives[active[k]].add(drafted[k], token, q, q_chosen)
