"""Matrices -> the weights a model multiplies by, in the configured format (fused along the rows)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q8_weight import Q8Weight
from serve_app.engine.quantized import (
    Int8Weight,
    PaddedInputs,
    QuantizedWeight,
    concat_rows,
)
from serve_app.engine.weights import Weight, prepack

LayerPacker = Callable[[Sequence[str]], Weight]  # a layer's parameter names -> one (fused) weight
# full names, their tensors (None where only ``blocks`` hold a matrix)
ModelPacker = Callable[[Sequence[str], Sequence[torch.Tensor | None]], Weight]


def model_packer(weight_format: str, int8: bool, blocks: Mapping[str, QuantizedWeight]) -> ModelPacker:
    """How matrices (fused along their output rows) become weights: int8 for a draft that asks
    for it, else in ``weight_format`` (``weights.WEIGHT_FORMATS``); ``blocks`` are the GGUF's own
    matrices by name, which ``gguf`` takes where it has them and re-quantizes to Q8 elsewhere; ``q4k``
    takes their Q4_K blocks where every fused part has them and re-quantizes the rest to Q4_K."""
    if int8:
        return lambda names, tensors: Int8Weight.quantize(torch.cat(list(tensors)))
    if weight_format == "q8":
        return lambda names, tensors: Q8Weight.quantize(torch.cat(list(tensors)))
    if weight_format == "gguf":
        return lambda names, tensors: concat_rows(
            [blocks[n] if n in blocks else Q8Weight.quantize(t) for n, t in zip(names, tensors, strict=True)]
        )
    if weight_format == "q4k":
        return lambda names, tensors: (
            concat_rows([blocks[n] for n in names])
            if all(isinstance(blocks.get(n), Q4KWeight) for n in names)
            else PaddedInputs.quantize(torch.cat(list(tensors)))
        )
    return lambda names, tensors: prepack(torch.cat(list(tensors)))
