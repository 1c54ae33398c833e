"""Batch-invariant products: a row's result must not depend on how many rows share its product.

Speculation is exact only if the target computes the same numbers for a token whether it runs in
a plain decode step (one row per request), a verify forward (``1 + depth`` rows per request) or
beside other requests. Attention, norms and sampling work row by row; the matrix products are
where a kernel may pick another blocking, and so another rounding, for another row count. Measured
(torch 2.13, 2 threads):

- AVX-512 BF16 EPYC: bf16 (``F.linear`` and oneDNN prepacked) rounds the 1-row product
  differently; any 2 rows or more agree. float32 agrees from 4 rows.
- AVX2-only EPYC: bf16 agrees at every row count (no native bf16 kernel: one generic path);
  float32 ``F.linear`` agrees only at multiples of 4 below 12, and at every count from 12;
  oneDNN-prepacked float32 disagrees at 1 row only.
- A second AVX-512 BF16 EPYC (VNNI, VP2INTERSECT; no AMX): bf16 oneDNN prepacked rounds the 1-row
  product differently too, but on some shapes in only ~1 output element of 7000 (SmolLM2's
  576x1536; every kind of Qwen 1.5B's shows it once enough elements are compared).

So nothing is assumed: :func:`probe_rows` runs a product at every row count up to
``PROBE_ROWS`` (on enough windows of random rows to compare ``PROBE_ELEMENTS`` outputs per count,
the rows also permuted) and records which counts give exactly the rows of the widest run. A
difference that rare is why the probe needs its numbers: a rounding flip shows only where the
float32 sum lies within its order's error of a bf16 rounding boundary. ``RowPlan.padded(m)`` is then
the smallest such count ``>= m``: a product of ``m`` rows runs as that many (zero rows appended,
sliced off after). A product kind with no count
from which every wider one agrees cannot be made invariant here; the model then says so
(``exact: false``) instead of pretending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PROBE_ROWS = 16  # row counts probed (against 32); wider products are taken as invariant (the tail held)
# Output elements compared per row count. Measured on an AVX-512 BF16 EPYC (bf16, 2 threads): SmolLM2's
# 576x1536 down product rounds 1 element in ~7000 differently alone than among 2+ rows, so two
# 32-row inputs (1152 elements at 1 row) missed it and speculation parted from plain decoding;
# 2^17 elements find such a kernel with ~18 differing elements expected.
PROBE_ELEMENTS = 1 << 17
PROBE_WINDOW_ROWS = 256  # at most this many rows per count (a tiny test model's narrow products)


@dataclass(frozen=True)
class RowPlan:
    """Which row counts of one product kind give every row exactly as the widest run does."""

    agreeing: frozenset[int]  # counts in 1..PROBE_ROWS whose rows equal the reference's
    tail_from: int | None  # every count from here up agrees; None: no such count (not invariant)

    @property
    def invariant(self) -> bool:
        return self.tail_from is not None

    def padded(self, rows: int) -> int:
        """The row count to run ``rows`` rows as (``rows`` itself where it already agrees)."""
        if rows in self.agreeing or self.tail_from is None or rows >= self.tail_from:
            return rows
        return min(n for n in self.agreeing if n >= rows)

    @property
    def min_rows(self) -> int:
        """The fewest rows a product of this kind runs (what one decode step of one request pays)."""
        return self.padded(1)

    def describe(self) -> str:
        if self.tail_from is None:
            return "not row-invariant"
        if self.tail_from == 1:
            return "row-invariant at any count"
        pads = sorted(n for n in self.agreeing if n < self.tail_from)
        counts = f"at {pads} and " if pads else ""
        return f"row-invariant {counts}from {self.tail_from} rows"


EXACT = RowPlan(frozenset(range(1, PROBE_ROWS + 1)), 1)  # what an invariant kind needs no padding for


def probe_rows(
    product: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    dtype: torch.dtype,
    device: torch.device,
    elements: int = PROBE_ELEMENTS,
) -> RowPlan:
    """Probe ``product`` (``[m, in_features] -> [m, out]``) at every row count up to ``PROBE_ROWS``
    against references of ``2 * PROBE_ROWS`` rows (so that a count is judged against a wider one).

    Each count is compared on at least ``elements`` output elements (at most
    ``PROBE_WINDOW_ROWS`` rows), as many windows of its rows as that takes (module doc: a rounding
    that differs by a product's row count shows in few elements, since the output's rounding hides
    most differences of summation order)."""
    generator = torch.Generator(device="cpu").manual_seed(1234)
    wide = 2 * PROBE_ROWS
    first = _probe_input(wide, in_features, generator, 0)
    out_features = max(1, product(first.to(device=device, dtype=dtype)).shape[-1])
    windows = {r: min(-(-elements // (r * out_features)), -(-PROBE_WINDOW_ROWS // r))
               for r in range(1, PROBE_ROWS + 1)}  # fmt: skip
    needed = max(r * n for r, n in windows.items())
    chunks = [first] + [_probe_input(wide, in_features, generator, c) for c in range(1, -(-needed // wide))]
    x = torch.cat(chunks).to(device=device, dtype=dtype)  # [chunks * wide, in_features]
    references = []
    for start in range(0, x.shape[0], wide):
        rows = x[start : start + wide]
        reference = product(rows)
        if not torch.equal(product(rows.flip(0)).flip(0), reference):  # each row at another position
            return RowPlan(frozenset(), None)
        references.append(reference)
    reference = torch.cat(references)
    agreeing = {
        r
        for r, n in windows.items()
        if all(torch.equal(product(x[i * r : (i + 1) * r]), reference[i * r : (i + 1) * r]) for i in range(n))
    }
    tail_from = None
    for start in range(PROBE_ROWS, 0, -1):
        if start not in agreeing:
            break
        tail_from = start
    return RowPlan(frozenset(agreeing), tail_from)


def _probe_input(rows: int, in_features: int, generator: torch.Generator, chunk: int) -> torch.Tensor:
    """Gaussian rows, every other chunk heavy-tailed (a few large inputs dominate each sum, as after
    an MLP's gate): the second kind shows rounding differences more often (measured)."""
    x = torch.randn(rows, in_features, generator=generator)
    if chunk % 2:
        x = x * torch.exp(1.5 * torch.randn(rows, in_features, generator=generator))
    return x


def attention_agrees(
    attend: Callable[..., torch.Tensor],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    contexts: tuple[int, ...] = (0, 5, 30, 100, 250, 285, 700),
) -> bool:
    """Whether a query's attention output is the same alone (a plain decode step: no mask, the
    cache up to it) as among ``T`` queries of a verify forward with masked padding keys behind,
    for several cache lengths (small key counts take other kernel paths; around 285 keys a decode
    step and a verify forward of 16 pad to 288 and 320 keys, which summed values differently on an
    AVX-512 BF16 EPYC until ``attention.VALUE_CHUNK``; around 250 the count of value chunks changes).

    ``attend(q [B, H, T, D], keys [B, H_kv, S, D], values, mask [B, 1, T, S] | None, scale)``.
    """
    generator = torch.Generator(device="cpu").manual_seed(4321)
    widest, pad = PROBE_ROWS, 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    scale = head_dim**-0.5
    for context in contexts:
        q = rand(1, heads, widest, head_dim)
        keys, values = (rand(1, kv_heads, context + widest + pad, head_dim) for _ in "kv")
        alone = [  # query t decoded alone: the cache up to and including its own position
            attend(
                q[:, :, t : t + 1],
                keys[:, :, : context + t + 1],
                values[:, :, : context + t + 1],
                None,
                scale,
            )
            for t in range(widest)
        ]
        for steps in range(1, widest + 1):
            for extra in (0, pad):
                width = context + steps + extra
                key = torch.arange(width, device=device)[None, :]
                visible = (
                    key <= context + torch.arange(steps, device=device)[:, None]
                )  # causal; padding hidden
                out = attend(
                    q[:, :, :steps], keys[:, :, :width], values[:, :, :width], visible[None, None], scale
                )
                if any(not torch.equal(out[:, :, t : t + 1], alone[t]) for t in range(steps)):
                    return False
    return True
