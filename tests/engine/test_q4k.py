"""The gguf weight format's Q4_K product: the GGUF's 4-bit blocks times int8 activations.

Like Q8, exact in the rows by construction (integer sums per super-block, float steps in a fixed
order), so speculation on a Q4_K target is bit-exact against its plain decoding.
"""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.exactness import make_exact
from serve_app.engine.invariance import probe_rows
from serve_app.engine.kernels import kernels_module
from serve_app.engine.model import DecoderModel
from serve_app.engine.q4k_weight import Q4KBlocks, Q4KWeight, unpack_nibbles
from serve_app.engine.q8_weight import Q8Weight
from serve_app.engine.quantized import PaddedInputs, RowStack, concat_rows
from serve_app.engine.weights import linear, product_kind
from tests.conftest import make_tiny_engine, make_tiny_hf_model
from tests.engine.quantized_helpers import assert_speculation_equals_plain, require_built_kernels

require_built_kernels()


def reference(x: torch.Tensor, weight: Q4KWeight) -> torch.Tensor:
    """The same arithmetic in float64: dequantized weights times activations quantized per 256."""
    supers = x.float().reshape(x.shape[0], -1, 256)
    scale = supers.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale.clamp(min=1e-30), 0.0)  # the kernel multiplies by 1 / s
    xq = (torch.round(supers * inverse).clamp(-127, 127) * scale).reshape(x.shape)
    return xq.double() @ weight.dequantize().double().T


def gguf_blocks(hf: torch.nn.Module) -> dict[str, Q4KWeight]:
    """What a GGUF's Q4_K tensors would give for ``hf``'s layer matrices."""
    return {
        name: Q4KWeight.quantize(tensor)
        for name, tensor in hf.state_dict().items()
        if name.startswith("model.layers.") and tensor.dim() == 2
    }


def test_quantize_dequantize_and_sizes() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 512)
    q = Q4KWeight.quantize(weight)
    assert q.shape == (64, 512)
    assert q.nbytes == 64 * (256 + 2 * 2 * 2 + 2 * 16)  # 4.625 bits per weight
    error = (q.dequantize() - weight).norm() / weight.norm()
    assert error < 0.1
    again = Q4KWeight.quantize(q.dequantize())  # the nibble order survives a round trip
    assert torch.equal(again.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="multiples of 256"):
        Q4KWeight.quantize(torch.randn(4, 96))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_quantized_product(dtype) -> None:
    torch.manual_seed(1)
    weight = Q4KWeight.quantize(torch.randn(72, 768))
    x = torch.randn(6, 768).to(dtype)
    got = kernels_module().q4k_linear(x, weight.tiles, weight.out_features)
    want = reference(x, weight)
    assert got.dtype == torch.float32 and got.shape == (6, 72)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, weight), got.to(dtype))


def test_the_kernel_refuses_mismatched_tiles() -> None:
    weight = Q4KWeight.quantize(torch.randn(40, 512))
    kernels = kernels_module()
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.q4k_linear(torch.randn(1, 128), weight.tiles, 40)
    with pytest.raises(RuntimeError, match="the tiles hold 512 inputs, x has 256"):
        kernels.q4k_linear(torch.randn(1, 256), weight.tiles, 40)
    with pytest.raises(RuntimeError, match="3 groups of 16 cannot hold 49 outputs"):
        kernels.q4k_linear(torch.randn(1, 512), weight.tiles, 49)
    with pytest.raises(RuntimeError, match="tiles must be uint8"):
        kernels.q4k_linear(torch.randn(1, 512), weight.tiles.view(torch.int8), 40)


@pytest.mark.parametrize("out_features", [16, 40, 67])
def test_tiles_hold_the_gguf_blocks_exactly(out_features: int) -> None:
    """The kernel's layout is a permutation of the GGUF's: both ways round, bit for bit."""
    torch.manual_seed(out_features)
    blocks = Q4KBlocks.quantize(torch.randn(out_features, 768))
    weight = Q4KWeight.from_blocks(blocks)
    assert weight.tiles.shape == (-(-out_features // 16), 3, 2368)
    assert weight.shape == (out_features, 768)
    back = weight.blocks()
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), blocks.tensors(), strict=True))
    assert torch.equal(weight.dequantize(), blocks.dequantize())
    # a tile is what q4k_tiles.h says: output 5's d first, its q at input 17 (block 0, high nibble)
    tile = weight.tiles[0, 0]
    assert tile[10:12].view(torch.int16).item() == blocks.d[5, 0].item()
    q = unpack_nibbles(blocks.qs)
    assert tile[320 + 0 * 64 + 4 * 5 + 1] >> 4 == q[5, 17]


