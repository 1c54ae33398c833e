"""The GGUF blocks file of a model folder: the quantized matrices of the ``gguf`` weight format.

``packs.extract_blocks`` writes it beside a pack's bf16 safetensors (``BLOCKS_FILE``), taking the
blocks from the pack's GGUF as they are; ``read_blocks`` turns it into weights keyed by the
checkpoint's parameter names. Per matrix ``name`` it holds either

- ``name:q4k.qs / .d / .dmin / .scales / .mins``: Q4_K blocks in the GGUF's layout
  (``q4k_weight.Q4KBlocks``; tiled for the kernels when read), or
- ``name:q6k.ql / .qh / .scales / .d``: Q6_K blocks (``q6k_weight.Q6KBlocks``: the GGUF's numbers,
  its 6-bit values split into low nibbles and top bits), or
- ``name:q8.data / .scales``: int8 values with an fp16 scale per 32 inputs (``q8_weight.Q8Blocks``),
  which hold the GGUF's Q8_0, Q5_0 and Q4_0 blocks exactly (read as ``Q5Weight`` where every value
  fits in 5 bits).

A matrix the file lacks (e.g. a float one) is re-quantized to Q8 from the dense weights at load.
Format 2 added the Q6_K matrices (format 1 re-quantized them to Q8 at load); the store extracts a
pack's file again when its format is not this one (``packs.store``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from serve_app.engine.q4k_weight import Q4KBlocks, Q4KWeight
from serve_app.engine.q6k_weight import Q6KBlocks, Q6KWeight
from serve_app.engine.q8_weight import Q5Weight, Q8Blocks, Q8Weight, fits_q5
from serve_app.engine.quantized import BlockWeight

BLOCKS_FILE = "gguf-blocks.safetensors"
FORMAT = "specserve-gguf-blocks/2"  # the file's metadata "format"; another value is refused
Q4K_FIELDS = Q4KBlocks.FIELDS
Q6K_FIELDS = Q6KBlocks.FIELDS
Q8_FIELDS = Q8Blocks.FIELDS


AUTO = "auto"  # a weight format resolved per model folder (resolve_weight_format)


def blocks_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / BLOCKS_FILE


def resolve_weight_format(requested: str, model_dir: str | Path, device: str = "cpu") -> str:
    """``requested``, or for ``auto``: ``gguf`` on a CPU where the folder has GGUF blocks (a model
    pack) and our kernels are built (they are CPU kernels), else ``dense``."""
    from serve_app.engine.kernels import kernels_module

    if requested != AUTO:
        return requested
    usable = str(device).startswith("cpu") and kernels_module() is not None
    return "gguf" if usable and blocks_path(model_dir).is_file() else "dense"


def tensors_of(name: str, weight: BlockWeight) -> dict[str, torch.Tensor]:
    """The file's entries for one matrix."""
    if isinstance(weight, Q4KWeight):
        kind, fields = "q4k", Q4K_FIELDS
    elif isinstance(weight, Q6KWeight):
        kind, fields = "q6k", Q6K_FIELDS
    else:
        kind, fields = "q8", Q8_FIELDS
    blocks = weight.blocks()
    return {f"{name}:{kind}.{field}": getattr(blocks, field).contiguous() for field in fields}


def read_blocks(model_dir: str | Path) -> dict[str, BlockWeight]:
    """The matrices of ``model_dir``'s blocks file by parameter name; FileNotFoundError (naming the
    command that writes it) when the folder has none."""
    from safetensors import safe_open

    path = blocks_path(model_dir)
    if not path.is_file():
        raise FileNotFoundError(
            f"the gguf weight format needs {path}, which `specserve models fetch <pack>` writes "
            "for a model pack (a folder that is not a pack has no GGUF blocks: use q8 or dense)"
        )
    fields: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file: fetch the pack again")
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            name, field = key.rsplit(":", 1)
            fields.setdefault(name, {})[field] = f.get_tensor(key)
    weights: dict[str, BlockWeight] = {}
    for name, entries in fields.items():
        if "q4k.qs" in entries:
            blocks = Q4KBlocks(*(entries[f"q4k.{field}"] for field in Q4K_FIELDS))
            weights[name] = Q4KWeight.from_blocks(blocks)
        elif "q6k.ql" in entries:
            weights[name] = Q6KWeight.from_blocks(
                Q6KBlocks(*(entries[f"q6k.{field}"] for field in Q6K_FIELDS))
            )
        else:
            plain = Q8Blocks(*(entries[f"q8.{field}"] for field in Q8_FIELDS))
            # the GGUF's Q5_0 / Q4_0 blocks: the same numbers from 5 bits
            weights[name] = (Q5Weight if fits_q5(plain) else Q8Weight).from_blocks(plain)
    return weights
