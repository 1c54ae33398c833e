"""What the super-block weights (Q4_K, Q6_K) share: their kernels' tiles (16 output features x 256
inputs, ``kernels/q4k_tiles.h``, ``kernels/q6k_tiles.h``), the plain blocks they come from and go back
to exactly, and the product by its name in the kernels module. A subclass names its blocks class,
its kernel and its two layout conversions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch

from serve_app.engine import huge_pages
from serve_app.engine.kernels import require_kernels

SUPER = 256  # inputs per super-block
TILE_OUTPUTS = 16  # output features per tile


class BlockFields:
    """What a plain blocks layout (a frozen dataclass of per-row tensors named in ``FIELDS``) can do
    by rows: its tensors in order, a selection of rows, several stacked."""

    FIELDS: ClassVar[tuple[str, ...]]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def select_rows(self, index: torch.Tensor) -> Self:
        return type(self)(*(t.index_select(0, index).contiguous() for t in self.tensors()))

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        return cls(*(torch.cat(ts).contiguous() for ts in zip(*(p.tensors() for p in parts), strict=True)))


@dataclass(frozen=True)
class SuperBlockWeight:
    """A matrix as a super-block kernel reads it, multiplied by int8 activations quantized per row
    and super-block: exact integer sums and one fixed order of float steps, so each row's result is
    independent of the other rows."""

    tiles: torch.Tensor  # [ceil(out / 16), in / 256, tile bytes] uint8
    out_features: int

    BLOCKS: ClassVar[Any]  # the plain layout: quantize(weight), cat(parts), dequantize(), shape
    KERNEL: ClassVar[str]  # the product in the kernels module: kernel(x, tiles, out_features)
    TO_TILES: ClassVar[Callable[[Any], torch.Tensor]]
    FROM_TILES: ClassVar[Callable[[torch.Tensor, int], Any]]

    @classmethod
    def from_blocks(cls, blocks: Any) -> Self:
        return cls(huge_pages.copy(cls.TO_TILES(blocks)), blocks.shape[0])

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Self:
        """From dense weights (tests, matrices a GGUF does not have): the blocks class's quantize."""
        return cls.from_blocks(cls.BLOCKS.quantize(weight))

    @classmethod
    def concat(cls, parts: Sequence[Self]) -> Self:
        """One matrix with the parts' output rows in order."""
        if all(p.out_features % TILE_OUTPUTS == 0 for p in parts[:-1]):  # whole groups: tiles as they are
            tiles = huge_pages.copy(torch.cat([p.tiles for p in parts]))
            return cls(tiles, sum(p.out_features for p in parts))
        return cls.from_blocks(cls.BLOCKS.cat([p.blocks() for p in parts]))

    def blocks(self) -> Any:
        """The plain layout of the same numbers."""
        return type(self).FROM_TILES(self.tiles, self.out_features)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.tiles.shape[1] * SUPER))

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]``."""
        return self.blocks().dequantize()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        kernel = getattr(require_kernels("gguf"), self.KERNEL)
        out = kernel(flat, self.tiles, self.out_features)  # [M, out] float32
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
