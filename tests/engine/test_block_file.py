"""A model folder's GGUF blocks file: written, read back, and what "auto" makes of a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from serve_app.engine.block_file import BLOCKS_FILE, FORMAT, read_blocks, resolve_weight_format, tensors_of
from serve_app.engine.kernels import kernels_module
from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q6k_weight import Q6KWeight
from serve_app.engine.q8_weight import Q8Weight


def write_blocks(folder: Path, weights: dict, fmt: str = FORMAT) -> None:
    entries = {}
    for name, weight in weights.items():
        entries.update(tensors_of(name, weight))
    save_file(entries, str(folder / BLOCKS_FILE), metadata={"format": fmt})


def test_blocks_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    weights = {
        "model.layers.0.mlp.up_proj.weight": Q4KWeight.quantize(torch.randn(8, 256)),
        "model.layers.0.self_attn.v_proj.weight": Q8Weight.quantize(torch.randn(4, 64)),
        "model.layers.0.mlp.down_proj.weight": Q6KWeight.quantize(torch.randn(20, 512)),
    }
    write_blocks(tmp_path, weights)
    read = read_blocks(tmp_path)
    assert read.keys() == weights.keys()
    for name, weight in weights.items():
        assert type(read[name]) is type(weight)
        for field in type(weight).__dataclass_fields__:
            got, want = getattr(read[name], field), getattr(weight, field)
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


def test_missing_or_foreign_files_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="specserve models fetch"):
        read_blocks(tmp_path)
    write_blocks(tmp_path, {"w": Q8Weight.quantize(torch.randn(2, 32))}, fmt="something-else/9")
    with pytest.raises(ValueError, match="fetch the pack again"):
        read_blocks(tmp_path)


def test_auto_is_gguf_only_for_a_folder_with_blocks(tmp_path: Path) -> None:
    assert resolve_weight_format("auto", tmp_path) == "dense"
    assert resolve_weight_format("q8", tmp_path) == "q8"
    write_blocks(tmp_path, {"w": Q8Weight.quantize(torch.randn(2, 32))})
    assert resolve_weight_format("auto", tmp_path) == ("gguf" if kernels_module() is not None else "dense")
    assert resolve_weight_format("dense", tmp_path) == "dense"
    assert resolve_weight_format("auto", tmp_path, "cuda:0") == "dense"  # our kernels are CPU kernels
