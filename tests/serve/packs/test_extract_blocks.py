"""GGUF blocks -> the gguf weight format, value for value (against gguf-py's own dequantization)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q8_weight import Q8Weight
from serve_app.packs.extract_blocks import (
    checkpoint_name,
    matching,
    q4k_from_blocks,
    q6k_from_blocks,
    q8_from_blocks,
)

BLOCK_BYTES = {Q.Q4_K: 144, Q.Q6_K: 210, Q.Q8_0: 34, Q.Q5_0: 22, Q.Q4_0: 18}
BLOCK_VALUES = {Q.Q4_K: 256, Q.Q6_K: 256, Q.Q8_0: 32, Q.Q5_0: 32, Q.Q4_0: 32}


def random_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``kind`` with sane fp16 scales (random bytes there could be inf or NaN)."""
    rng = np.random.default_rng(seed)
    blocks = cols // BLOCK_VALUES[kind]
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    scale_bytes = 4 if kind == Q.Q4_K else 2  # Q4_K: d and dmin; the others: d
    scales = rng.uniform(0.001, 0.05, size=(rows, blocks, scale_bytes // 2)).astype(np.float16)
    where = slice(208, 210) if kind == Q.Q6_K else slice(0, scale_bytes)  # Q6_K keeps its d last
    raw[..., where] = scales.view(np.uint8).reshape(rows, blocks, scale_bytes)
    return raw.reshape(rows, blocks * BLOCK_BYTES[kind])


def dense_of(weight: Q4KWeight | Q8Weight) -> torch.Tensor:
    return weight.dequantize()


def test_q4k_blocks_keep_every_value() -> None:
    raw = random_blocks(Q.Q4_K, 32, 512)
    weight = q4k_from_blocks(raw, 32, 512)
    want = torch.from_numpy(dequantize(raw, Q.Q4_K).reshape(32, 512))
    assert torch.equal(weight.dequantize(), want)
    assert weight.nbytes < raw.nbytes * 1.03  # 4.625 bits per weight against the file's 4.5
    few = q4k_from_blocks(raw[:6], 6, 512)  # tiles hold 16 outputs: the last one zero-padded
    assert torch.equal(few.dequantize(), want[:6]) and few.nbytes == weight.nbytes // 2


def test_q6k_blocks_keep_every_value() -> None:
    raw = random_blocks(Q.Q6_K, 20, 768, seed=6)
    weight = q6k_from_blocks(raw, 20, 768)
    want = torch.from_numpy(dequantize(raw, Q.Q6_K).reshape(20, 768))
    assert torch.equal(weight.dequantize(), want)
    assert weight.nbytes < raw.nbytes * 32 / 20 * 1.02  # 6.625 bits per weight (+ the last group's padding)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q5_0, Q.Q4_0])
def test_small_integer_blocks_are_exact_in_q8(kind: Q) -> None:
    raw = random_blocks(kind, 5, 96, seed=int(kind))
    weight = q8_from_blocks(raw, 5, 96, kind)
    want = torch.from_numpy(dequantize(raw, kind).reshape(5, 96))
    assert torch.equal(dense_of(weight), want)


def test_matching_takes_back_the_llama_row_order() -> None:
    weight = q4k_from_blocks(random_blocks(Q.Q4_K, 16, 256, seed=3), 16, 256)
    dense = weight.dequantize().to(torch.bfloat16)
    assert torch.equal(dense_of(matching(weight, dense, heads=(4,))), weight.dequantize())
    # llama.cpp stores each head's rows as (i, half) where the checkpoint has (half, i)
    heads, per_half = 2, 4
    stored = torch.arange(16).reshape(heads, 2, per_half).transpose(1, 2).reshape(16)
    as_stored = Q4KWeight.from_blocks(weight.blocks().select_rows(stored))
    found = matching(as_stored, dense, heads=(heads,))
    assert found is not None and torch.equal(found.dequantize(), weight.dequantize())
    assert matching(as_stored, dense, heads=(8,)) is None  # no order matches: left out, not guessed


def test_checkpoint_names() -> None:
    assert checkpoint_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert checkpoint_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert checkpoint_name("token_embd.weight") == "model.embed_tokens.weight"
    assert checkpoint_name("output.weight") == "lm_head.weight"
    assert checkpoint_name("blk.0.attn_norm.weight") is None
    assert checkpoint_name("blk.0.attn_q.bias") is None
