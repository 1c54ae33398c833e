"""Token trees: several candidate continuations of a row, verified in one target forward.

A chain draft ``d_1 .. d_k`` loses everything after its first miss. A tree keeps alternatives: at a
position where the proposer is unsure, a second candidate becomes a sibling of the first, and the
target scores every node in the same forward. Then the step keeps the longest path the target
agrees with. Worked example (root = the row's last token ``r``, not a node):

    node   0    1    2    3          tokens  (a, b, c, x)
    parent -1   0    1    0          a child of the root has parent -1
    depth  1    2    3    2

    r ─ a ─ b ─ c        (the chain: nodes 0 .. k-1 come first, so a chain is a tree)
         └─ x            (an alternative to b after a)

The forward feeds ``[r, a, b, c, x]`` (forward index ``1 + node``); node ``i`` sits at position
``start + depth_i`` (rotary) and sees the cached rows, the root and its own ancestors only
(``layout``). Its target distribution is therefore the one plain decoding would have after the
path to it, which is what makes walking the tree exact: starting at the root, the target's own
choice there (greedy argmax, or the coupled race of ``sampling.PositionNoise`` at that output
index) is looked up among the children; a child holding it is **accepted** and the walk goes on
from it; otherwise the choice itself is emitted (the **recovered** token, or the **bonus** token
after a leaf) and the walk ends. Every emitted token is the token plain decoding would emit there,
whatever the tree (``walk``). The accepted nodes' K/V are then moved to consecutive cache rows
(``KVCache.keep_rows``); every other row past them is garbage by the cache's definition.

Exact by construction where attention sums the visible keys alone and in order (our float32 CPU
kernel, ``kernels/layer_ops.cpp``: a masked key is skipped, not added as a zero); ``tree_exact``.
Rows that sample by rejection (``verify``'s q-ratio rule) are not walked here: they verify chains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import PositionNoise, process_logits

ROOT = -1  # the parent of a depth-1 node: the row's last token, which the forward feeds first


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens of one row as a tree (module docstring): node ``i`` holds ``tokens[i]`` under
    ``parents[i]`` (``ROOT`` or an earlier node). The first ``chain`` nodes are the proposer's own
    chain ``d_1 .. d_chain`` (node ``j`` under node ``j - 1``); the rest are alternatives."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    chain: int

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        if not 0 <= self.chain <= len(self.tokens):
            raise ValueError(f"chain length {self.chain} outside 0..{len(self.tokens)}")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be {ROOT} or an earlier node")
            if i < self.chain and parent != i - 1:
                raise ValueError(f"node {i} of the chain must hang under node {i - 1}, not {parent}")
        seen = set()
        for parent, token in zip(self.parents, self.tokens, strict=True):
            if (parent, token) in seen:
                raise ValueError(f"token {token} appears twice under node {parent}")
            seen.add((parent, token))

    @classmethod
    def of_chain(cls, tokens: Sequence[int]) -> TokenTree:
        """The chain ``d_1 .. d_k`` as a tree without alternatives."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), len(tokens))

    @classmethod
    def of_paths(cls, paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> TokenTree:
        """The trie of ``paths`` (the first is the chain), keeping at most ``max_nodes`` nodes:
        later paths add only the nodes they do not share, e.g. ``[a, b, c]`` and ``[a, x]`` give
        the tree of the module docstring."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for path in paths:
            node = ROOT
            for token in path:
                nxt = child.get((node, token))
                if nxt is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    nxt = child[(node, token)] = len(tokens)
                    tokens.append(int(token))
                    parents.append(node)
                node = nxt
        chain = min(len(paths[0]), len(tokens)) if paths else 0
        return cls(tuple(tokens), tuple(parents), chain)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: 1 under the root."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent == ROOT else out[parent] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        """The longest path's length (0 for an empty tree)."""
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> dict[int, dict[int, int]]:
        """parent -> {token: child node}."""
        out: dict[int, dict[int, int]] = {}
        for i, (parent, token) in enumerate(zip(self.parents, self.tokens, strict=True)):
            out.setdefault(parent, {})[token] = i
        return out

    def walk(self, choose: Callable[[int, int], int]) -> tuple[list[int], list[int]]:
        """Accept the longest path the target agrees with (module docstring).

        ``choose(node, depth)`` is the target's token after ``node`` (``ROOT`` first), at output
        offset ``depth`` (0 at the root). Returns the accepted nodes (root excluded) and the tokens
        emitted: one per accepted node, then the recovered or bonus token."""
        path: list[int] = []
        emitted: list[int] = []
        node, depth = ROOT, 0
        while True:
            token = choose(node, depth)
            emitted.append(token)
            nxt = self.children.get(node, {}).get(token)
            if nxt is None:
                return path, emitted
            path.append(nxt)
            node, depth = nxt, depth + 1

    def on_chain(self, path: Sequence[int]) -> int:
        """How many of ``path``'s first nodes are the chain's (what a chain proposer keeps)."""
        n = 0
        while n < len(path) and path[n] == n and n < self.chain:
            n += 1
        return n


@dataclass(frozen=True)
class TreeBatch:
    """The inputs of one verify forward over trees (``layout``)."""

    tokens: torch.Tensor  # [B, W] long: the root, then the nodes; right-padded
    positions: torch.Tensor  # [B, W] long: start + depth (padding: at the root's position)
    block_mask: torch.Tensor  # [B, W, W] bool: forward index t may see forward index u


def layout(
    roots: Sequence[int], trees: Sequence[TokenTree], starts: Sequence[int], device: torch.device | str
) -> TreeBatch:
    """Token ids, positions and ancestor masks of rows ``b``: ``[roots[b], *trees[b].tokens]``.

    Forward index ``t = 1 + node``; index 0 is the root (depth 0). E.g. the docstring's tree at
    start 10: positions ``[10, 11, 12, 13, 12]``; index 4 (x) sees indices 0, 1 and itself. A
    padding index sees the root and itself only (its output is never read)."""
    width = 1 + max((len(t) for t in trees), default=0)
    bsz = len(trees)
    tokens = torch.zeros(bsz, width, dtype=torch.long)  # [B, W]
    positions = torch.tensor(list(starts), dtype=torch.long)[:, None].repeat(1, width)  # [B, W]
    mask = torch.eye(width, dtype=torch.bool).repeat(bsz, 1, 1)  # [B, W, W]; self always
    mask[:, :, 0] = True  # everyone sees the root
    for b, (root, tree) in enumerate(zip(roots, trees, strict=True)):
        tokens[b, 0] = root
        n = len(tree)
        if n:
            tokens[b, 1 : 1 + n] = torch.tensor(tree.tokens)
            positions[b, 1 : 1 + n] += torch.tensor(tree.depths)
        for i, parent in enumerate(tree.parents):
            if parent != ROOT:  # inherit the parent's ancestors (parents come first)
                mask[b, 1 + i] |= mask[b, 1 + parent]
    return TreeBatch(tokens.to(device), positions.to(device), mask.to(device))


def path_rows(path: Sequence[int]) -> list[int]:
    """Forward indices of the root and the accepted nodes: what the cache keeps, in order."""
    return [0, *(1 + node for node in path)]


def walk_rows(
    logits: torch.Tensor,  # [B, W, V] the step's scored target logits, forward index t = 1 + node
    trees: Sequence[TokenTree | None],  # per row; None = a chain row (``verify`` decides it)
    params: Sequence[SamplingParams],
    noises: Sequence[tuple[PositionNoise, int] | None],  # per row: (noise, output index of index 0)
) -> dict[int, tuple[list[int], list[int]]]:
    """Walk each row that has a tree: row -> (accepted nodes, emitted tokens). A greedy row chooses
    the argmax (ties: the lowest id, as ``verify``), a coupled row its race winner at each output
    index; only those two may carry trees (``tree_row``)."""
    rows = [b for b, tree in enumerate(trees) if tree is not None]
    greedy = [b for b in rows if params[b].greedy]
    out: dict[int, tuple[list[int], list[int]]] = {}
    if greedy:
        best = logits.argmax(dim=-1)[greedy].tolist()  # [G, W]
        for b, row in zip(greedy, best, strict=True):
            out[b] = trees[b].walk(lambda node, depth, row=row: row[1 + node])  # type: ignore[union-attr]
    for b in (b for b in rows if not params[b].greedy):
        found = noises[b]
        if found is None:
            raise ValueError(f"row {b}: a sampling row with a tree needs coupled noise")
        noise, first = found
        settings = [torch.tensor([v], device=logits.device) for v in
                    (params[b].temperature, params[b].top_k, params[b].top_p)]  # fmt: skip

        def choose(node: int, depth: int, b: int = b, noise: PositionNoise = noise, first: int = first,
                   settings: list[torch.Tensor] = settings) -> int:  # fmt: skip
            p = process_logits(logits[b, 1 + node][None], *settings)[0]  # [V]
            return noise.choose(p, first + depth)

        out[b] = trees[b].walk(choose)  # type: ignore[union-attr]
    return out
