"""Attention over the KV cache for few queries (decode, verification), exact in the rows.

float32 on a CPU runs our kernel (``kernels/layer_ops.cpp``: each query alone, in one fixed order,
so it is exact in the rows by construction and needs no padding); other dtypes and devices run the
torch form below, padded where the device needs it (``engine.exactness``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from serve_app.engine.invariance import RowPlan
from serve_app.engine.kv_cache import CacheBatch, KVCache

# The probability-weighted sum of values runs over keys in chunks of this many (the last one
# zero-padded), added in order: a product's rounding may change with its number of keys (measured
# on an AVX-512 BF16 EPYC, float32: 288 keys and 320 keys of which the same 285 are visible give other
# sums), and a decode step and a verify forward see different numbers of (masked) keys. With every
# chunk the same size, the chunks past a query's last key add exact zeros.
VALUE_CHUNK = 256


def grouped_attention(
    q: torch.Tensor,  # [B, H, T, D]
    keys: torch.Tensor,  # [B, H_kv, S', D], S' >= S
    values: torch.Tensor,  # [B, H_kv, S', D]
    mask: torch.Tensor | None,  # [B, 1, T, S] bool or None
    scale: float,
    plan: RowPlan | None = None,
    key_block: int = 1,
    width: int | None = None,  # S, the keys that exist (default: all S' given)
) -> torch.Tensor:
    """Attention for few queries: the G = H / H_kv query heads sharing a KV head become rows.

    Head h uses KV head h // G, so ``[B, H, T, D] -> [B, H_kv, G * T, D]`` puts head (kv, g),
    token t at row g * T + t; the mask is tiled G times along its rows to match. For exactness
    (``engine.invariance``) the G * T rows may be padded to a count of the ``plan`` (zero queries),
    and the keys to a multiple of ``key_block`` (masked): float32 products on some CPUs round a
    score differently with another number of rows or of keys. Keys beyond ``width`` that the caller
    passes (the cache's next rows: finite, as it is zero-filled) serve as that padding without a
    copy; masked keys get probability exactly 0, so their values never count.
    """
    bsz, heads, steps, dim = q.shape
    kv_heads = keys.shape[1]
    width = keys.shape[2] if width is None else width
    if (native := native_kernels(q)) is not None:
        visible = mask[:, 0] if mask is not None else NO_MASK
        return native.small_attention(q, keys, values, visible, width, scale).transpose(1, 2)  # [B, H, T, D]
    group = heads // kv_heads
    rows = group * steps
    padded_rows = plan.padded(rows) if plan is not None else rows
    padded_width = -(-width // key_block) * key_block
    q = q.reshape(bsz, kv_heads, rows, dim)
    if mask is not None:
        mask = mask.repeat(1, 1, group, 1)  # [B, 1, G T, S]
    if keys.shape[2] >= padded_width:
        # values may stay longer, up to whole VALUE_CHUNKs: rows the sum multiplies by 0 (no copy)
        keys = keys[:, :, :padded_width]
        values = values[:, :, : -(-padded_width // VALUE_CHUNK) * VALUE_CHUNK]
    else:
        keys, values = (
            torch.cat([t, t.new_zeros(bsz, kv_heads, padded_width - t.shape[2], dim)], dim=2)
            for t in (keys, values)
        )
    if padded_width != width:
        if mask is None:  # [1, 1, 1, S'] broadcast over rows: the keys that exist
            mask = (torch.arange(padded_width, device=q.device) < width).view(1, 1, 1, padded_width)
        else:
            mask = torch.cat([mask, mask.new_zeros(bsz, 1, rows, padded_width - width)], dim=-1)
    if padded_rows != rows:
        q = torch.cat([q, q.new_zeros(bsz, kv_heads, padded_rows - rows, dim)], dim=2)
        if mask is not None and mask.shape[2] != 1:
            mask = torch.cat([mask, mask.new_ones(bsz, 1, padded_rows - rows, mask.shape[-1])], dim=2)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, H_kv, rows, S]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    out = _weighted_values(probs, values)  # [B, H_kv, rows, D]
    return out[:, :, :rows].reshape(bsz, heads, steps, dim)  # [B, H, T, D]


NO_MASK = torch.empty(0, dtype=torch.bool)  # for the kernels: every query sees every key up to the width


@dataclass(frozen=True)
class CachedAttention:
    """One forward's inputs to the one-call step attention (``kernels/cached_attention.cpp``: rotary
    embedding, cache write and attention from the fused qkv), laid out once for every layer."""

    kernels: Any
    cos: torch.Tensor  # [B, T, D]
    sin: torch.Tensor  # [B, T, D]
    visible: torch.Tensor  # [B, T, S] bool, or NO_MASK: every query sees the batch's S rows

    @classmethod
    def for_step(cls, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None) -> CachedAttention | None:  # fmt: skip
        """From the forward's ``cos, sin [B, 1, T, D]`` and ``mask [B, 1, T, S]``; None where the
        kernel does not take ``x`` (not float32 on a CPU)."""
        kernels = native_kernels(x)
        if kernels is None:
            return None
        return cls(kernels, cos[:, 0], sin[:, 0], NO_MASK if mask is None else mask[:, 0])

    def __call__(self, qkv: torch.Tensor, cache: KVCache, layer: int, batch: CacheBatch, heads: int,
                 scale: float) -> torch.Tensor:  # fmt: skip
        """``qkv [B, T, (H + 2 H_kv) D]`` of ``layer`` -> the attention output ``[B, T, H D]``."""
        return self.kernels.cached_attention(qkv, self.cos, self.sin, cache.k[layer], cache.v[layer],
                                             batch.slots, batch.starts, self.visible, batch.upto, heads,
                                             scale)  # fmt: skip


@cache
def _kernels() -> object | None:
    from serve_app.engine.kernels import kernels_module

    return kernels_module()


def native_kernels(q: torch.Tensor) -> object | None:
    """Our kernels where they take this query (float32 on a CPU), else None."""
    return _kernels() if q.dtype == torch.float32 and q.device.type == "cpu" else None


def tree_exact(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a token tree's nodes get plain decoding's numbers here: attention that sums a query's
    visible keys alone and in order (our float32 CPU kernel) gives a node over its ancestors what a
    plain step gives over the same keys laid out in a row; the torch form multiplies masked keys by
    zero inside blocked products, whose rounding depends on where the visible keys sit."""
    return native_kernels(torch.empty(0, dtype=dtype, device=device)) is not None


