"""Our float32 layer steps (``kernels/layer_ops.cpp``): RMS norm and the attention of few queries.

Both must be exact in the rows by construction (a query's output the same alone, among others,
with any number of masked keys or threads) and close to the float64 arithmetic they stand for."""

from __future__ import annotations

import math

import pytest
import torch

from serve_app.engine.attention import grouped_attention, native_kernels
from serve_app.engine.kernels import kernels_module
from tests.engine.quantized_helpers import require_built_kernels

require_built_kernels()


def reference_attention(q, keys, values, mask, width):  # float64, heads expanded
    group = q.shape[1] // keys.shape[1]
    k = keys[:, :, :width].repeat_interleave(group, 1).double()
    v = values[:, :, :width].repeat_interleave(group, 1).double()
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(("steps", "width"), [(1, 1), (1, 300), (5, 97), (17, 700)])
def test_attention_is_the_softmax_and_exact_in_the_rows(steps: int, width: int) -> None:
    torch.manual_seed(steps * width)
    bsz, heads, kv_heads, dim = 2, 12, 2, 128
    q = torch.randn(bsz, heads, steps, dim)
    keys, values = torch.randn(bsz, kv_heads, width + 40, dim), torch.randn(bsz, kv_heads, width + 40, dim)
    mask = None if steps == 1 else torch.rand(bsz, 1, steps, width) > 0.3
    if mask is not None:
        mask[..., 0] = True
    scale = 1 / math.sqrt(dim)
    got = grouped_attention(q, keys, values, mask, scale, width=width)
    assert got.shape == (bsz, heads, steps, dim)
    torch.testing.assert_close(got.double(), reference_attention(q, keys, values, mask, width), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    for t in range(steps):  # each query alone
        one_mask = None if mask is None else mask[:, :, t : t + 1]
        alone = grouped_attention(q[:, :, t : t + 1], keys, values, one_mask, scale, width=width)
        assert torch.equal(alone, got[:, :, t : t + 1])
    for b in range(bsz):  # each row of the batch alone
        row_mask = None if mask is None else mask[b : b + 1]
        row = grouped_attention(
            q[b : b + 1], keys[b : b + 1], values[b : b + 1], row_mask, scale, width=width
        )
        assert torch.equal(row, got[b : b + 1])
    # 40 more keys, all masked: the same bits
    wider = torch.ones(bsz, 1, steps, width + 40, dtype=torch.bool) if mask is None else torch.cat(
        [mask, torch.zeros(bsz, 1, steps, 40, dtype=torch.bool)], dim=-1)  # fmt: skip
    if mask is None:
        wider[..., width:] = False
    assert torch.equal(grouped_attention(q, keys, values, wider, scale, width=width + 40), got)


def test_attention_takes_strided_cache_views() -> None:
    torch.manual_seed(1)
    cache_k, cache_v = torch.randn(4, 2, 64, 32), torch.randn(4, 2, 64, 32)  # [slots, H_kv, L, D]
    q = torch.randn(1, 6, 1, 32)
    view = grouped_attention(q, cache_k[2:3, :, :50], cache_v[2:3, :, :50], None, 0.2)
    copy = grouped_attention(q, cache_k[2:3, :, :50].clone(), cache_v[2:3, :, :50].clone(), None, 0.2)
    assert torch.equal(view, copy)


def test_only_float32_cpu_queries_take_the_kernel() -> None:
    assert native_kernels(torch.zeros(1, dtype=torch.float32)) is not None
    assert native_kernels(torch.zeros(1, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_per_row(rows: int) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 1536) * 3, torch.randn(1536)
    kernels = kernels_module()
    got = kernels.rms_norm(x, w, 1e-6)
    want = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([kernels.rms_norm(x[i : i + 1], w, 1e-6) for i in range(rows)]), got)
    assert torch.equal(kernels.rms_norm(x.view(1, rows, 1536), w, 1e-6).view(rows, 1536), got)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(x, w[:100], 1e-6)
