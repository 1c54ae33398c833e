"""A step's decoder layers in one native call (``kernels/decoder_layers.cpp``, ``engine.native_layers``):
the bits of the Python layers it replaces, for every shape of step and every kernel format, and who
keeps the Python layers."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.kernels import kernels_module
from serve_app.engine.model import DecoderModel
from serve_app.engine.native_layers import build_native_layers, product_parts
from serve_app.engine.quantized import PaddedInputs, RowStack
from tests.conftest import make_tiny_hf_model
from tests.engine.quantized_helpers import q4k_m_blocks, require_built_kernels

require_built_kernels()

VOCAB = 300


def steps(model: DecoderModel) -> list[torch.Tensor]:
    """Hidden states and cache rows of the steps a server runs: one decode token, a 5-token verify, a
    batch of two rows at other lengths, a token tree (positions by depth, ancestor mask), a subset of
    layers (self-speculation), and a prefill long enough for the Python layers (SDPA)."""
    torch.manual_seed(11)
    cache = model.new_cache(3, 160)
    for slot, length in ((0, 9), (2, 21)):
        model.forward(torch.randint(0, VOCAB, (1, length)), cache, [slot])
        cache.set_length(slot, length)
    out = [model.forward(torch.randint(0, VOCAB, (1, 1)), cache, [0])]
    out.append(model.forward(torch.randint(0, VOCAB, (1, 5)), cache, [2]))
    out.append(model.forward(torch.randint(0, VOCAB, (2, 3)), cache, [0, 2]))
    parents = [-1, 0, 0, 1, 2]  # a root, two children, a grandchild under each
    depth = torch.tensor([0, 1, 1, 2, 2])
    mask = torch.eye(5, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    out.append(model.forward(torch.randint(0, VOCAB, (1, 5)), cache, [0], positions=(9 + depth)[None],
                             block_mask=mask[None]))  # fmt: skip
    out.append(model.forward(torch.randint(0, VOCAB, (1, 2)), cache, [2], layers=[1, 0]))
    out.append(model.forward(torch.randint(0, VOCAB, (1, 70)), cache, [1]))
    return out + [t.clone() for t in (*cache.k, *cache.v)]


def assert_native_equals_python(model: DecoderModel) -> None:
    assert build_native_layers(model.layers, kernels_module()) is not None
    native = steps(model)
    assert model._native is not None  # the steps ran the native layers
    model.native_steps = False
    python = steps(model)
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_q4k_m_target_runs_the_numbers_of_its_python_layers(arch) -> None:
    """Q4_K q/k with a Q6_K v (a stacked qkv), Q6_K down; Qwen2's q/k/v biases."""
    hf = make_tiny_hf_model(VOCAB, arch=arch, layers=2, hidden=256)
    model = DecoderModel.from_hf_model(hf, weight_format="gguf", blocks=q4k_m_blocks(hf))
    assert isinstance(model.layers[0].qkv, RowStack)
    assert_native_equals_python(model)


def test_q8_and_padded_q4k_matrices_run_the_numbers_of_their_python_layers() -> None:
    hf = make_tiny_hf_model(VOCAB, layers=2, hidden=64)  # 64 inputs: q4k pads them to 256
    q4k = DecoderModel.from_hf_model(hf, weight_format="q4k")
    assert isinstance(q4k.layers[0].qkv, PaddedInputs)
    assert [spec[3] for spec in product_parts(q4k.layers[0].qkv)] == [256]
    assert_native_equals_python(q4k)
    assert_native_equals_python(DecoderModel.from_hf_model(hf, weight_format="q8"))


def test_other_models_keep_the_python_layers() -> None:
    hf = make_tiny_hf_model(VOCAB, layers=2, hidden=64)
    kernels = kernels_module()
    assert build_native_layers(DecoderModel.from_hf_model(hf).layers, kernels) is None  # dense matrices
    bf16 = DecoderModel.from_hf_model(hf, torch.bfloat16, weight_format="q8")
    assert build_native_layers(bf16.layers, kernels) is None
    model = DecoderModel.from_hf_model(hf, weight_format="q8")
    model.native_steps = False
    cache = model.new_cache(1, 16)
    model.forward(torch.tensor([[1, 2]]), cache, [0])
    assert model._native is None and not model._native_built


def test_a_step_with_the_wrong_caches_is_refused_by_name() -> None:
    hf = make_tiny_hf_model(VOCAB, layers=2, hidden=64)
    model = DecoderModel.from_hf_model(hf, weight_format="q8")
    native = build_native_layers(model.layers, kernels_module())
    assert len(native) == 2
    cache = model.new_cache(1, 16)
    x = torch.zeros(1, 1, 64)
    cos = sin = torch.ones(1, 1, 16)
    every = torch.empty(0, dtype=torch.bool)  # every query sees every key
    with pytest.raises(RuntimeError, match="one key and one value cache per layer"):
        native.run(x, [0, 1], cache.k[:1], cache.v[:1], cos, sin, every, 1, [0], [0])
    with pytest.raises(RuntimeError, match="no layer 2"):
        native.run(x, [2], cache.k, cache.v, cos, sin, every, 1, [0], [0])
