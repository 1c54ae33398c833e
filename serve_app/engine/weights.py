"""Weight formats of the decoder's matrices and the one ``linear`` that multiplies by any of them.

- plain: a dense tensor, ``F.linear`` (float32 everywhere; bf16 on CUDA).
- prepacked bf16 (CPU): reordered once into oneDNN's blocked layout; the same kernel family as
  ``F.linear``, 1.5-2x faster for matrix-vector products on this CPU. The default for bf16 on CPU.
- int8 weight-only (CPU, draft models only): per-output-row scales, activations stay bf16, through
  ``torch.ops.aten._weight_int8pack_mm``; reads half the bytes of bf16. It changes the numbers
  (≈1% relative error), so it is for proposers, whose guesses are verified; the target's weights
  are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Int8Weight:
    """``weight ≈ int8[out, in] * scales[out]``; multiplies bf16 activations."""

    data: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bf16

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-row quantization: scale = max|row| / 127."""
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        data = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(data.contiguous(), scales.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, in]
        out = torch.ops.aten._weight_int8pack_mm(flat, self.data, self.scales)  # [M, out]
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


Weight = torch.Tensor | Int8Weight


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a bf16 CPU weight into oneDNN's blocked layout; other weights are returned as is."""
    on_cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
    if not (on_cpu_bf16 and torch.backends.mkldnn.is_available()):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for any weight format."""
    if isinstance(weight, Int8Weight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def weight_nbytes(weight: Weight) -> int:
    """Bytes a product with this weight reads."""
    if isinstance(weight, Int8Weight):
        return weight.nbytes
    return weight.numel() * weight.element_size()
