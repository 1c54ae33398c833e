"""What the tests of the quantized weight formats (q8, gguf) share."""

from __future__ import annotations

import os

import pytest

from serve_app.engine.kernels import kernels_module
from serve_app.engine.params import SamplingParams, SpecOverride


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
