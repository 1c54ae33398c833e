"""Weight formats of the decoder's matrices and the one ``linear`` that multiplies by any of them.

- plain: a dense tensor, ``F.linear`` (float32 everywhere; bf16 on CUDA).
- prepacked (CPU): reordered once into oneDNN's blocked layout; large float32 matrices, bf16 on a CPU with
  native bf16 (AVX-512 BF16, AMX), where it is 1.5-2x faster than ``F.linear`` for matrix-vector
  products; elsewhere (AVX2 only) bf16 weights stay plain tensors (see ``prepack``).
- quantized (``engine.quantized``): int8 for drafts; Q8 and the GGUF's own Q4_K and Q6_K blocks, computed
  by our kernels, row-invariant, for targets too (``runtime.weight_format``: ``WEIGHT_FORMATS``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve_app.engine.invariance import RowPlan
from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q6k_weight import Q6KWeight
from serve_app.engine.q8_weight import Q8Weight
from serve_app.engine.quantized import (
    Int8Weight,
    PaddedInputs,
    QuantizedWeight,
    RowStack,
)

Weight = torch.Tensor | QuantizedWeight
# A target's layer matrices (and head): as loaded ("dense"), Q8Weight ("q8"), or the pack's GGUF
# blocks as they are ("gguf": Q4_K as Q4KWeight, Q6_K as Q6KWeight, Q8_0 / Q5_0 / Q4_0 as Q8Weight,
# others re-quantized to Q8Weight; packs.extract_blocks), or every matrix in 4 bits ("q4k": the
# GGUF's Q4_K blocks where it has them, the others re-quantized to Q4_K, inputs zero-padded to
# 256s; the cheapest per step, for drafts, whose numbers only decide what is proposed).
WEIGHT_FORMATS = ("dense", "q8", "gguf", "q4k")
QUANTIZED_FORMATS = ("q8", "gguf", "q4k")  # the formats whose products run in our kernels


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
    if not isinstance(weight, torch.Tensor):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def weight_nbytes(weight: Weight) -> int:
    """Bytes a product with this weight reads."""
    if not isinstance(weight, torch.Tensor):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def product_kind(weight: Weight) -> str:
    """What decides a product's kernel: the format, dtype and shape (one row probe per kind)."""
    if isinstance(weight, Int8Weight):
        return f"int8 {weight.out_features}x{weight.in_features}"
    if isinstance(weight, Q8Weight):  # Q5Weight too: its own kernel, so its own kind
        return f"q{weight.BITS} {weight.shape[0]}x{weight.shape[1]}"
    if isinstance(weight, Q4KWeight):
        return f"q4k {weight.shape[0]}x{weight.shape[1]}"
    if isinstance(weight, Q6KWeight):
        return f"q6k {weight.shape[0]}x{weight.shape[1]}"
    if isinstance(weight, PaddedInputs):
        return f"q4k {weight.shape[0]}x{weight.shape[1]} padded to {weight.weight.shape[1]}"
    if isinstance(weight, RowStack):
        return "stack " + " + ".join(product_kind(p) for p in weight.parts)
    layout = "prepacked" if weight.is_mkldnn else "dense"
    return f"{layout} {str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}"
