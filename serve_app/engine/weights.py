"""Weight formats of the decoder's matrices and the one ``linear`` that multiplies by any of them.

- plain: a dense tensor, ``F.linear`` (float32 everywhere; bf16 on CUDA).
- prepacked (CPU): reordered once into oneDNN's blocked layout; large float32 matrices, bf16 on a CPU with
  native bf16 (AVX-512 BF16, AMX), where it is 1.5-2x faster than ``F.linear`` for matrix-vector
  products; elsewhere (AVX2 only) bf16 weights stay plain tensors (see ``prepack``).
- int8 (CPU, draft models only): per-output-row symmetric int8 weights, half the bytes of bf16.
  Where PyTorch has its x86 / fbgemm quantized engine (any x86-64 build), products run through
  fbgemm's dynamic-quantized linear: each call quantizes the activations to 8 bits per tensor and
  multiplies int8 x uint8 with int32 accumulation (AVX-512 VNNI here). Measured on this CPU for a
  Qwen 0.5B layer at one token, it reads weights ~3x faster than ``aten._weight_int8pack_mm``
  (which keeps activations in bf16 and is the fallback elsewhere, e.g. ARM). Either way the
  numbers change (~1-2% relative error), so int8 is for proposers, whose guesses are verified; the
  target's weights are never quantized.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serve_app.engine.invariance import RowPlan


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
class Q8Weight:
    """``weight ≈ int8[out, in] * scale[out, in / 32]``: one fp16 scale per block of 32 inputs (as
    llama.cpp's Q8_0), multiplied by ``kernels/q8_linear.cpp`` with int8 activations quantized per
    row and block. Integer block sums and a fixed order of the float steps make every row's result
    independent of the other rows, so a target may run on it (its numbers are those of these
    weights: plain and speculative decoding agree with each other, not with the bf16 weights)."""

    data: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in / 32] fp16 bits as int16

    BLOCK = 32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 2 * self.scales.numel()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Weight:
        """Per block of 32 inputs: scale = max|w| / 127 (rounded to fp16 first), q = round(w / scale)."""
        out_features, in_features = weight.shape
        if in_features % cls.BLOCK:
            raise ValueError(f"q8 needs input features in multiples of {cls.BLOCK}, got {in_features}")
        blocks = weight.float().reshape(out_features, in_features // cls.BLOCK, cls.BLOCK)
        scales = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [out, in / 32]
        divisor = scales.float().unsqueeze(-1)
        q = torch.where(divisor > 0, torch.round(blocks / divisor.clamp(min=1e-30)), 0.0).clamp(-127, 127)
        return cls(q.to(torch.int8).reshape(out_features, in_features).contiguous(), scales.view(torch.int16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from serve_app.engine.kernels import require_q8

        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        out = require_q8().q8_linear(flat, self.data, self.scales)  # [M, out] float32
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


Weight = torch.Tensor | Int8Weight | Q8Weight
WEIGHT_FORMATS = ("dense", "q8")  # a target's layer matrices (and head): as loaded, or Q8Weight


# Below this many elements a float32 product is too short for oneDNN's per-call overhead to pay.
MIN_PACKED_FLOAT32 = 1 << 20


def onednn_bf16_supported() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX-512 BF16 / AMX, or AVX-NE-CONVERT).

    Without them (e.g. an AVX2-only CPU) oneDNN refuses to reorder bf16 weights, and bf16 products
    run through PyTorch's generic kernels instead.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a CPU weight into oneDNN's blocked layout where that pays; else return it as is.

    float32: matrices of at least ``MIN_PACKED_FLOAT32`` elements. On an AVX2-only CPU (AMD EPYC,
    2 threads) a Qwen 1.5B forward over 1 / 8 / 16 tokens takes 336 / 848 / 978 ms packed vs
    582 / 1835 / 1932 ms through ``F.linear`` (MKL's small-M path); but a packed product costs
    ~25 us per call against ~4 us for a small ``F.linear``, which dominates tiny matrices.
    bf16: only where oneDNN has native bf16 kernels (``onednn_bf16_supported``); without them it
    refuses the reorder.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return weight
    large_float32 = weight.dtype == torch.float32 and weight.numel() >= MIN_PACKED_FLOAT32
    if large_float32 or (weight.dtype == torch.bfloat16 and onednn_bf16_supported()):
        return torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return weight


def linear(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, plan: RowPlan | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for any weight format. With a ``plan`` (``engine.invariance``) the
    product runs on at least as many rows as makes each row's result independent of the others:
    zero rows are appended and sliced off again."""
    if plan is not None:
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        rows = flat.shape[0]
        padded = plan.padded(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
            out = _product(flat, weight, bias)[:rows]
            return out.view(*x.shape[:-1], out.shape[-1])
    return _product(x, weight, bias)


def _product(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Int8Weight | Q8Weight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def weight_nbytes(weight: Weight) -> int:
    """Bytes a product with this weight reads."""
    if isinstance(weight, Int8Weight | Q8Weight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def product_kind(weight: Weight) -> str:
    """What decides a product's kernel: the format, dtype and shape (one row probe per kind)."""
    if isinstance(weight, Int8Weight):
        return f"int8 {weight.out_features}x{weight.in_features}"
    if isinstance(weight, Q8Weight):
        return f"q8 {weight.shape[0]}x{weight.shape[1]}"
    layout = "prepacked" if weight.is_mkldnn else "dense"
    return f"{layout} {str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}"
