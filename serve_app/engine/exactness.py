"""Make a model's numbers independent of its batch: what keeps speculation bit-exact.

``make_exact(model)`` probes (``engine.invariance``) each kind of product the model runs (its
weights' format, dtype and shape; the output head; attention's folded query rows) and gives every
layer the plan of its kind, so that each product runs on a row count whose rows agree with any
other. Then it checks attention as a whole: a query alone (a plain decode step) against the same
query among a verify forward's queries with masked padding keys, at several cache lengths. Where
that fails with the keys as they are, it pads the keys to a multiple of ``KEY_BLOCK`` (float32
scores on an AVX2 CPU depend on the number of keys otherwise) and checks again. The result says
whether the model is exact on this device; an engine reports it (``exact``) and warns when not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from serve_app.engine.attention import grouped_attention
from serve_app.engine.decoder_layer import ATTENTION, PRODUCTS
from serve_app.engine.invariance import PROBE_ELEMENTS, RowPlan, attention_agrees, probe_rows
from serve_app.engine.model import DecoderModel
from serve_app.engine.weights import Weight, linear, product_kind

log = logging.getLogger(__name__)

KEY_BLOCK = 32  # keys padded to a multiple of this where attention needs it (measured: 16 was not enough)


@dataclass(frozen=True)
class Exactness:
    """What ``make_exact`` found: the plan of every kind of product, and whether that suffices."""

    plans: dict[str, RowPlan]  # kind (format dtype shape, or attention) -> plan
    key_block: int
    exact: bool

    def describe(self) -> str:
        parts = [f"{kind}: {plan.describe()}" for kind, plan in self.plans.items()]
        return "; ".join([*parts, f"attention keys padded to a multiple of {self.key_block}"])


def make_exact(model: DecoderModel) -> Exactness:
    """Probe and set ``model``'s row plans and key padding (see the module docstring)."""
    probed: dict[str, RowPlan] = {}
    plans: dict[str, RowPlan] = {}  # the kinds the model runs after any fallback

    def plan_of(kind: str, probe: object, in_features: int, elements: int = PROBE_ELEMENTS) -> RowPlan:
        if kind not in probed:
            probed[kind] = probe_rows(probe, in_features, model.dtype, model.device, elements)  # type: ignore[arg-type]
        plans[kind] = probed[kind]
        return probed[kind]

    def exact_weight(weight: Weight) -> tuple[Weight, RowPlan]:
        plan = plan_of(product_kind(weight), partial(linear, weight=weight), weight.shape[1])
        if plan.invariant or not (isinstance(weight, torch.Tensor) and weight.is_mkldnn):
            return weight, plan
        # oneDNN's blocking for this shape changes with the row count beyond what padding mends
        # (measured: bf16 1536x8960 on an AVX-512 Xeon disagrees at 12..23 rows); the plain tensor's
        # kernel may not. The unpacked copy is the same values, so only the kind's speed changes.
        del plans[product_kind(weight)]
        dense = weight.to_dense()
        if product_kind(dense) not in probed:  # once per kind, not per layer
            log.info("exactness: %s is not row-invariant; running it unpacked", product_kind(weight))
        return dense, plan_of(product_kind(dense), partial(linear, weight=dense), dense.shape[1])

    for layer in model.layers:
        for name in PRODUCTS:
            weight, layer.plans[name] = exact_weight(getattr(layer, name))
            setattr(layer, name, weight)
    if model.lm_head is not model.embed:
        model.lm_head, model.head_plan = exact_weight(model.lm_head)
    else:
        model.head_plan = exact_weight(model.lm_head)[1]
    cfg = model.cfg
    kind = f"attention {str(model.dtype).removeprefix('torch.')} d{cfg.head_dim}"
    # attention's products are small and each probe call draws its keys: a 32nd of the elements
    attention = plan_of(kind, partial(_attention_rows, model), cfg.head_dim, PROBE_ELEMENTS // 32)
    for layer in model.layers:
        layer.plans[ATTENTION] = attention
    exact = all(plan.invariant for plan in plans.values())
    for key_block in (1, KEY_BLOCK):
        attend = partial(grouped_attention, plan=attention, key_block=key_block)
        if attention_agrees(attend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device):
            break
    else:
        exact, key_block = False, 1
    for layer in model.layers:
        layer.key_block = key_block
    return Exactness(plans, key_block, exact)


def _attention_rows(model: DecoderModel, queries: object) -> object:  # [M, D] -> [M, D]
    """Attention of ``M`` folded query rows over fixed keys: what the row probe runs."""

    generator = torch.Generator(device="cpu").manual_seed(99)
    keys, values = (torch.randn(1, 1, 100, model.cfg.head_dim, generator=generator).to(queries) for _ in "kv")
    q = queries[None, None]  # type: ignore[index]  # [1, 1, M, D]: one KV head, M query rows
    return grouped_attention(q, keys, values, None, model.cfg.head_dim**-0.5)[0, 0]


@contextmanager
def suspended(model: DecoderModel) -> Iterator[None]:
    """Run ``model`` as it would without ``make_exact`` for a while (a benchmark of its cost)."""
    saved = [(dict(layer.plans), layer.key_block) for layer in model.layers], model.head_plan
    for layer in model.layers:
        layer.plans = dict.fromkeys(layer.plans)
        layer.key_block = 1
    model.head_plan = None
    try:
        yield
    finally:
        for layer, (plans, key_block) in zip(model.layers, saved[0], strict=True):
            layer.plans, layer.key_block = plans, key_block
        model.head_plan = saved[1]
