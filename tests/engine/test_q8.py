"""The Q8 weight format: int8 weights with a scale per 32 inputs, int8 activations, our kernel.

Its products are exact in the rows by construction (integer block sums, float steps in a fixed
order), so a target may run on it and speculation stays bit-exact against plain decoding of the
same weights; against the dense weights it is close, not equal.
"""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.exactness import make_exact
from serve_app.engine.invariance import probe_rows
from serve_app.engine.kernels import kernels_module
from serve_app.engine.model import DecoderModel
from serve_app.engine.q8_weight import Q5Weight, Q8Blocks, Q8Weight, fits_q5
from serve_app.engine.weights import linear
from tests.conftest import make_tiny_engine, make_tiny_hf_model
from tests.engine.quantized_helpers import assert_speculation_equals_plain, require_built_kernels

require_built_kernels()


def reference(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """The same arithmetic in float64: dequantized weights times row-quantized activations."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale.clamp(min=1e-30), 0.0)  # the kernel multiplies by 1 / s
    xq = torch.round(blocks * inverse) * scale
    return xq.reshape(x.shape).double() @ weight.dequantize().double().T


def test_quantized_weights_are_close_to_the_dense_ones() -> None:
    weight = torch.randn(64, 256)
    q = Q8Weight.quantize(weight)
    assert (q.dequantize() - weight).abs().max() <= weight.abs().max() / 127
    assert q.nbytes == 64 * 256 + 2 * 64 * 8  # 8.5 bits per weight
    with pytest.raises(ValueError, match="multiples of 32"):
        Q8Weight.quantize(torch.randn(4, 40))


@pytest.mark.parametrize(("out_features", "in_features"), [(16, 64), (40, 320), (67, 1632), (5, 32)])
def test_tiles_hold_the_blocks_exactly(out_features: int, in_features: int) -> None:
    """The kernel's layout is a permutation of the plain one (values offset by 128): both ways round."""
    torch.manual_seed(out_features)
    blocks = Q8Blocks.quantize(torch.randn(out_features, in_features))
    weight = Q8Weight.from_blocks(blocks)
    assert weight.tiles.shape == (-(-out_features // 16), -(-in_features // 64), 1088)
    back = weight.blocks()
    assert torch.equal(back.data, blocks.data) and torch.equal(back.scales, blocks.scales)
    # what q8_tiles.h says: the scales of a tile's two blocks first, then its values (u = q + 128)
    tile = weight.tiles[0, 0]
    assert tile[2 * 3 : 2 * 3 + 2].view(torch.int16).item() == blocks.scales[3, 0].item()
    assert tile[64 + 64 * 1 + 4 * 3 + 2].item() == blocks.data[3, 6].item() + 128


def test_the_kernel_refuses_mismatched_tiles() -> None:
    weight = Q8Weight.quantize(torch.randn(40, 320))
    kernels = kernels_module()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.q8_linear(torch.randn(1, 40), weight.tiles, 40, 8)
    with pytest.raises(RuntimeError, match="the tiles hold 320 inputs, x has 256"):
        kernels.q8_linear(torch.randn(1, 256), weight.tiles, 40, 8)
    with pytest.raises(RuntimeError, match="3 groups of 16 cannot hold 30 outputs"):
        kernels.q8_linear(torch.randn(1, 320), weight.tiles, 30, 8)
    with pytest.raises(RuntimeError, match="tiles must be uint8"):
        kernels.q8_linear(torch.randn(1, 320), weight.tiles, 40, 5)  # Q8 tiles read as Q5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_quantized_product(dtype) -> None:
    torch.manual_seed(0)
    weight = Q8Weight.quantize(torch.randn(96, 320))
    x = torch.randn(5, 320).to(dtype)
    got = kernels_module().q8_linear(x, weight.tiles, weight.out_features, 8)
    want = reference(x, weight)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, weight), got.to(dtype))


def test_rows_agree_at_every_count() -> None:
    weight = Q8Weight.quantize(torch.randn(200, 512))
    plan = probe_rows(lambda x: linear(x, weight), 512, torch.float32, torch.device("cpu"))
    assert plan.tail_from == 1 and plan.padded(1) == 1


def test_a_q8_target_is_exact_and_close_to_the_dense_one() -> None:
    hf = make_tiny_hf_model(300, layers=2)
    dense = DecoderModel.from_hf_model(hf)
    q8 = DecoderModel.from_hf_model(hf, weight_format="q8")
    found = make_exact(q8)
    assert found.exact and all(p.tail_from == 1 for k, p in found.plans.items() if k.startswith("q8"))
    tokens = torch.tensor([[5, 9, 11, 2, 7, 30, 42, 3]])
    logits = {}
    for name, model in (("dense", dense), ("q8", q8)):
        cache = model.new_cache(1, 32)
        logits[name] = model.logits(model.forward(tokens, cache, [cache.allocate()]))
    gap = (logits["q8"] - logits["dense"]).abs().max() / logits["dense"].abs().max()
    assert gap < 0.05
    assert (logits["q8"].argmax(-1) == logits["dense"].argmax(-1)).float().mean() >= 0.75


def test_speculation_on_a_q8_target_equals_its_plain_decoding(tiny_tokenizer) -> None:
    hf = make_tiny_hf_model(tiny_tokenizer.vocab_size, layers=2)
    engine = make_tiny_engine(
        hf, tiny_tokenizer, proposers=["ngram", "self"], method="ngram", weight_format="q8"
    )
    assert_speculation_equals_plain(engine, tiny_tokenizer)


@pytest.mark.parametrize(("out_features", "in_features"), [(16, 64), (40, 896), (67, 1632)])
def test_q5_holds_five_bit_values_and_computes_q8s_numbers(out_features: int, in_features: int) -> None:
    """Values in [-16, 15] (the GGUF's Q5_0 / Q4_0 blocks) in 5 bits: the same blocks back, and every
    product bit for bit the Q8 product of the same values, from 35% fewer bytes."""
    torch.manual_seed(out_features)
    weight = Q5Weight.quantize(torch.randn(out_features, in_features))
    blocks = weight.blocks()
    assert fits_q5(blocks) and not fits_q5(Q8Blocks.quantize(torch.randn(4, 64)))
    assert weight.tiles.shape == (-(-out_features // 16), -(-in_features // 64), 704)
    again = Q5Weight.from_blocks(blocks).blocks()
    assert torch.equal(again.data, blocks.data) and torch.equal(again.scales, blocks.scales)
    q8 = Q8Weight.from_blocks(blocks)
    assert weight.nbytes < 0.65 * q8.nbytes
    for rows in (1, 5, 17):  # VNNI, its groups of rows, AMX's chunks
        x = torch.randn(rows, in_features)
        assert torch.equal(weight.matmul(x), q8.matmul(x))
    with pytest.raises(ValueError, match=r"\[-16, 15\]"):
        Q5Weight.from_blocks(Q8Blocks.quantize(torch.randn(4, 64)))
