"""The gguf weight format's Q6_K product: the GGUF's 6-bit blocks times int8 activations.

Like Q4_K, exact in the rows by construction (integer sums per super-block, one float step per
super-block in a fixed order), so speculation on a target with Q6_K matrices is bit-exact against
its plain decoding.
"""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.exactness import make_exact
from serve_app.engine.invariance import probe_rows
from serve_app.engine.kernels import kernels_module
from serve_app.engine.model import DecoderModel
from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q6k_weight import Q6KBlocks, Q6KWeight, pack_crumbs, unpack_crumbs
from serve_app.engine.quantized import RowStack, concat_rows
from serve_app.engine.weights import linear, product_kind
from tests.conftest import make_tiny_engine, make_tiny_hf_model
from tests.engine.quantized_helpers import (
    assert_speculation_equals_plain,
    q4k_m_blocks,
    require_built_kernels,
)

require_built_kernels()


def reference(x: torch.Tensor, weight: Q6KWeight) -> torch.Tensor:
    """The same arithmetic in float64: dequantized weights times activations quantized per 256."""
    supers = x.float().reshape(x.shape[0], -1, 256)
    scale = supers.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale.clamp(min=1e-30), 0.0)  # the kernel multiplies by 1 / s
    xq = (torch.round(supers * inverse).clamp(-127, 127) * scale).reshape(x.shape)
    return xq.double() @ weight.dequantize().double().T


def test_quantize_dequantize_and_sizes() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 512)
    q = Q6KWeight.quantize(weight)
    assert q.shape == (64, 512)
    assert q.nbytes == 64 * 2 * 3392 // 16  # 6.625 bits per weight (the GGUF's 6.5625 and a line)
    error = (q.dequantize() - weight).norm() / weight.norm()
    assert error < 0.03
    with pytest.raises(ValueError, match="multiples of 256"):
        Q6KWeight.quantize(torch.randn(4, 96))


def test_two_bit_packing_round_trips() -> None:
    high = torch.randint(0, 4, (3, 512), dtype=torch.uint8)
    packed = pack_crumbs(high)
    assert packed.shape == (3, 128)
    assert torch.equal(unpack_crumbs(packed), high)
    assert (packed[0, 5] >> 2) & 3 == high[0, 37]  # byte 5 of the first 128: input 32 + 5 in bits 2, 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_quantized_product(dtype) -> None:
    torch.manual_seed(1)
    weight = Q6KWeight.quantize(torch.randn(72, 768))
    x = torch.randn(6, 768).to(dtype)
    got = kernels_module().q6k_linear(x, weight.tiles, weight.out_features)
    want = reference(x, weight)
    assert got.dtype == torch.float32 and got.shape == (6, 72)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, weight), got.to(dtype))


