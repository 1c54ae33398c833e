"""Row invariance: the probe finds the row counts whose rows agree, linear pads to them, and the
model's one-row decode equals the same row inside a wider verify forward, bit for bit."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.attention import grouped_attention
from serve_app.engine.exactness import make_exact
from serve_app.engine.invariance import PROBE_ROWS, RowPlan, attention_agrees, probe_rows
from serve_app.engine.model import DecoderModel
from serve_app.engine.weights import linear
from tests.conftest import make_tiny_hf_model


def rounding_below(threshold: int):
    """A product whose rows round differently when fewer than ``threshold`` rows run together."""

    def product(x: torch.Tensor) -> torch.Tensor:
        out = x.sum(dim=-1, keepdim=True).repeat(1, 3)
        return out + 1e-3 if x.shape[0] < threshold else out

    return product


def test_probe_finds_the_agreeing_counts() -> None:
    plan = probe_rows(rounding_below(4), 8, torch.float32, torch.device("cpu"))
    assert plan.agreeing == frozenset(range(4, PROBE_ROWS + 1)) and plan.tail_from == 4
    assert (plan.padded(1), plan.padded(3), plan.padded(4), plan.padded(40)) == (4, 4, 4, 40)
    assert plan.invariant and plan.min_rows == 4


def test_the_probe_finds_a_rounding_that_shows_in_one_element_of_thousands() -> None:
    # Like oneDNN's bf16 1-row product on an AVX-512 BF16 EPYC: alone, a row rounds about one output in
    # 1024 differently (which ones depends on the values), among others never.
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))

    def product(x: torch.Tensor) -> torch.Tensor:
        out = (x[:, None, :] * weight).sum(-1)  # each (row, output) summed alone: agrees at any count
        if x.shape[0] == 1:
            rare = (out * 1e4).floor().remainder(1024) == 0
            out = torch.where(rare, out + 1e-3, out)
        return out

    plan = probe_rows(product, 32, torch.float32, torch.device("cpu"))
    assert plan.tail_from == 2 and plan.padded(1) == 2


def test_a_product_that_depends_on_every_count_is_not_invariant() -> None:
    plan = probe_rows(lambda x: x[:, :2] * x.shape[0], 8, torch.float32, torch.device("cpu"))
    assert not plan.invariant and plan.padded(3) == 3
    assert "not row-invariant" in plan.describe()


def test_position_dependent_rows_are_not_invariant() -> None:
    def by_position(x: torch.Tensor) -> torch.Tensor:
        return x[:, :1] + torch.arange(x.shape[0], dtype=x.dtype)[:, None]

    assert not probe_rows(by_position, 4, torch.float32, torch.device("cpu")).invariant


def test_gaps_are_padded_to_the_next_agreeing_count() -> None:
    plan = RowPlan(frozenset({4, 8, *range(12, PROBE_ROWS + 1)}), 12)  # float32 F.linear on AVX2
    assert [plan.padded(m) for m in (1, 4, 5, 9, 12, 13)] == [4, 4, 8, 12, 12, 13]
    assert plan.describe() == "row-invariant at [4, 8] and from 12 rows"


def test_linear_with_a_plan_runs_the_padded_count_and_slices() -> None:
    weight = torch.randn(5, 8)
    x = torch.randn(2, 3, 8)
    plan = RowPlan(frozenset({8, *range(8, PROBE_ROWS + 1)}), 8)
    out = linear(x, weight, plan=plan)
    padded = torch.cat([x.reshape(6, 8), torch.zeros(2, 8)])
    assert out.shape == (2, 3, 5)
    assert torch.equal(out.reshape(6, 5), torch.nn.functional.linear(padded, weight)[:6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_sees_the_same_sum_whatever_the_number_of_masked_keys_behind(dtype) -> None:
    # A decode step at position 284 pads its keys to 288, a verify forward of 8 from there to 320
    # (key_block 32): on an AVX-512 BF16 EPYC one float32 product of probabilities and values summed those
    # differently (a structured-output answer parted from plain decoding); in chunks it cannot.
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 12, 1, 64, generator=generator).to(dtype)  # 3 KV heads of 4 query rows
    keys, values = (torch.randn(1, 3, 320, 64, generator=generator).to(dtype) for _ in "kv")
    outs = [
        grouped_attention(q, keys[:, :, :width], values[:, :, :width], None, 0.125, None, 32, 285)
        for width in (288, 320)
    ]
    visible = torch.arange(320) < 285
    wider = grouped_attention(q, keys, values, visible.view(1, 1, 1, 320), 0.125, None, 1, 320)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], wider)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_queries_or_padding_keys_once_padded(dtype) -> None:
    model = DecoderModel.from_hf_model(make_tiny_hf_model(300, layers=1), dtype=dtype)
    found = make_exact(model)
    assert found.exact
    plan = model.layers[0].plans["attention"]

    def attend(*args):
        return grouped_attention(*args, plan=plan, key_block=found.key_block)

    assert attention_agrees(attend, 4, 2, 16, dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoded_token_equals_itself_in_a_wider_verify_forward(dtype) -> None:
    model = DecoderModel.from_hf_model(make_tiny_hf_model(300, layers=2), dtype=dtype)
    found = make_exact(model)
    assert found.plans and found.exact
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    cache = model.new_cache(2, 64)
    slot = cache.allocate()
    model.forward(prompt, cache, [slot])
    cache.set_length(slot, prompt.shape[1])
    one = model.logits(model.forward(torch.tensor([[42]]), cache, [slot]))  # a plain decode step
    wide = model.logits(model.forward(torch.tensor([[42, 3, 4, 5, 6, 7, 8]]), cache, [slot]))  # verify
    assert torch.equal(one[0, 0], wide[0, 0])


def test_suspended_runs_without_the_plans_and_restores_them() -> None:
    from serve_app.engine.exactness import suspended

    model = DecoderModel.from_hf_model(make_tiny_hf_model(300, layers=1))
    found = make_exact(model)
    before = dict(model.layers[0].plans), model.layers[0].key_block, model.head_plan
    with suspended(model):
        assert all(plan is None for plan in model.layers[0].plans.values()) and model.head_plan is None
        assert model.layers[0].key_block == 1
    assert (dict(model.layers[0].plans), model.layers[0].key_block, model.head_plan) == before
    assert found.key_block == before[1]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN here")
def test_a_prepacked_kind_that_cannot_be_made_invariant_runs_unpacked(monkeypatch) -> None:
    """Measured on an AVX-512 Xeon: oneDNN's bf16 1536x8960 disagrees at 12..23 rows, which no
    padding mends; the plain tensor's kernel agrees from 2. Here the probe is told so for the one
    prepacked matrix, and make_exact must fall back to its unpacked copy and stay exact."""
    import serve_app.engine.exactness as exactness

    model = DecoderModel.from_hf_model(make_tiny_hf_model(300, layers=1))
    layer = model.layers[0]
    dense = layer.down
    layer.down = torch.ops.mkldnn._reorder_linear_weight(dense, 1)
    real_probe = exactness.probe_rows

    def probe(product, in_features, dtype, device, *more):
        plan = real_probe(product, in_features, dtype, device, *more)
        prepacked = (
            getattr(product.keywords.get("weight"), "is_mkldnn", False)
            if hasattr(product, "keywords")
            else False
        )
        return RowPlan(plan.agreeing, None) if prepacked else plan

    monkeypatch.setattr(exactness, "probe_rows", probe)
    found = make_exact(model)
    assert not layer.down.is_mkldnn and torch.equal(layer.down, dense)
    assert found.exact and not any(kind.startswith("prepacked") for kind in found.plans)
