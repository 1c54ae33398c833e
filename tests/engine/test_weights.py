"""Weight formats: every kernel of ``linear`` computes x @ W.T (+ b) within its format's error."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.quantized import Int8Weight
from serve_app.engine.weights import linear, onednn_bf16_supported, prepack, weight_nbytes


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.fixture
def weight_and_input() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 256, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16)
    return weight, x


@pytest.mark.parametrize("use_fbgemm", [True, False])
def test_int8_weight_matches_the_dense_product(weight_and_input, use_fbgemm: bool) -> None:
    weight, x = weight_and_input
    if use_fbgemm and not any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm")):
        pytest.skip("no x86/fbgemm quantized engine in this torch build")
    bias = torch.randn(300).to(torch.bfloat16)
    q = Int8Weight.quantize(weight, use_fbgemm=use_fbgemm)
    assert (q.packed is not None) == use_fbgemm and (q.data is None) == use_fbgemm
    y = linear(x, q, bias)
    ref = x.float() @ weight.float().T + bias.float()
    assert y.shape == (2, 3, 300) and y.dtype == torch.bfloat16
    # per-row int8 weights (and, with fbgemm, 7-bit activations): a few percent at most
    assert _relative_error(y, ref) < 0.04
    assert weight_nbytes(q) == 300 * 256 + 300 * 2  # half of bf16, plus the scales


def test_prepacked_bf16_equals_plain_linear(weight_and_input) -> None:
    weight, x = weight_and_input
    packed = prepack(weight)
    # reordered only where oneDNN has native bf16 kernels (an AVX2-only CPU keeps the plain tensor)
    assert packed.is_mkldnn == onednn_bf16_supported()
    assert _relative_error(linear(x, packed), x.float() @ weight.float().T) < 0.01
    assert weight_nbytes(packed) == weight.numel() * 2


def test_prepacked_float32_equals_plain_linear() -> None:
    weight = torch.randn(1024, 1024)  # exactly MIN_PACKED_FLOAT32 elements: packed
    x = torch.randn(2, 3, 1024)
    packed = prepack(weight)
    assert packed.is_mkldnn == torch.backends.mkldnn.is_available()
    assert not prepack(weight[:512]).is_mkldnn  # small matrices stay on F.linear
    torch.testing.assert_close(linear(x, packed), x @ weight.T, rtol=1e-4, atol=1e-4)
    assert weight_nbytes(packed) == weight.numel() * 4
