"""Slot KV cache: preallocated per model, one slot per running request, O(1) rollback.

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads, max_seq_len, head_dim]``,
the shape ``scaled_dot_product_attention`` reads, so a single request's keys are a view, not a copy.

``lengths[slot]`` is the truth: rows at and beyond it are garbage by definition. A forward writes
its K/V at ``lengths[slot] .. lengths[slot] + T - 1`` (padding included) and the caller then moves
the length forward by the number of tokens it keeps. Rejecting speculated tokens is therefore
"not moving the length", and rolling back further is ``set_length(slot, n)``: no memory is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheBatch:
    """Where one forward reads and writes: computed once, used by every layer."""

    slots: list[int]  # slot of each row
    slot_index: torch.Tensor  # [B] the same, as a tensor
    starts: list[int]  # cache length of each row before this forward
    steps: int  # T, tokens per row in this forward (padding included)
    upto: int  # max(starts) + T: how many cache rows attention reads
    positions: torch.Tensor | None  # [B, T] cache row of each new token; None for a single row


class CacheFullError(RuntimeError):
    """No free KV slot (the engine queues the request instead)."""


class KVCache:
    """Preallocated slot cache for one decoder."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.lengths: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def usage(self) -> float:
        """Rows held by running requests / rows allocated (0..1): vLLM's KV-cache usage."""
        return sum(self.lengths) / (self.num_slots * self.max_seq_len)

    def allocate(self, slot: int | None = None) -> int:
        """Take a free slot (length 0): any, or the given one (to mirror another model's cache)."""
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        if slot is None:
            slot = self._free.pop()
        elif slot in self._free:
            self._free.remove(slot)
        else:
            raise ValueError(f"slot {slot} is not free")
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Freeing a free slot is an error (it would be handed out twice)."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    def set_length(self, slot: int, length: int) -> None:
        """Set how many rows of ``slot`` are valid (advance after a forward, or roll back)."""
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"length {length} outside 0..{self.max_seq_len}")
        self.lengths[slot] = length

    def keep_rows(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Keep the rows ``start + rows[j]`` a forward wrote as rows ``start + j`` (every layer) and
        set the length to ``start + len(rows)``: a tree verify's accepted path (``engine.tree``).
        ``rows`` ascend from 0 with ``rows[j] >= j``; e.g. rows (0, 1, 4) move row start + 4 to
        start + 2. The gather copies before the scatter writes, so overlapping moves are safe."""
        moves = [(start + j, start + r) for j, r in enumerate(rows) if r != j]
        if moves:
            dst = torch.tensor([d for d, _ in moves], device=self.k[0].device)
            src = torch.tensor([s for _, s in moves], device=self.k[0].device)
            for cache in (*self.k, *self.v):
                cache[slot].index_copy_(1, dst, cache[slot].index_select(1, src))
        self.set_length(slot, start + len(rows))

    def batch(self, slots: list[int], steps: int, device: torch.device | None = None) -> CacheBatch:
        """Describe a forward of ``steps`` tokens per row over ``slots`` (computed once per forward)."""
        starts = [self.lengths[s] for s in slots]
        upto = max(starts) + steps
        if upto > self.max_seq_len:
            raise ValueError(f"sequence of {upto} tokens exceeds the cache's max_seq_len {self.max_seq_len}")
        device = device or self.k[0].device
        slot_index = torch.tensor(slots, device=device)
        positions = None
        if len(slots) > 1:
            # positions[b, t] = starts[b] + t, where row b's token t goes.
            positions = torch.tensor(starts, device=device)[:, None] + torch.arange(steps, device=device)
        return CacheBatch(slots, slot_index, starts, steps, upto, positions)

    def write(self, layer: int, batch: CacheBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values ``k, v: [B, H_kv, T, D]`` at ``starts[b] ..`` of each row's slot."""
        if batch.positions is None:
            # One row: a slice assignment into a view, no index tensors.
            slot, start, steps = batch.slots[0], batch.starts[0], batch.steps
            self.k[layer][slot, :, start : start + steps] = k[0]
            self.v[layer][slot, :, start : start + steps] = v[0]
            return
        rows = batch.slot_index[:, None].expand_as(batch.positions)  # [B, T]
        # Advanced indices on dims 0 and 2 put [B, T] first: the value is [B, T, H_kv, D].
        self.k[layer][rows, :, batch.positions] = k.transpose(1, 2)
        self.v[layer][rows, :, batch.positions] = v.transpose(1, 2)

    def read(
        self, layer: int, batch: CacheBatch, width: int = 0, value_width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of the batch's slots up to row ``max(upto, width)``, values up to
        ``max(upto, value_width)`` (default: ``width``): ``[B, H_kv, S, D]`` each. Rows past
        ``upto`` hold earlier garbage or zeros (finite: the cache is zero-filled), which attention
        uses as masked padding."""
        upto = max(batch.upto, min(width, self.max_seq_len))
        value_upto = upto if value_width is None else max(batch.upto, min(value_width, self.max_seq_len))
        if batch.positions is None:
            rows = slice(batch.slots[0], batch.slots[0] + 1)
            return self.k[layer][rows, :, :upto], self.v[layer][rows, :, :value_upto]
        # Slice first so the gather copies only the rows in use.
        return (
            self.k[layer][:, :, :upto].index_select(0, batch.slot_index),
            self.v[layer][:, :, :value_upto].index_select(0, batch.slot_index),
        )
