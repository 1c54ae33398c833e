"""The Q8 weight format: int8 weights with an fp16 scale per 32 inputs (llama.cpp's Q8_0), tiled for
our kernels.

``Q8Blocks`` is the plain layout (what the blocks file stores: the GGUF's Q8_0, Q5_0 and Q4_0 blocks
hold exactly, as ``packs.extract_blocks`` takes them); ``Q8Weight`` holds the same numbers as the
kernels read them (``kernels/q8_tiles.h``: tiles of 16 output features x 64 inputs, the values offset
by 128) and multiplies by them. A model keeps only the tiles; ``Q8Weight.blocks()`` gives the plain
layout back, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.engine import huge_pages
from serve_app.engine.kernels import require_kernels

BLOCK = 32  # inputs per scale
TILE_OUTPUTS = 16  # output features per tile
TILE_BYTES = 1088  # kernels/q8_tiles.h: kTileBytes (scales of two blocks, then their values)


@dataclass(frozen=True)
class Q8Blocks:
    """``weight = int8[out, in] * scale[out, in / 32]``."""

    data: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in / 32] fp16 bits as int16

    FIELDS = ("data", "scales")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def select_rows(self, index: torch.Tensor) -> Q8Blocks:
        return Q8Blocks(
            self.data.index_select(0, index).contiguous(), self.scales.index_select(0, index).contiguous()
        )

    @classmethod
    def cat(cls, parts: Sequence[Q8Blocks]) -> Q8Blocks:
        return cls(
            torch.cat([p.data for p in parts]).contiguous(), torch.cat([p.scales for p in parts]).contiguous()
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Blocks:
        """Per block of 32 inputs: scale = max|w| / 127 (rounded to fp16 first), q = round(w / scale)."""
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise ValueError(f"q8 needs input features in multiples of {BLOCK}, got {in_features}")
        blocks = weight.float().reshape(out_features, in_features // BLOCK, BLOCK)
        scales = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [out, in / 32]
        divisor = scales.float().unsqueeze(-1)
        q = torch.where(divisor > 0, torch.round(blocks / divisor.clamp(min=1e-30)), 0.0).clamp(-127, 127)
        return cls(q.to(torch.int8).reshape(out_features, in_features).contiguous(), scales.view(torch.int16))

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]`` (each value exact)."""
        scales = self.scales.view(torch.float16).float()
        return (self.data.float().reshape(*scales.shape, BLOCK) * scales[..., None]).reshape(self.shape)


def _to_tiles(blocks: Q8Blocks) -> torch.Tensor:
    """The plain layout -> tiles [groups, ceil(in / 64), 1088] (``kernels/q8_tiles.h``), missing
    outputs and a missing last block zero."""
    out_features, in_features = blocks.shape
    groups, pairs = -(-out_features // TILE_OUTPUTS), -(-in_features // (2 * BLOCK))
    pad_out, pad_in = groups * TILE_OUTPUTS - out_features, pairs * 2 * BLOCK - in_features
    values = (blocks.data.to(torch.int16) + 128).to(torch.uint8)
    values = torch.nn.functional.pad(values, (0, pad_in, 0, pad_out))
    # [G, o, J, 2, v, e] -> [G, J, 2, v, o, e]: block 2 j + h, vector v, byte 4 o + e
    values = values.reshape(groups, TILE_OUTPUTS, pairs, 2, 8, 4).permute(0, 2, 3, 4, 1, 5)
    scales = torch.nn.functional.pad(blocks.scales, (0, pad_in // BLOCK, 0, pad_out))
    scales = scales.reshape(groups, TILE_OUTPUTS, pairs, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return torch.cat(
        [scales.reshape(groups, pairs, -1), values.reshape(groups, pairs, -1)], dim=-1
    ).contiguous()


def _from_tiles(tiles: torch.Tensor, out_features: int, in_features: int) -> Q8Blocks:
    """The inverse of ``_to_tiles``."""
    groups, pairs, _ = tiles.shape
    scales, values = tiles.split([64, 2 * 512], dim=-1)
    values = values.reshape(groups, pairs, 2, 8, TILE_OUTPUTS, 4).permute(0, 4, 1, 2, 3, 5)
    data = (values.reshape(groups * TILE_OUTPUTS, -1).to(torch.int16) - 128).to(torch.int8)
    scales = scales.contiguous().view(torch.int16).reshape(groups, pairs, 2, TILE_OUTPUTS).permute(0, 3, 1, 2)
    scales = scales.reshape(groups * TILE_OUTPUTS, -1)
    return Q8Blocks(
        data[:out_features, :in_features].contiguous(),
        scales[:out_features, : in_features // BLOCK].contiguous(),
    )


@dataclass(frozen=True)
class Q8Weight:
    """A Q8 matrix as our kernel reads it (8.5 bits per weight), multiplied by int8 activations
    quantized per row and block: exact integer block sums and one fixed order of float steps, so
    each row's result is independent of the other rows (``kernels/q8_tiles.h``). A target may run on
    it: plain and speculative decoding agree with each other (not with the bf16 weights)."""

    tiles: torch.Tensor  # [ceil(out / 16), ceil(in / 64), 1088] uint8
    out_features: int
    in_features: int

    @classmethod
    def from_blocks(cls, blocks: Q8Blocks) -> Q8Weight:
        return cls(huge_pages.copy(_to_tiles(blocks)), *blocks.shape)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Weight:
        """From dense weights: ``Q8Blocks.quantize``."""
        return cls.from_blocks(Q8Blocks.quantize(weight))

    @classmethod
    def concat(cls, parts: Sequence[Q8Weight]) -> Q8Weight:
        """One matrix with the parts' output rows in order."""
        if all(p.out_features % TILE_OUTPUTS == 0 for p in parts[:-1]):  # whole groups: tiles as they are
            tiles = huge_pages.copy(torch.cat([p.tiles for p in parts]))
            return cls(tiles, sum(p.out_features for p in parts), parts[0].in_features)
        return cls.from_blocks(Q8Blocks.cat([p.blocks() for p in parts]))

    def blocks(self) -> Q8Blocks:
        """The plain layout of the same numbers."""
        return _from_tiles(self.tiles, self.out_features, self.in_features)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]``."""
        return self.blocks().dequantize()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        out = require_kernels("q8").q8_linear(flat, self.tiles, self.out_features)  # [M, out] float32
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
