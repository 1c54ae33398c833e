"""Token trees (``engine.tree``): the structure, the forward's layout, the walk, the cache moves."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.kv_cache import KVCache
from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import PositionNoise, process_logits
from serve_app.engine.tree import ROOT, TokenTree, layout, path_rows, walk_rows

# The module docstring's tree: r - a - b - c, and x beside b (a, b, c, x = 10, 11, 12, 13).
DOC = TokenTree((10, 11, 12, 13), (ROOT, 0, 1, 0), chain=3)


def test_of_paths_merges_shared_prefixes_and_keeps_the_chain_first() -> None:
    tree = TokenTree.of_paths([[10, 11, 12], [10, 13], [10, 11, 12], [14]])
    assert tree == TokenTree((10, 11, 12, 13, 14), (ROOT, 0, 1, 0, ROOT), chain=3)
    assert tree.depths == (1, 2, 3, 2, 1) and tree.depth == 3
    assert TokenTree.of_paths([[10, 11, 12], [10, 13], [14]], max_nodes=4) == DOC
    assert TokenTree.of_chain([5, 6]) == TokenTree((5, 6), (ROOT, 0), chain=2)


@pytest.mark.parametrize(
    ("tokens", "parents", "chain", "message"),
    [
        ((1, 2), (ROOT,), 1, "parents"),
        ((1, 2), (ROOT, 1), 1, "earlier node"),
        ((1, 2), (ROOT, ROOT), 2, "chain must hang"),
        ((1, 1), (ROOT, ROOT), 1, "twice"),
        ((1,), (ROOT,), 2, "chain length"),
    ],
)
def test_a_malformed_tree_is_refused(tokens, parents, chain, message) -> None:
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents, chain)


def test_walk_follows_the_targets_choices() -> None:
    # The target picks a, then x (not b), then 7 after x: a and x accepted, 7 the bonus.
    choices = {ROOT: 10, 0: 13, 3: 7}
    path, emitted = DOC.walk(lambda node, depth: choices[node])
    assert (path, emitted) == ([0, 3], [10, 13, 7])
    assert DOC.on_chain(path) == 1  # a is the chain's, x is not
    assert path_rows(path) == [0, 1, 4]
    # A miss at the root: nothing accepted, the target's token emitted.
    assert DOC.walk(lambda node, depth: 99) == ([], [99])
    # The whole chain, then a bonus token: depth 3 is the output offset of the bonus.
    seen = []
    full = {ROOT: 10, 0: 11, 1: 12, 2: 5}
    assert DOC.walk(lambda node, depth: seen.append(depth) or full[node]) == ([0, 1, 2], [10, 11, 12, 5])
    assert seen == [0, 1, 2, 3] and DOC.on_chain([0, 1, 2]) == 3


def test_layout_positions_and_ancestor_masks() -> None:
    batch = layout([7, 8], [DOC, TokenTree.of_chain([20])], [10, 4], "cpu")
    assert batch.tokens.tolist() == [[7, 10, 11, 12, 13], [8, 20, 0, 0, 0]]
    assert batch.positions.tolist() == [[10, 11, 12, 13, 12], [4, 5, 4, 4, 4]]
    mask = batch.block_mask.int().tolist()
    assert mask[0] == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # x sees the root, a and itself, never b or c
    ]
    assert mask[1][1] == [1, 1, 0, 0, 0] and mask[1][3] == [1, 0, 0, 1, 0]  # padding: root and itself


def test_keep_rows_moves_the_accepted_path_in_every_layer() -> None:
    cache = KVCache(num_layers=2, num_slots=2, num_kv_heads=1, max_seq_len=16, head_dim=2,
                    dtype=torch.float32)
    slot = cache.allocate()
    for layer in range(2):
        rows = torch.arange(16, dtype=torch.float32)[:, None].repeat(1, 2)  # row r holds r
        cache.k[layer][slot, 0] = rows + 100 * layer
        cache.v[layer][slot, 0] = -rows
    cache.keep_rows(slot, 5, [0, 1, 4, 6])  # rows 5, 6, 9, 11 -> 5, 6, 7, 8
    assert cache.lengths[slot] == 9
    for layer in range(2):
        assert cache.k[layer][slot, 0, 5:9, 0].tolist() == [5 + 100 * layer, 6 + 100 * layer,
                                                             9 + 100 * layer, 11 + 100 * layer]  # fmt: skip
        assert cache.v[layer][slot, 0, 5:9, 0].tolist() == [-5, -6, -9, -11]
        assert cache.k[layer][slot, 0, :5, 0].tolist() == [0 + 100 * layer + r for r in range(5)]


def test_walk_rows_greedy_and_coupled_choose_what_plain_decoding_would() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 50)  # [B, W, V]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    sampled = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.9, seed=3)
    noise = PositionNoise(3)
    best = logits.argmax(-1)
    # Row 0: greedy; put the target's choice at the root on node 0 (a), after a on x (node 3).
    tree0 = TokenTree((int(best[0, 0]), 1, 2, int(best[0, 1])), (ROOT, 0, 1, 0), chain=3)
    if tree0.tokens[1] == tree0.tokens[3]:
        pytest.skip("the random logits put b and x on one token")
    walked = walk_rows(logits, [tree0, None], [greedy, sampled], [None, (noise, 6)])
    assert set(walked) == {0}
    path, emitted = walked[0]
    assert path[:2] == [0, 3] and emitted[:2] == [tree0.tokens[0], tree0.tokens[3]]
    assert emitted[2] == int(best[0, 4])  # after x: the argmax at x's forward index
    # Row 1 coupled: the race's winner at output index 6 + depth, from process_logits of that index.
    settings = [torch.tensor([v]) for v in (0.9, 0, 0.9)]
    first = noise.choose(process_logits(logits[1, 0][None], *settings)[0], 6)
    tree1 = TokenTree((first, (first + 1) % 50), (ROOT, ROOT), chain=1)
    (path, emitted), = walk_rows(logits, [None, tree1], [greedy, sampled], [None, (noise, 6)]).values()
    second = noise.choose(process_logits(logits[1, 1][None], *settings)[0], 7)
    assert path == [0] and emitted == [first, second]
