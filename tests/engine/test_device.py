"""The dtype the engine computes in: ``auto`` follows the weight format and the device."""

from __future__ import annotations

import pytest

from serve_app.config import Settings
from serve_app.engine.device import resolve_dtype


def test_auto_is_float32_for_quantized_weights_on_a_cpu_and_bf16_otherwise() -> None:
    assert resolve_dtype("auto", "gguf", "cpu") == "float32"
    assert resolve_dtype("auto", "q8", "cpu") == "float32"
    assert resolve_dtype("auto", "dense", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "dense", "cuda:0") == "bfloat16"


def test_an_explicit_dtype_wins_and_an_unknown_one_is_named() -> None:
    assert resolve_dtype("bfloat16", "gguf", "cpu") == "bfloat16"
    assert resolve_dtype("float32", "dense", "cpu") == "float32"
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", "dense", "cpu")


def test_the_settings_default_is_auto() -> None:
    assert Settings().runtime.dtype == "auto"
