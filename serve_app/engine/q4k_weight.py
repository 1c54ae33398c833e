"""The gguf weight format's 4-bit matrices: llama.cpp's Q4_K blocks, tiled for our kernels.

``Q4KBlocks`` is the GGUF's own layout (what the blocks file stores and ``packs.extract_blocks``
reads); ``Q4KWeight`` holds the same numbers as the kernels read them (``kernels/q4k_tiles.h``:
tiles of 16 output features x 256 inputs, one contiguous stream per thread) and multiplies by them.
A model keeps only the tiles; ``Q4KWeight.blocks()`` gives the GGUF layout back, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve_app.engine.superblock_weight import SUPER, TILE_OUTPUTS, BlockFields, SuperBlockWeight

BLOCK = 32  # inputs per block (a 6-bit scale and min)
TILE_BYTES = 2368  # kernels/q4k_tiles.h: kTileBytes


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (0..15) -> bytes [out, in / 2] in the GGUF's order: per 64 inputs 32
    bytes, low nibble input i, high nibble input 32 + i."""
    out_features, in_features = q.shape
    pairs = q.to(torch.uint8).reshape(out_features, in_features // 64, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: [out, in / 2] bytes -> [out, in] values 0..15."""
    out_features, half = qs.shape
    chunks = qs.reshape(out_features, half // 32, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=2).reshape(out_features, half * 2)


@dataclass(frozen=True)
class Q4KBlocks(BlockFields):
    """``w = d * scale[b] * q - dmin * min[b]`` in the GGUF's layout, its 6-bit scales unpacked.

    Per 256 inputs an fp16 ``d`` and ``dmin``; per block of 32 an integer ``scale`` and ``min``
    (0..63); per input a 4-bit ``q``."""

    qs: torch.Tensor  # [out, in / 2] uint8, two 4-bit values per byte (the GGUF's order)
    d: torch.Tensor  # [out, in / 256] fp16 bits as int16
    dmin: torch.Tensor  # [out, in / 256] fp16 bits as int16
    scales: torch.Tensor  # [out, in / 32] uint8
    mins: torch.Tensor  # [out, in / 32] uint8

    FIELDS = ("qs", "d", "dmin", "scales", "mins")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qs.shape[0], self.qs.shape[1] * 2))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4KBlocks:
        """Min/max per block of 32, block scales and mins as 6-bit multiples of the super-block's."""
        out_features, in_features = weight.shape
        if in_features % SUPER:
            raise ValueError(f"q4k needs input features in multiples of {SUPER}, got {in_features}")
        blocks = weight.float().reshape(out_features, in_features // SUPER, 8, BLOCK)
        low = blocks.amin(dim=-1).clamp(max=0.0).neg()  # [out, S, 8] what the block subtracts
        step = (blocks.amax(dim=-1) + low) / 15.0  # [out, S, 8]
        d = (step.amax(dim=-1) / 63.0).to(torch.float16)  # [out, S]
        dmin = (low.amax(dim=-1) / 63.0).to(torch.float16)
        df, dminf = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
        scales = torch.where(df > 0, torch.round(step / df.clamp(min=1e-30)), 0.0).clamp(0, 63)
        mins = torch.where(dminf > 0, torch.round(low / dminf.clamp(min=1e-30)), 0.0).clamp(0, 63)
        block_step, block_low = (df * scales).unsqueeze(-1), (dminf * mins).unsqueeze(-1)
        q = torch.where(block_step > 0, torch.round((blocks + block_low) / block_step.clamp(min=1e-30)), 0.0)
        q = q.clamp(0, 15).reshape(out_features, in_features)
        return cls(
            pack_nibbles(q),
            d.view(torch.int16).contiguous(),
            dmin.view(torch.int16).contiguous(),
            scales.to(torch.uint8).reshape(out_features, -1).contiguous(),
            mins.to(torch.uint8).reshape(out_features, -1).contiguous(),
        )

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]`` (each value exact: the kernel's numbers)."""
        out_features, in_features = self.shape
        q = unpack_nibbles(self.qs).float().reshape(out_features, -1, BLOCK)
        d = self.d.view(torch.float16).float().repeat_interleave(8, dim=1)  # [out, in / 32]
        dmin = self.dmin.view(torch.float16).float().repeat_interleave(8, dim=1)
        step, low = (d * self.scales.float()).unsqueeze(-1), (dmin * self.mins.float()).unsqueeze(-1)
        return (step * q - low).reshape(out_features, in_features)


def _to_tiles(blocks: Q4KBlocks) -> torch.Tensor:
    """The GGUF layout -> tiles [groups, in / 256, 2368] (``kernels/q4k_tiles.h``), the last group's
    missing outputs zero."""
    out_features, in_features = blocks.shape
    groups, supers = -(-out_features // TILE_OUTPUTS), in_features // SUPER
    pad = groups * TILE_OUTPUTS - out_features

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, ...] -> [G, 16, ...], zero rows appended
        t = torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t
        return t.reshape(groups, TILE_OUTPUTS, *t.shape[1:])

    q = grouped(unpack_nibbles(blocks.qs)).reshape(groups, TILE_OUTPUTS, supers, 8, 2, 4, 4)
    # [G, o, S, b, half, v, e] -> [G, S, b, v, o, e, half]: vector v of block b, byte 4 o + e
    q = q.permute(0, 2, 3, 5, 1, 6, 4)
    qs = (q[..., 0] | (q[..., 1] << 4)).reshape(groups, supers, -1)
    d = grouped(blocks.d).transpose(1, 2).contiguous().view(torch.uint8)  # [G, S, 32]
    dmin = grouped(blocks.dmin).transpose(1, 2).contiguous().view(torch.uint8)
    sc = grouped(blocks.scales).reshape(groups, TILE_OUTPUTS, supers, 8).permute(0, 2, 3, 1)  # [G, S, b, o]
    # [G, S, j, o, 2]: the mins of blocks 2 j and 2 j + 1 side by side
    mn = grouped(blocks.mins).reshape(groups, TILE_OUTPUTS, supers, 4, 2).permute(0, 2, 3, 1, 4)
    parts = (d, dmin, mn.reshape(groups, supers, -1), sc.reshape(groups, supers, -1), qs)
    return torch.cat(parts, dim=-1).contiguous()


def _from_tiles(tiles: torch.Tensor, out_features: int) -> Q4KBlocks:
    """The inverse of ``_to_tiles``."""
    groups, supers, _ = tiles.shape
    d, dmin, mn, sc, qs = tiles.split([32, 32, 128, 128, 2048], dim=-1)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=-1).reshape(groups, supers, 8, 4, TILE_OUTPUTS, 4, 2)
    # [G, S, b, v, o, e, half] -> [G, o, S, b, half, v, e] -> [out, in]
    q = q.permute(0, 4, 1, 2, 6, 3, 5).reshape(groups * TILE_OUTPUTS, supers * SUPER)

    def rows(t: torch.Tensor) -> torch.Tensor:  # [G, 16, ...] -> [out, ...]
        return t.reshape(groups * TILE_OUTPUTS, -1)[:out_features].contiguous()

    def halves(t: torch.Tensor) -> torch.Tensor:  # [G, S, 32] bytes -> [G, 16, S] fp16 bits
        return t.contiguous().view(torch.int16).transpose(1, 2)

    return Q4KBlocks(
        pack_nibbles(q[:out_features]),
        rows(halves(d)),
        rows(halves(dmin)),
        rows(sc.reshape(groups, supers, 8, TILE_OUTPUTS).permute(0, 3, 1, 2)),
        rows(mn.reshape(groups, supers, 4, TILE_OUTPUTS, 2).permute(0, 3, 1, 2, 4)),
    )


@dataclass(frozen=True)
class Q4KWeight(SuperBlockWeight):
    """A Q4_K matrix as our kernel reads it (4.6 bits per weight), multiplied by int8 activations
    quantized per row and super-block: exact integer sums and one fixed order of float steps, so
    each row's result is independent of the other rows (``kernels/q4k_tiles.h``)."""

    tiles: torch.Tensor  # [ceil(out / 16), in / 256, 2368] uint8

    BLOCKS = Q4KBlocks
    KERNEL = "q4k_linear"
    TO_TILES = staticmethod(_to_tiles)
    FROM_TILES = staticmethod(_from_tiles)
