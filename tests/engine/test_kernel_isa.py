"""Every vector path of our kernels (AMX, AVX-512 VNNI, AVX2, scalar) gives the same numbers, bit for
bit.

The engine takes the best path the CPU has; a pack served on an AVX2 host and on an AVX-512 host
therefore decodes the same tokens, and a path that rounded differently would be a bug. Paths the
CPU lacks are skipped (say which)."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.kernels import kernels_module
from serve_app.engine.q4k_weight import Q4KWeight
from serve_app.engine.q6k_weight import Q6KWeight
from serve_app.engine.q8_weight import Q5Weight, Q8Weight
from tests.engine.quantized_helpers import require_built_kernels

require_built_kernels()

PATHS = ("amx", "avx512", "avx2", "scalar")


@pytest.fixture
def kernels():
    module = kernels_module()
    yield module
    module.force_isa("auto")


def available(module) -> list[str]:
    paths = []
    for path in PATHS:
        try:
            module.force_isa(path)
        except RuntimeError:
            continue
        paths.append(path)
    module.force_isa("auto")
    return paths


def products_on_every_path(module, weight, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for path in available(module):
        module.force_isa(path)
        out[path] = weight.matmul(x)
    return out


# in_features: one super-block; the Qwen 1.5B widths; for q8 also an even and an odd number of
# blocks (50 and 51: the last tile half empty)
# rows: 1 = decode; 3 = the VNNI path's groups of rows; 4 = AMX's first width; 5 = the Q4_K VNNI
# path's one pass of 5; 9 = passes of 4 and 5 (Q4_K VNNI), 4, 4 and 1 (Q6_K VNNI) or one tile (AMX);
# 17 and 33 = AMX chunks of 16 with a zero-padded tail. 67 outputs: four groups of 16 and a last of 3
@pytest.mark.parametrize("six_bits", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 17, 33])
@pytest.mark.parametrize("in_features", [256, 1536, 8960])
def test_q4k_and_q6k_paths_agree(kernels, in_features: int, rows: int, six_bits: bool) -> None:
    torch.manual_seed(in_features)
    weight = (Q6KWeight if six_bits else Q4KWeight).quantize(torch.randn(67, in_features) * 0.05)
    x = torch.randn(rows, in_features)
    out = products_on_every_path(kernels, weight, x)
    assert len(out) >= 2, f"only {list(out)} here"
    reference = out["scalar"]
    for path, result in out.items():
        assert torch.equal(result, reference), path
    # int8 activations: the error grows with the inputs summed
    tolerance = 0.05 * (in_features / 256) ** 0.5
    torch.testing.assert_close(reference, x @ weight.dequantize().T, rtol=0.05, atol=tolerance)


@pytest.mark.parametrize("five_bits", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("in_features", [256, 1536, 1600, 1632, 8960])
def test_q8_paths_agree(kernels, in_features: int, rows: int, five_bits: bool) -> None:
    torch.manual_seed(in_features)
    dense = torch.randn(67, in_features) * 0.05
    weight = (Q5Weight if five_bits else Q8Weight).quantize(dense)
    x = torch.randn(rows, in_features)
    out = products_on_every_path(kernels, weight, x)
    assert len(out) >= 2, f"only {list(out)} here"
    reference = out["scalar"]
    for path, result in out.items():
        assert torch.equal(result, reference), path
    torch.testing.assert_close(
        reference, x @ weight.dequantize().T, rtol=0.05, atol=0.05 * (in_features / 256) ** 0.5
    )


def test_the_engine_takes_the_best_path_and_refuses_unknown_ones(kernels) -> None:
    assert kernels.active_isa() == available(kernels)[0]
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        kernels.force_isa("neon")


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_q8_tile_prefetch_changes_no_number(kernels, rows: int) -> None:
    """Prefetching the Q8 tiles (on by vendor and pass width) is a matter of speed only."""
    torch.manual_seed(rows)
    weight = Q8Weight.quantize(torch.randn(67, 1536) * 0.05)
    x = torch.randn(rows, 1536)
    default = kernels.tile_prefetch_rows()
    assert default in (0, 1, 4)
    try:
        results = []
        for from_rows in (0, 1, 4):
            kernels.set_tile_prefetch(from_rows)
            assert kernels.tile_prefetch_rows() == from_rows
            results.append(weight.matmul(x))
    finally:
        kernels.set_tile_prefetch(-1)
    assert kernels.tile_prefetch_rows() == default
    for result in results[1:]:
        assert torch.equal(result, results[0])
