"""A step's attention in one call (``kernels/cached_attention.cpp``): the bits of the torch form it
replaces (rotation, cache write, ``small_attention``), the cache rows it writes, its refusals."""

from __future__ import annotations

import math

import pytest
import torch

from serve_app.engine.attention import NO_MASK, grouped_attention
from serve_app.engine.decoder_layer import rotate
from serve_app.engine.kernels import kernels_module
from serve_app.engine.kv_cache import KVCache
from tests.engine.quantized_helpers import require_built_kernels

require_built_kernels()

HEADS, KV_HEADS, DIM, SLOTS, MAX_LEN = 6, 2, 32, 4, 80


def torch_form(qkv, cos, sin, cache: KVCache, slots, steps, mask):
    """The layer's torch ops: split, rotate, write the cache, attend over the slots' rows."""
    bsz = qkv.shape[0]
    batch = cache.batch(slots, steps)
    q, k, v = qkv.split((HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM), dim=-1)
    q = q.view(bsz, steps, HEADS, DIM).transpose(1, 2)
    k = k.view(bsz, steps, KV_HEADS, DIM).transpose(1, 2)
    v = v.view(bsz, steps, KV_HEADS, DIM).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    cache.write(0, batch, k, v)
    keys, values = cache.read(0, batch)
    attn = grouped_attention(q, keys, values, mask, 1 / math.sqrt(DIM), width=batch.upto)
    return attn.transpose(1, 2).reshape(bsz, steps, HEADS * DIM)


def case(slots, starts, steps, tree: bool):
    """Random qkv and rope tables; caches with ``starts`` rows filled; the step's visibility mask."""
    torch.manual_seed(len(slots) * 100 + steps + 7 * tree)
    bsz = len(slots)
    qkv = torch.randn(bsz, steps, (HEADS + 2 * KV_HEADS) * DIM)
    depth = torch.tensor([0, 1, 1, 2, 3, 2, 4, 5][:steps]) if tree else torch.arange(steps)
    positions = torch.tensor(starts)[:, None] + depth  # a tree's nodes sit at start + depth
    angles = positions[..., None].float() * torch.linspace(0.01, 1.0, DIM)
    cos, sin = torch.cos(angles).unsqueeze(1), torch.sin(angles).unsqueeze(1)  # [B, 1, T, D]
    caches = []
    for _ in range(2):
        cache = KVCache(1, SLOTS, KV_HEADS, MAX_LEN, DIM, torch.float32)
        torch.manual_seed(5)
        cache.k[0].normal_()
        cache.v[0].normal_()
        for slot, start in zip(slots, starts, strict=True):
            cache.allocate(slot)
            cache.set_length(slot, start)
        caches.append(cache)
    upto = max(starts) + steps
    key = torch.arange(upto)[None, None, :] - torch.tensor(starts)[:, None, None]  # index among the new
    query = torch.arange(steps)[None, :, None]
    if steps == 1 and bsz == 1:
        mask = None
    else:
        shape = (bsz, steps, steps)
        ancestors = torch.rand(shape) > 0.4 if tree else torch.ones(shape, dtype=torch.bool)
        ancestors = torch.tril(ancestors) | torch.eye(steps, dtype=torch.bool)
        among_new = ancestors.gather(2, key.clamp(0, steps - 1).expand(bsz, steps, upto))
        in_block = (key >= 0) & (key < steps) & among_new
        mask = ((key < 0) | (in_block & (key <= query))).unsqueeze(1)  # [B, 1, T, S]
    return qkv, cos, sin, caches, mask, upto


@pytest.mark.parametrize(
    ("slots", "starts", "steps", "tree"),
    [
        ([2], [17], 1, False),
        ([0], [40], 5, False),
        ([3, 1, 0], [9, 30, 2], 4, False),
        ([1, 2], [20, 11], 8, True),
    ],
)
def test_the_bits_and_cache_rows_of_the_torch_form(slots, starts, steps, tree) -> None:
    qkv, cos, sin, (mine, theirs), mask, upto = case(slots, starts, steps, tree)
    want = torch_form(qkv, cos, sin, theirs, slots, steps, mask)
    got = kernels_module().cached_attention(qkv, cos[:, 0], sin[:, 0], mine.k[0], mine.v[0], slots, starts,
                                            NO_MASK if mask is None else mask[:, 0], upto, HEADS,
                                            1 / math.sqrt(DIM))  # fmt: skip
    assert got.shape == (len(slots), steps, HEADS * DIM)
    assert torch.equal(got, want)
    # every cache row, written or not
    assert torch.equal(mine.k[0], theirs.k[0]) and torch.equal(mine.v[0], theirs.v[0])


def test_refuses_what_does_not_fit() -> None:
    qkv, cos, sin, (cache, _), _, _ = case([0], [78], 1, False)
    attend = kernels_module().cached_attention
    k, v, c, s = cache.k[0], cache.v[0], cos[:, 0], sin[:, 0]
    three = (qkv.expand(1, 3, -1).contiguous(), c.expand(1, 3, -1), s.expand(1, 3, -1))
    with pytest.raises(RuntimeError, match="does not fit the cache"):
        attend(*three, k, v, [0], [78], NO_MASK, 80, HEADS, 0.1)
    with pytest.raises(RuntimeError, match="features"):
        attend(qkv, c, s, k, v, [0], [78], NO_MASK, 79, 4, 0.1)
    with pytest.raises(RuntimeError, match="one slot and one start per row"):
        attend(qkv, c, s, k, v, [0, 1], [78], NO_MASK, 79, HEADS, 0.1)
