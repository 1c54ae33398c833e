"""Quantized weight formats: objects with ``matmul(x)`` that ``weights.linear`` multiplies by.

- ``Int8Weight`` (drafts only): per-output-row int8 through fbgemm's dynamic linear (7-bit
  activations per tensor: a row's result depends on the others, so never for a target).
- ``Q8Weight`` (``engine.q8_weight``): int8 with an fp16 scale per 32 inputs (llama.cpp's Q8_0),
  tiled for our kernel; also holds the GGUF's Q8_0 / Q5_0 / Q4_0 blocks exactly.
- ``Q4KWeight`` (``engine.q4k_weight``): the GGUF's Q4_K blocks as they are (4.6 bits per weight),
  tiled for our kernel.
- ``Q6KWeight`` (``engine.q6k_weight``): the GGUF's Q6_K blocks as they are (6.6 bits per weight),
  tiled for our kernel.
- ``PaddedInputs``: a Q4_K weight whose inputs were zero-padded to a multiple of 256 (the ``q4k``
  format of a draft whose matrices are 896 wide).
- ``RowStack``: output rows of several weights in order (a fused product whose parts the GGUF
  stores in different formats).

Q8, Q4_K and Q6_K products quantize activations per row (never per tensor), sum blocks in integers and
run the float steps in one fixed order, so every row's result is independent of the other rows:
a target may run on them and speculation stays bit-exact against plain decoding of the same
weights (which are close to, not equal to, the bf16 weights).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.q4k_weight import SUPER, Q4KWeight
from serve_app.engine.q6k_weight import Q6KWeight
from serve_app.engine.q8_weight import Q8Weight

BlockWeight = Q8Weight | Q4KWeight | Q6KWeight  # what a GGUF block becomes


def _fbgemm_available() -> bool:
    return any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm"))


@dataclass(frozen=True)
class Int8Weight:
    """``weight ≈ int8[out, in] * scales[out]``; multiplies bf16 (or float32) activations.

    ``packed`` holds fbgemm's prepacked form when the quantized engine is available (then ``data``
    is None: fbgemm keeps its own copy); otherwise ``data`` + ``scales`` feed
    ``aten._weight_int8pack_mm``.
    """

    out_features: int
    in_features: int
    scales: torch.Tensor  # [out] bf16
    data: torch.Tensor | None = None  # [out, in] int8 (fallback kernel only)
    packed: object | None = None  # fbgemm LinearPackedParams (fast kernel)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.scales.numel() * self.scales.element_size()

    @classmethod
    def quantize(cls, weight: torch.Tensor, use_fbgemm: bool | None = None) -> Int8Weight:
        """Symmetric per-row quantization: scale = max|row| / 127."""
        w = weight.float()
        out_features, in_features = w.shape
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        use_fbgemm = _fbgemm_available() if use_fbgemm is None else use_fbgemm
        if use_fbgemm and weight.device.type == "cpu":
            with warnings.catch_warnings():  # quantized tensor creation is marked deprecated in 2.13
                warnings.simplefilter("ignore")
                zero = torch.zeros(out_features, dtype=torch.long)
                qweight = torch.quantize_per_channel(w, scales.double(), zero, 0, torch.qint8)
                packed = torch.ops.quantized.linear_prepack(qweight, None)
            return cls(out_features, in_features, scales.to(torch.bfloat16), packed=packed)
        data = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(out_features, in_features, scales.to(torch.bfloat16), data=data.contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        if self.packed is not None:
            # reduce_range: 7-bit activations, so the u8 x s8 pair sums cannot saturate on CPUs
            # without VNNI; costs a little precision, which only the draft's guesses see.
            out = torch.ops.quantized.linear_dynamic(flat.float(), self.packed, True)  # [M, out] f32
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.data, self.scales)
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


@dataclass(frozen=True)
class PaddedInputs:
    """A Q4_K weight over more inputs than the model has: ``in_features`` real ones, then zero
    weights up to the next multiple of 256 (Q4_K's super-block). ``matmul`` pads the activations
    with zeros to match, which adds nothing to any sum (a 896-wide draft matrix: 1024, 14% more
    bytes, still ~0.6x of Q8's)."""

    weight: Q4KWeight
    in_features: int

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4KWeight | PaddedInputs:
        """Q4_K from dense weights: min/max blocks (``Q4KWeight.quantize``) after zero-padding the
        inputs to a multiple of 256; a plain ``Q4KWeight`` where no padding is needed."""
        in_features = weight.shape[1]
        padding = -in_features % SUPER
        if not padding:
            return Q4KWeight.quantize(weight)
        return cls(Q4KWeight.quantize(torch.nn.functional.pad(weight.float(), (0, padding))), in_features)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight.shape[0], self.in_features))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        padding = self.weight.shape[1] - self.in_features
        return self.weight.matmul(torch.nn.functional.pad(x, (0, padding)))


@dataclass(frozen=True)
class RowStack:
    """The output rows of several quantized weights, in order (e.g. q and k in Q4_K, v in Q6_K)."""

    parts: tuple[BlockWeight, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)


def concat_rows(parts: Sequence[BlockWeight]) -> BlockWeight | RowStack:
    """One weight with the parts' output rows in order: neighbours of one format are fused into one
    matrix (one kernel call), the rest stacked."""
    groups: list[list[BlockWeight]] = []
    for part in parts:
        if groups and type(groups[-1][0]) is type(part):
            groups[-1].append(part)
        else:
            groups.append([part])
    fused = [g[0] if len(g) == 1 else type(g[0]).concat(g) for g in groups]
    return fused[0] if len(fused) == 1 else RowStack(tuple(fused))


QuantizedWeight = Int8Weight | BlockWeight | PaddedInputs | RowStack