def test_extreme_values_stay_exact_in_int32() -> None:
    """Scales of -128 and 127, q of 0 and 63, activations at +-127: the integer sums' worst case."""
    out_features, in_features = 16, 512
    q = torch.where(torch.arange(in_features) % 2 == 0, 63, 0).repeat(out_features, 1)
    scales = torch.full((out_features, in_features // 16), -128, dtype=torch.int8)
    scales[::2] = 127
    d = torch.full((out_features, in_features // 256), 0.001, dtype=torch.float16).view(torch.int16)
    weight = Q6KWeight.from_blocks(Q6KBlocks.from_values(q, scales, d))
    x = torch.where(torch.arange(in_features) % 3 == 0, 1.0, -1.0).repeat(2, 1)
    got = weight.matmul(x)
    assert torch.allclose(got.double(), reference(x, weight), rtol=1e-6, atol=1e-4)


def test_the_kernel_refuses_mismatched_tiles() -> None:
    weight = Q6KWeight.quantize(torch.randn(40, 512))
    kernels = kernels_module()
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.q6k_linear(torch.randn(1, 128), weight.tiles, 40)
    with pytest.raises(RuntimeError, match="the tiles hold 512 inputs, x has 256"):
        kernels.q6k_linear(torch.randn(1, 256), weight.tiles, 40)
    with pytest.raises(RuntimeError, match="3 groups of 16 cannot hold 49 outputs"):
        kernels.q6k_linear(torch.randn(1, 512), weight.tiles, 49)
    with pytest.raises(RuntimeError, match="tiles must be uint8"):
        kernels.q6k_linear(torch.randn(1, 512), weight.tiles.view(torch.int8), 40)


@pytest.mark.parametrize("out_features", [16, 40, 67])
def test_tiles_hold_the_blocks_exactly(out_features: int) -> None:
    """The kernel's layout is a permutation of the blocks': both ways round, bit for bit."""
    torch.manual_seed(out_features)
    blocks = Q6KBlocks.quantize(torch.randn(out_features, 768))
    weight = Q6KWeight.from_blocks(blocks)
    assert weight.tiles.shape == (-(-out_features // 16), 3, 3392)
    back = weight.blocks()
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), blocks.tensors(), strict=True))
    assert torch.equal(weight.dequantize(), blocks.dequantize())
    # a tile is what q6k_tiles.h says: output 5's d first; its scale of sub-block 3 in pair 1;
    # its q at input 21 (block 0, high nibble of vector 1, byte 4 * 5 + 1), its top bits in bits 2, 3
    # of byte 4 * 5 + 1 of the block's second top-bits vector
    tile, q = weight.tiles[0, 0], blocks.values()
    assert tile[10:12].view(torch.int16).item() == blocks.d[5, 0].item()
    assert tile[32 + 32 * 1 + 2 * 5 + 1].view(torch.int8).item() == blocks.scales[5, 3].item()
    byte = 4 * 5 + 1
    low = tile[320 + 64 * 1 + byte] >> 4
    top = (tile[320 + 256 + 64 + byte] >> 2) & 3
    assert low | (top << 4) == q[5, 21]


def test_concat_keeps_whole_groups_and_retiles_the_rest() -> None:
    torch.manual_seed(4)
    parts = [Q6KWeight.quantize(torch.randn(n, 256)) for n in (32, 16, 8)]
    dense = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(Q6KWeight.concat(parts).dequantize(), dense)
    odd = [parts[2], parts[0]]  # 8 outputs then 32: the group boundary moves
    assert torch.equal(Q6KWeight.concat(odd).dequantize(), torch.cat([p.dequantize() for p in odd]))


def test_rows_agree_at_every_count() -> None:
    weight = Q6KWeight.quantize(torch.randn(200, 512))
    plan = probe_rows(lambda x: linear(x, weight), 512, torch.float32, torch.device("cpu"))
    assert plan.tail_from == 1 and plan.padded(1) == 1
    x = torch.randn(9, 512)
    each = torch.cat([linear(x[i : i + 1], weight) for i in range(9)])
    assert torch.equal(each, linear(x, weight))


def test_concat_rows_stacks_q4k_and_q6k() -> None:
    torch.manual_seed(2)
    q, k = (Q4KWeight.quantize(torch.randn(n, 256)) for n in (32, 16))
    v = Q6KWeight.quantize(torch.randn(16, 256))
    mixed = concat_rows([q, k, v])
    assert isinstance(mixed, RowStack) and mixed.shape == (64, 256)
    assert product_kind(mixed) == "stack q4k 48x256 + q6k 16x256"
    x = torch.randn(3, 256)
    assert torch.equal(linear(x, mixed), torch.cat([linear(x, q), linear(x, k), linear(x, v)], dim=-1))


def test_a_target_with_q6k_matrices_is_exact_and_close_to_the_dense_one() -> None:
    hf = make_tiny_hf_model(300, layers=2, hidden=256)
    dense = DecoderModel.from_hf_model(hf)
    gguf = DecoderModel.from_hf_model(hf, weight_format="gguf", blocks=q4k_m_blocks(hf))
    assert isinstance(gguf.layers[0].qkv, RowStack) and isinstance(gguf.lm_head, Q6KWeight)
    assert make_exact(gguf).exact
    tokens = torch.tensor([[5, 9, 11, 2, 7, 30, 42, 3]])
    logits = {}
    for name, model in (("dense", dense), ("gguf", gguf)):
        cache = model.new_cache(1, 32)
        logits[name] = model.logits(model.forward(tokens, cache, [cache.allocate()]))
    gap = (logits["gguf"] - logits["dense"]).abs().max() / logits["dense"].abs().max()
    assert gap < 0.3
    assert (logits["gguf"].argmax(-1) == logits["dense"].argmax(-1)).float().mean() >= 0.6


def test_speculation_on_a_target_with_q6k_matrices_equals_its_plain_decoding(tiny_tokenizer) -> None:
    hf = make_tiny_hf_model(tiny_tokenizer.vocab_size, layers=2, hidden=256)
    model = DecoderModel.from_hf_model(hf, weight_format="gguf", blocks=q4k_m_blocks(hf))
    assert isinstance(model.lm_head, Q6KWeight)
    engine = make_tiny_engine(model, tiny_tokenizer, proposers=["ngram", "self"], method="ngram")
    assert_speculation_equals_plain(engine, tiny_tokenizer)
