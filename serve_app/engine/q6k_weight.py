"""The gguf weight format's 6-bit matrices: llama.cpp's Q6_K blocks, tiled for our kernels.

``Q6KBlocks`` is the blocks file's layout (the GGUF's numbers: ``packs.extract_blocks`` reads them
from its Q6_K blocks); ``Q6KWeight`` holds the same numbers as the kernels read them
(``kernels/q6k_tiles.h``: tiles of 16 output features x 256 inputs, one contiguous stream per
thread) and multiplies by them. A model keeps only the tiles; ``Q6KWeight.blocks()`` gives the plain
layout back, exactly. A Q4_K_M file keeps its output head and about half its ``ffn_down`` matrices
in Q6_K: 6.6 bits per weight, against the 8.5 of the Q8 they were re-quantized to before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve_app.engine.superblock_weight import SUPER, TILE_OUTPUTS, BlockFields, SuperBlockWeight

SUB = 16  # inputs per sub-block (an int8 scale)
TILE_BYTES = 3392  # kernels/q6k_tiles.h: kTileBytes
META_BYTES = 320  # d (32), scale pairs (256), zero (32)
BLOCK_BYTES = 384  # 4 vectors of nibbles (256), 2 vectors of top bits (128)
OFFSET = 32  # w = d * sc * (q - 32)

_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)  # vector v's top bits: bits 2 v, 2 v + 1


def pack_low_bits(low: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (0..15) -> bytes [out, in / 2] in the GGUF's Q6_K order: per 128
    inputs 64 bytes, byte l holding input l in its low nibble and input 64 + l in its high one."""
    out_features, in_features = low.shape
    halves = low.to(torch.uint8).reshape(out_features, in_features // 128, 2, 64)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_low_bits(ql: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_low_bits``: [out, in / 2] bytes -> [out, in] values 0..15."""
    out_features, half = ql.shape
    chunks = ql.reshape(out_features, half // 64, 64)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=2).reshape(out_features, half * 2)


def pack_crumbs(high: torch.Tensor) -> torch.Tensor:
    """2-bit values [out, in] (0..3) -> bytes [out, in / 4] in the GGUF's order: per 128 inputs 32
    bytes, bits 2 t, 2 t + 1 of byte i holding input 32 t + i."""
    out_features, in_features = high.shape
    parts = high.to(torch.uint8).reshape(out_features, in_features // 128, 4, 32)
    packed = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    return packed.reshape(out_features, in_features // 4)


def unpack_crumbs(qh: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_crumbs``: [out, in / 4] bytes -> [out, in] values 0..3."""
    out_features, quarter = qh.shape
    chunks = qh.reshape(out_features, quarter // 32, 1, 32)
    return ((chunks >> _SHIFTS.reshape(4, 1)) & 3).reshape(out_features, quarter * 4)


@dataclass(frozen=True)
class Q6KBlocks(BlockFields):
    """``w = d * scale[b] * (q - 32)``: per 256 inputs an fp16 ``d``, per sub-block of 16 a signed
    ``scale``, per input a 6-bit ``q`` (its low 4 bits in ``ql``, its top 2 in ``qh``), each part the
    GGUF's bytes as they are."""

    ql: torch.Tensor  # [out, in / 2] uint8, the low 4 bits (``pack_low_bits``' order)
    qh: torch.Tensor  # [out, in / 4] uint8, the top 2 bits (``pack_crumbs``' order)
    scales: torch.Tensor  # [out, in / 16] int8
    d: torch.Tensor  # [out, in / 256] fp16 bits as int16

    FIELDS = ("ql", "qh", "scales", "d")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.ql.shape[0], self.ql.shape[1] * 2))

    def values(self) -> torch.Tensor:
        """q as [out, in] uint8, 0..63."""
        return unpack_low_bits(self.ql) | (unpack_crumbs(self.qh) << 4)

    @classmethod
    def from_values(cls, q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> Q6KBlocks:
        """From q [out, in] (0..63), scales [out, in / 16] int8 and d [out, in / 256] fp16 bits."""
        q = q.to(torch.uint8)
        return cls(pack_low_bits(q & 0x0F), pack_crumbs(q >> 4), scales.contiguous(), d.contiguous())

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q6KBlocks:
        """Per sub-block of 16: a step max|w| / 31, stored as an int8 multiple of the super-block's d."""
        out_features, in_features = weight.shape
        if in_features % SUPER:
            raise ValueError(f"q6k needs input features in multiples of {SUPER}, got {in_features}")
        subs = weight.float().reshape(out_features, in_features // SUPER, SUPER // SUB, SUB)
        step = subs.abs().amax(dim=-1) / 31.0  # [out, S, 16]
        d = (step.amax(dim=-1) / 127.0).to(torch.float16)  # [out, S]
        df = d.float().unsqueeze(-1)
        scales = torch.where(df > 0, torch.round(step / df.clamp(min=1e-30)), 0.0).clamp(-128, 127)
        sub_step = (df * scales).unsqueeze(-1)
        q = torch.where(sub_step != 0, torch.round(subs / torch.where(sub_step != 0, sub_step, 1.0)), 0.0)
        q = (q.clamp(-32, 31) + OFFSET).reshape(out_features, in_features)
        return cls.from_values(q, scales.to(torch.int8).reshape(out_features, -1), d.view(torch.int16))

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]``: (d * scale) * (q - 32), as the GGUF's reader forms them."""
        out_features, in_features = self.shape
        d = self.d.view(torch.float16).float().repeat_interleave(SUPER // SUB, dim=1)  # [out, in / 16]
        step = (d * self.scales.float()).unsqueeze(-1)
        q = (self.values().float() - OFFSET).reshape(out_features, -1, SUB)
        return (step * q).reshape(out_features, in_features)


def _to_tiles(blocks: Q6KBlocks) -> torch.Tensor:
    """The plain layout -> tiles [groups, in / 256, 3392] (``kernels/q6k_tiles.h``), the last
    group's missing outputs zero."""
    out_features, in_features = blocks.shape
    groups, supers = -(-out_features // TILE_OUTPUTS), in_features // SUPER
    pad = groups * TILE_OUTPUTS - out_features

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, ...] -> [G, 16, ...], zero rows appended
        t = torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t
        return t.reshape(groups, TILE_OUTPUTS, *t.shape[1:])

    # input 256 s + 32 b + 16 h + 4 v + e -> [G, S, b, h, v, o, e]
    q = (
        grouped(blocks.values())
        .reshape(groups, TILE_OUTPUTS, supers, 8, 2, 4, 4)
        .permute(0, 2, 3, 4, 5, 1, 6)
    )
    nibbles = (q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)  # [G, S, b, v, o, e]
    # [G, S, b, h, byte]: the top bits of vector v at bits 2 v, 2 v + 1
    crumbs = (q >> 4).reshape(groups, supers, 8, 2, 4, 64) << _SHIFTS.reshape(4, 1)
    top = crumbs.sum(dim=4, dtype=torch.int32).to(torch.uint8)
    per_block = torch.cat(
        [nibbles.reshape(groups, supers, 8, 256), top.reshape(groups, supers, 8, 128)], dim=-1
    )
    d = grouped(blocks.d).transpose(1, 2).contiguous().view(torch.uint8)  # [G, S, 32]
    # [G, S, j, o, 2]: the scales of sub-blocks 2 j and 2 j + 1 side by side
    sc = grouped(blocks.scales).reshape(groups, TILE_OUTPUTS, supers, 8, 2).permute(0, 2, 3, 1, 4)
    zero = torch.zeros(groups, supers, META_BYTES - 32 - 256, dtype=torch.uint8)
    parts = (d, sc.reshape(groups, supers, -1).view(torch.uint8), zero, per_block.reshape(groups, supers, -1))
    return torch.cat(parts, dim=-1).contiguous()


def _from_tiles(tiles: torch.Tensor, out_features: int) -> Q6KBlocks:
    """The inverse of ``_to_tiles``."""
    groups, supers, _ = tiles.shape
    d, sc, _zero, per_block = tiles.split([32, 256, META_BYTES - 288, 8 * BLOCK_BYTES], dim=-1)
    nibbles, top = per_block.reshape(groups, supers, 8, BLOCK_BYTES).split([256, 128], dim=-1)
    nibbles = nibbles.reshape(groups, supers, 8, 4, TILE_OUTPUTS, 4)  # [G, S, b, v, o, e]
    low = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3)  # [G, S, b, h, v, o, e]
    top = top.reshape(groups, supers, 8, 2, 1, 64) >> _SHIFTS.reshape(4, 1)  # [G, S, b, h, v, byte]
    q = low | ((top & 3) << 4).reshape(low.shape)  # [G, S, b, h, v, o, e]
    q = q.permute(0, 5, 1, 2, 3, 4, 6).reshape(groups * TILE_OUTPUTS, supers * SUPER)[:out_features]
    scales = (
        sc.contiguous().view(torch.int8).reshape(groups, supers, 8, TILE_OUTPUTS, 2).permute(0, 3, 1, 2, 4)
    )
    scales = scales.reshape(groups * TILE_OUTPUTS, -1)[:out_features]
    d = d.contiguous().view(torch.int16).transpose(1, 2).reshape(groups * TILE_OUTPUTS, -1)[:out_features]
    return Q6KBlocks.from_values(q, scales.contiguous(), d.contiguous())


@dataclass(frozen=True)
class Q6KWeight(SuperBlockWeight):
    """A Q6_K matrix as our kernel reads it (6.6 bits per weight), multiplied by int8 activations
    quantized per row and super-block: exact integer sums and one fixed order of float steps, so
    each row's result is independent of the other rows (``kernels/q6k_tiles.h``)."""

    tiles: torch.Tensor  # [ceil(out / 16), in / 256, 3392] uint8

    BLOCKS = Q6KBlocks
    KERNEL = "q6k_linear"
    TO_TILES = staticmethod(_to_tiles)
    FROM_TILES = staticmethod(_from_tiles)