def _weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs @ values`` over keys in ``VALUE_CHUNK`` chunks of one size, summed in order.

    probs: [B, H_kv, rows, S]; values: [B, H_kv, S'', D] with S'' >= S (rows past S are multiplied
    by 0: finite cache rows serve as padding without a copy). E.g. S = 300: n = 2 chunks, keys
    0..255 and 256..511 (probabilities past 299 are 0). One batched product makes the n partial
    sums (each over exactly VALUE_CHUNK keys), then they are added one after another.
    """
    bsz, kv_heads, rows, width = probs.shape
    chunks = -(-width // VALUE_CHUNK)
    keys = chunks * VALUE_CHUNK
    if width < keys:
        probs = torch.cat([probs, probs.new_zeros(bsz, kv_heads, rows, keys - width)], dim=-1)
    if values.shape[2] < keys:
        dim = values.shape[-1]
        values = torch.cat([values, values.new_zeros(bsz, kv_heads, keys - values.shape[2], dim)], dim=2)
    p = probs.view(bsz, kv_heads, rows, chunks, VALUE_CHUNK).transpose(2, 3)  # [B, H_kv, n, rows, C]
    v = values[:, :, :keys].reshape(bsz, kv_heads, chunks, VALUE_CHUNK, -1)  # [B, H_kv, n, C, D]
    parts = torch.matmul(p, v)  # [B, H_kv, n, rows, D]
    out = parts[:, :, 0]
    for i in range(1, chunks):  # in order: a chunk of masked keys adds exact zeros
        out = out + parts[:, :, i]
    return out
