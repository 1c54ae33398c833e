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
TILE_BYTES = 1088  # kernels/q8_tiles.h: Q8::kTileBytes (scales of two blocks, then their values)
Q5_TILE_BYTES = 704  # kernels/q8_tiles.h: Q5::kTileBytes


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
    def quantize(cls, weight: torch.Tensor, top: int = 127, name: str = "q8") -> Q8Blocks:
        """Per block of 32 inputs: scale = max|w| / top (rounded to fp16 first), q = round(w / scale)
        in [-top, top] (127: Q8; 15: values Q5 holds)."""
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise ValueError(f"{name} needs input features in multiples of {BLOCK}, got {in_features}")
        blocks = weight.float().reshape(out_features, in_features // BLOCK, BLOCK)
        scales = (blocks.abs().amax(dim=-1) / float(top)).to(torch.float16)  # [out, in / 32]
        divisor = scales.float().unsqueeze(-1)
        q = torch.where(divisor > 0, torch.round(blocks / divisor.clamp(min=1e-30)), 0.0).clamp(-top, top)
        return cls(q.to(torch.int8).reshape(out_features, in_features).contiguous(), scales.view(torch.int16))

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]`` (each value exact)."""
        scales = self.scales.view(torch.float16).float()
        return (self.data.float().reshape(*scales.shape, BLOCK) * scales[..., None]).reshape(self.shape)


def _vnni_values(blocks: Q8Blocks, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The values plus ``offset`` as [G, J, 2, 8, 64] uint8 (group, block pair, block, VNNI vector,
    byte 4 o + e) and the scales as [G, J, 64] bytes, missing outputs and a missing last block zero."""
    out_features, in_features = blocks.shape
    groups, pairs = -(-out_features // TILE_OUTPUTS), -(-in_features // (2 * BLOCK))
    pad_out, pad_in = groups * TILE_OUTPUTS - out_features, pairs * 2 * BLOCK - in_features
    values = (blocks.data.to(torch.int16) + offset).to(torch.uint8)
    values = torch.nn.functional.pad(values, (0, pad_in, 0, pad_out))
    # [G, o, J, 2, v, e] -> [G, J, 2, v, o, e]: block 2 j + h, vector v, byte 4 o + e
    values = values.reshape(groups, TILE_OUTPUTS, pairs, 2, 8, 4).permute(0, 2, 3, 4, 1, 5)
    scales = torch.nn.functional.pad(blocks.scales, (0, pad_in // BLOCK, 0, pad_out))
    scales = scales.reshape(groups, TILE_OUTPUTS, pairs, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return values.reshape(groups, pairs, 2, 8, 64), scales.reshape(groups, pairs, 64)


def _plain_values(values: torch.Tensor, scales: torch.Tensor, offset: int, shape: torch.Size) -> Q8Blocks:
    """The inverse of ``_vnni_values``."""
    out_features, in_features = shape
    groups, pairs = values.shape[:2]
    values = values.reshape(groups, pairs, 2, 8, TILE_OUTPUTS, 4).permute(0, 4, 1, 2, 3, 5)
    data = (values.reshape(groups * TILE_OUTPUTS, -1).to(torch.int16) - offset).to(torch.int8)
    scales = scales.contiguous().view(torch.int16).reshape(groups, pairs, 2, TILE_OUTPUTS).permute(0, 3, 1, 2)
    scales = scales.reshape(groups * TILE_OUTPUTS, -1)
    return Q8Blocks(
        data[:out_features, :in_features].contiguous(),
        scales[:out_features, : in_features // BLOCK].contiguous(),
    )


def _to_tiles(blocks: Q8Blocks) -> torch.Tensor:
    """The plain layout -> Q8 tiles [groups, ceil(in / 64), 1088] (``kernels/q8_tiles.h``)."""
    values, scales = _vnni_values(blocks, 128)
    return torch.cat([scales, values.flatten(2)], dim=-1).contiguous()


def _from_tiles(tiles: torch.Tensor, shape: torch.Size) -> Q8Blocks:
    groups, pairs, _ = tiles.shape
    scales, values = tiles.split([64, 2 * 512], dim=-1)
    return _plain_values(values.reshape(groups, pairs, 2, 8, 64), scales, 128, shape)


_BITS = 1 << torch.arange(8, dtype=torch.uint8)  # bit k of a mask byte


def _to_q5_tiles(blocks: Q8Blocks) -> torch.Tensor:
    """The plain layout (values in [-16, 15]) -> Q5 tiles [groups, ceil(in / 64), 704]: per block
    4 vectors of nibbles (vector v's low nibbles the VNNI vector v, high nibbles v + 4), then 8
    masks of 64 bits holding the fifth bit of each byte of each VNNI vector."""
    values, scales = _vnni_values(blocks, 16)  # [G, J, 2, 8, 64], 0..31
    nibbles = (values[:, :, :, :4] & 0x0F) | ((values[:, :, :, 4:] & 0x0F) << 4)  # [G, J, 2, 4, 64]
    fifth = (values >> 4).reshape(*values.shape[:4], 8, 8)  # [G, J, 2, v, byte / 8, byte % 8]
    masks = (fifth * _BITS).sum(dim=-1, dtype=torch.int32).to(torch.uint8)  # [G, J, 2, 8, 8]
    per_block = torch.cat([nibbles.flatten(3), masks.flatten(3)], dim=-1)  # [G, J, 2, 320]
    return torch.cat([scales, per_block.flatten(2)], dim=-1).contiguous()


def _from_q5_tiles(tiles: torch.Tensor, shape: torch.Size) -> Q8Blocks:
    groups, pairs, _ = tiles.shape
    scales, per_block = tiles.split([64, 2 * 320], dim=-1)
    nibbles, masks = per_block.reshape(groups, pairs, 2, 320).split([256, 64], dim=-1)
    nibbles = nibbles.reshape(groups, pairs, 2, 4, 64)
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3)  # [G, J, 2, 8, 64]
    fifth = (masks.reshape(groups, pairs, 2, 8, 8, 1) & _BITS) != 0  # [G, J, 2, v, byte / 8, bit]
    values = low | (fifth.reshape(groups, pairs, 2, 8, 64).to(torch.uint8) << 4)
    return _plain_values(values, scales, 16, shape)


def fits_q5(blocks: Q8Blocks) -> bool:
    """Whether every value lies in [-16, 15] (the GGUF's Q5_0 and Q4_0 blocks): Q5 holds them."""
    return bool(blocks.data.numel()) and int(blocks.data.min()) >= -16 and int(blocks.data.max()) <= 15


@dataclass(frozen=True)
class Q8Weight:
    """A Q8 matrix as our kernel reads it (8.5 bits per weight), multiplied by int8 activations
    quantized per row and block: exact integer block sums and one fixed order of float steps, so
    each row's result is independent of the other rows (``kernels/q8_tiles.h``). A target may run on
    it: plain and speculative decoding agree with each other (not with the bf16 weights)."""

    tiles: torch.Tensor  # [ceil(out / 16), ceil(in / 64), 1088] uint8
    out_features: int
    in_features: int

    BITS = 8

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
        return _from_tiles(self.tiles, self.shape)

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
        out = require_kernels("q8").q8_linear(flat, self.tiles, self.out_features, self.BITS)  # [M, out] f32
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


@dataclass(frozen=True)
class Q5Weight(Q8Weight):
    """A Q8 matrix whose values lie in [-16, 15] (the GGUF's Q5_0 and Q4_0 blocks), stored in 5 bits
    (5.5 bits per weight with the scales, against Q8's 8.5): the same numbers, bit for bit, from
    35% fewer bytes (``kernels/q8_tiles.h``)."""

    tiles: torch.Tensor  # [ceil(out / 16), ceil(in / 64), 704] uint8

    BITS = 5

    @classmethod
    def from_blocks(cls, blocks: Q8Blocks) -> Q5Weight:
        if not fits_q5(blocks):
            raise ValueError("q5 needs every value in [-16, 15]")
        return cls(huge_pages.copy(_to_q5_tiles(blocks)), *blocks.shape)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q5Weight:
        """From dense weights: per block of 32 inputs, values in [-15, 15] (``Q8Blocks.quantize``)."""
        return cls.from_blocks(Q8Blocks.quantize(weight, top=15, name="q5"))

    def blocks(self) -> Q8Blocks:
        return _from_q5_tiles(self.tiles, self.shape)
