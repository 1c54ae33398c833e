"""Few-query attention: keys padded from the cache's next rows equal keys padded with zeros."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.attention import grouped_attention
from serve_app.engine.invariance import RowPlan


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_read_from_the_cache_is_bit_identical_to_zero_padding(steps: int, dtype: torch.dtype) -> None:
    torch.manual_seed(steps)
    width, block = 45, 32  # 45 keys exist; padded to 64
    q = torch.randn(1, 6, steps, 16, dtype=dtype)  # 6 query heads over 2 KV heads
    cache_k = torch.randn(1, 2, 80, 16, dtype=dtype) * 50  # rows past 45: earlier garbage
    cache_v = torch.randn(1, 2, 80, 16, dtype=dtype) * 50
    mask = None if steps == 1 else torch.rand(1, 1, steps, width) > 0.3
    if mask is not None:
        mask[..., 0] = True  # every query sees at least one key
    plan = RowPlan(frozenset(range(6, 17)), tail_from=6)
    copied = grouped_attention(q, cache_k[:, :, :width], cache_v[:, :, :width], mask, 0.25, plan, block)
    read = grouped_attention(q, cache_k, cache_v, mask, 0.25, plan, block, width=width)
    assert torch.equal(read, copied)
    # and without padding the same attention, within rounding
    plain = grouped_attention(q, cache_k[:, :, :width], cache_v[:, :, :width], mask, 0.25)
    torch.testing.assert_close(read.float(), plain.float(), rtol=2e-2, atol=2e-2)