def test_concat_keeps_whole_groups_and_retiles_the_rest() -> None:
    torch.manual_seed(4)
    parts = [Q4KWeight.quantize(torch.randn(n, 256)) for n in (32, 16, 8)]
    dense = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(Q4KWeight.concat(parts).dequantize(), dense)
    odd = [parts[2], parts[0]]  # 8 outputs then 32: the group boundary moves
    assert torch.equal(Q4KWeight.concat(odd).dequantize(), torch.cat([p.dequantize() for p in odd]))


def test_rows_agree_at_every_count() -> None:
    weight = Q4KWeight.quantize(torch.randn(200, 512))
    plan = probe_rows(lambda x: linear(x, weight), 512, torch.float32, torch.device("cpu"))
    assert plan.tail_from == 1 and plan.padded(1) == 1
    x = torch.randn(9, 512)
    each = torch.cat([linear(x[i : i + 1], weight) for i in range(9)])
    assert torch.equal(each, linear(x, weight))


def test_concat_rows_fuses_one_format_and_stacks_mixed_ones() -> None:
    torch.manual_seed(2)
    q, k, v = (Q4KWeight.quantize(torch.randn(n, 256)) for n in (32, 16, 16))
    v8 = Q8Weight.quantize(torch.randn(16, 256))
    fused = concat_rows([q, k, v])
    assert isinstance(fused, Q4KWeight) and fused.shape == (64, 256)
    mixed = concat_rows([q, k, v8])
    assert isinstance(mixed, RowStack) and mixed.shape == (64, 256) and len(mixed.parts) == 2
    assert product_kind(mixed) == "stack q4k 48x256 + q8 16x256"
    x = torch.randn(3, 256)
    assert torch.equal(linear(x, mixed), torch.cat([linear(x, q), linear(x, k), linear(x, v8)], dim=-1))
    assert mixed.nbytes == q.nbytes + k.nbytes + v8.nbytes


def test_a_gguf_target_is_exact_and_close_to_the_dense_one() -> None:
    hf = make_tiny_hf_model(300, layers=2, hidden=256)
    dense = DecoderModel.from_hf_model(hf)
    gguf = DecoderModel.from_hf_model(hf, weight_format="gguf", blocks=gguf_blocks(hf))
    assert isinstance(gguf.layers[0].qkv, Q4KWeight) and isinstance(gguf.lm_head, Q8Weight)
    found = make_exact(gguf)
    assert found.exact
    tokens = torch.tensor([[5, 9, 11, 2, 7, 30, 42, 3]])
    logits = {}
    for name, model in (("dense", dense), ("gguf", gguf)):
        cache = model.new_cache(1, 32)
        logits[name] = model.logits(model.forward(tokens, cache, [cache.allocate()]))
    gap = (logits["gguf"] - logits["dense"]).abs().max() / logits["dense"].abs().max()
    assert gap < 0.3  # 4-bit random weights (~8% error per matrix); the real figures: bench --quality
    assert (logits["gguf"].argmax(-1) == logits["dense"].argmax(-1)).float().mean() >= 0.6


def test_speculation_on_a_gguf_target_equals_its_plain_decoding(tiny_tokenizer) -> None:
    hf = make_tiny_hf_model(tiny_tokenizer.vocab_size, layers=2, hidden=256)
    model = DecoderModel.from_hf_model(hf, weight_format="gguf", blocks=gguf_blocks(hf))
    engine = make_tiny_engine(model, tiny_tokenizer, proposers=["ngram", "self"], method="ngram")
    assert_speculation_equals_plain(engine, tiny_tokenizer)


