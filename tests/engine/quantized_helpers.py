"""What the tests of the quantized weight formats (q8, gguf) share."""

from __future__ import annotations

import os

import pytest
import torch

from serve_app.engine.kernels import kernels_module
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q6k_weight import Q6KWeight


def require_built_kernels() -> None:
    """Skip the calling module where our kernels are not built; under CI that is a failure."""
    if kernels_module() is not None:
        return
    if os.environ.get("CI"):
        pytest.fail("our kernels are not built (make install builds them)", pytrace=False)
    pytest.skip("our kernels are not built: run `python -m serve_app.native_build`", allow_module_level=True)


def assert_speculation_equals_plain(engine, tokenizer) -> None:
    """Greedy and seeded requests: n-gram and self-speculation at depths 1 and 4 == plain decoding."""
    assert engine.exact
    prompts = [tokenizer("def add(a, b):")["input_ids"], tokenizer("for i in range(10):")["input_ids"]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)]  # fmt: skip
    plain = [r.token_ids for r in engine.generate(prompts, params, SpecOverride("off"))]
    for mode in ("ngram", "self"):
        for depth in (1, 4):
            assert [r.token_ids for r in engine.generate(prompts, params, SpecOverride(mode, depth))] == plain


def q4k_m_blocks(hf: torch.nn.Module) -> dict[str, Q4KWeight | Q6KWeight]:
    """A Q4_K_M file's mix for ``hf``: Q6_K for the down and v matrices and the head, Q4_K elsewhere."""
    out: dict[str, Q4KWeight | Q6KWeight] = {}
    for name, tensor in hf.state_dict().items():
        if name.startswith("model.layers.") and tensor.dim() == 2:
            six = "down_proj" in name or "v_proj" in name
            out[name] = (Q6KWeight if six else Q4KWeight).quantize(tensor)
    head = "lm_head.weight" if "lm_head.weight" in hf.state_dict() else "model.embed_tokens.weight"
    out[head] = Q6KWeight.quantize(hf.state_dict()[head])
    return out
