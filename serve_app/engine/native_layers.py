"""A model's decoder layers handed to our kernels once, for steps that run them in one native call.

A decode or verify step (few tokens per row, float32 on a CPU) with every layer matrix in one of our
kernels' formats runs its layers through ``kernels/decoder_layers.cpp``: the same kernels and ATen ops
in the same order as ``DecoderLayer.__call__`` with the one-call attention, so the same numbers bit
for bit, without ~15 Python calls per layer (BENCHMARKS.md, twenty-seventh session). Any other model
(dense or int8 matrices, bf16, a GPU) keeps the Python layers.

Row plans (``engine.exactness``) play no part: our kernels compute each row alone (integer sums,
fixed float order), so their probes find them row-invariant at every count and their plans never
pad (the row tests of ``tests/engine/test_q4k.py`` and its siblings); a layer with a plan that pads
keeps the Python layers all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from serve_app.engine.decoder_layer import PRODUCTS, DecoderLayer
from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q6k_weight import Q6KWeight
from serve_app.engine.q8_weight import Q5Weight, Q8Weight
from serve_app.engine.quantized import PaddedInputs, RowStack

# The part kinds of kernels/decoder_layers.cpp (its enum Kind), by weight class.
PART_KINDS: dict[type, int] = {Q8Weight: 0, Q5Weight: 1, Q4KWeight: 2, Q6KWeight: 3}
PartSpec = tuple[int, torch.Tensor, int, int]  # kind, tiles, output features, padded inputs (0: none)


def product_parts(weight: object) -> list[PartSpec] | None:
    """A weight as the native layers' parts (output rows in order), or None where a part is not ours."""
    parts = weight.parts if isinstance(weight, RowStack) else (weight,)
    specs: list[PartSpec] = []
    for part in parts:
        padded_in = 0
        if isinstance(part, PaddedInputs):
            padded_in, part = part.weight.shape[1], part.weight
        kind = PART_KINDS.get(type(part))
        if kind is None:
            return None
        specs.append((kind, part.tiles, part.out_features, padded_in))
    return specs


def build_native_layers(layers: Sequence[DecoderLayer], kernels: Any) -> Any | None:
    """``kernels.DecoderLayers`` holding a model's ``layers``, or None where one of their products is
    not in our kernels' formats (or the model, whose dtype and device its norms carry, is not float32
    on a CPU)."""
    norm = layers[0].attn_norm
    if norm.dtype != torch.float32 or norm.device.type != "cpu" or not hasattr(kernels, "DecoderLayers"):
        return None
    cfg = layers[0].cfg
    native = kernels.DecoderLayers(cfg.num_heads, layers[0].scale, cfg.rms_norm_eps)
    for layer in layers:
        products = [product_parts(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(p is None for p in products) or layer.attn_norm.dtype != torch.float32:
            return None
        if any(plan is not None and plan.tail_from != 1 for plan in map(layer.plans.get, PRODUCTS)):
            return None
        qkv, o, gate_up, down = products
        native.add_layer(layer.attn_norm, layer.mlp_norm, qkv, layer.qkv_bias, o, layer.o_bias, gate_up,
                         layer.gate_up_bias, down, layer.down_bias)  # fmt: skip
    return native