def test_an_untied_head_in_the_blocks_is_the_heads_own(tmp_path) -> None:
    """from_pretrained skips the dense copies of blocked layer matrices, never the untied head's."""
    from safetensors.torch import save_file

    from serve_app.engine.block_file import BLOCKS_FILE, FORMAT, tensors_of

    hf = make_tiny_hf_model(300, layers=1, hidden=256)  # untied head
    hf.save_pretrained(tmp_path)
    blocks = {**gguf_blocks(hf), "lm_head.weight": Q8Weight.quantize(hf.lm_head.weight.detach())}
    entries = {k: v for name, w in blocks.items() for k, v in tensors_of(name, w).items()}
    save_file(entries, str(tmp_path / BLOCKS_FILE), metadata={"format": FORMAT})
    model = DecoderModel.from_pretrained(tmp_path, torch.float32, weight_format="gguf")
    head = blocks["lm_head.weight"]
    assert torch.equal(model.lm_head.tiles, head.tiles)
    assert isinstance(model.layers[0].gate_up, Q4KWeight)


def test_padded_inputs_compute_the_unpadded_product_at_every_row_count() -> None:
    """The q4k format's 896-wide matrices: zero weights pad the inputs to 1024, the activations too."""
    torch.manual_seed(3)
    dense = torch.randn(40, 896)
    weight = PaddedInputs.quantize(dense)
    assert isinstance(weight, PaddedInputs) and weight.shape == (40, 896)
    assert weight.weight.shape == (40, 1024)
    assert product_kind(weight) == "q4k 40x896 padded to 1024"
    assert isinstance(PaddedInputs.quantize(torch.randn(8, 512)), Q4KWeight)  # whole super-blocks: as is
    x = torch.randn(7, 896)
    padded_x = torch.nn.functional.pad(x, (0, 128))
    assert torch.equal(linear(x, weight), linear(padded_x, weight.weight))
    want = reference(padded_x, weight.weight)
    assert torch.allclose(linear(x, weight).double(), want, rtol=1e-5, atol=1e-4)
    each = torch.cat([linear(x[i : i + 1], weight) for i in range(7)])
    assert torch.equal(each, linear(x, weight))
    assert (weight.weight.dequantize()[:, 896:] == 0).all()


def test_a_q4k_draft_keeps_speculation_exact(tiny_tokenizer) -> None:
    """A draft with every matrix in 4 bits (widths not multiples of 256: padded) drafts well enough
    and never changes the output: verification decides."""
    from serve_app.engine.params import SamplingParams, SpecOverride
    from serve_app.engine.proposers.draft_model import DraftModelProposer

    hf = make_tiny_hf_model(tiny_tokenizer.vocab_size, layers=2, hidden=64)
    draft = DecoderModel.from_hf_model(hf, weight_format="q4k")
    layer = draft.layers[0]
    assert all(isinstance(w, PaddedInputs) for w in (layer.qkv, layer.o, layer.gate_up))
    assert isinstance(draft.lm_head, PaddedInputs)
    target = DecoderModel.from_hf_model(hf)
    proposer = DraftModelProposer(draft, target.cfg.vocab_size, max_slots=8, max_seq_len=128)
    engine = make_tiny_engine(target, tiny_tokenizer, proposers={"draft": proposer}, method="draft")
    prompts = [tiny_tokenizer(p)["input_ids"] for p in ("def add(a, b):", "for i in range(10):")]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)]  # fmt: skip
    plain = [r.token_ids for r in engine.generate(prompts, params, SpecOverride("off"))]
    drafted = engine.generate(prompts, params, SpecOverride("draft", 4))
    assert [r.token_ids for r in drafted] == plain
    stats = drafted[0].spec_stats
    assert stats.drafted > 0 and stats.accepted / stats.drafted > 0.5  # the same model, 4-bit


@pytest.mark.parametrize(
    ("target", "has_blocks", "want"),
    [
        ("gguf", True, "q4k"),  # 4 bits throughout: the fewest bytes per draft token
        ("gguf", False, "q8"),  # no blocks to take
        ("q8", True, "q8"),
        ("dense", True, "dense"),
    ],
)
def test_a_draft_takes_the_target_format_but_q4k_for_gguf(target, has_blocks, want):
    from serve_app.engine.proposers.draft_model import draft_format_for

    assert draft_format_for(target, has_blocks) == want
