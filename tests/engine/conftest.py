"""Fixtures the engine tests share (each module may define its own of the same name instead)."""

from __future__ import annotations

import pytest

from tests.conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    """The tiny random float32 target most speculation tests decode with (seed 0, 2 layers)."""
    return make_tiny_hf_model(len(tiny_tokenizer), seed=0)
