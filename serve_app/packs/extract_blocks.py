"""A pack's GGUF -> its blocks file (``engine.block_file``): the quantized matrices as they are.

Q4_K tensors keep their blocks (scales unpacked); Q6_K tensors their values, scales and d (split
into low nibbles and top bits); Q8_0, Q5_0 and Q4_0 tensors become int8 values with their own fp16
scale per 32 inputs (exact: each value is ``d * small integer``); other types (float) are left out
and re-quantized to Q8 at load. Every kept matrix is checked against the
pack's bf16 weights (which ``convert`` dequantized from the same GGUF): rows must match exactly,
taking back llama.cpp's reordering of q / k rows for Llama models where it applies; a matrix that
does not match is left out with a warning, never used.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from serve_app.engine.block_file import BLOCKS_FILE, FORMAT, tensors_of
from serve_app.engine.q4k_weight import Q4KBlocks, Q4KWeight
from serve_app.engine.q6k_weight import Q6KBlocks, Q6KWeight
from serve_app.engine.q8_weight import Q8Blocks, Q8Weight
from serve_app.engine.quantized import BlockWeight

LAYER_MATRICES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
GLOBAL_MATRICES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def checkpoint_name(gguf_name: str) -> str | None:
    """The checkpoint's name for a GGUF matrix (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for what is not a matrix we multiply by."""
    if gguf_name in GLOBAL_MATRICES:
        return GLOBAL_MATRICES[gguf_name]
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if found and found.group(2) in LAYER_MATRICES:
        return f"model.layers.{found.group(1)}.{LAYER_MATRICES[found.group(2)]}.weight"
    return None


def q4k_from_blocks(raw: np.ndarray, rows: int, cols: int) -> Q4KWeight:
    """Q4_K blocks (144 bytes per 256 inputs: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes
    of 4-bit values) -> ``Q4KWeight`` with the scales unpacked."""
    blocks = raw.reshape(rows, cols // 256, 144)
    d = blocks[..., 0:2].copy().view(np.int16)[..., 0]
    dmin = blocks[..., 2:4].copy().view(np.int16)[..., 0]
    packed = blocks[..., 4:16].astype(np.uint8)
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # Blocks 0-3 keep their scale / min in the low 6 bits of `low` / `high`; blocks 4-7 in the
    # nibbles of `rest`, with their two top bits in the top bits of `low` / `high`.
    scales = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:144].reshape(rows, cols // 2)
    return Q4KWeight.from_blocks(Q4KBlocks(
        torch.from_numpy(np.ascontiguousarray(qs)),
        torch.from_numpy(np.ascontiguousarray(d)),
        torch.from_numpy(np.ascontiguousarray(dmin)),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1))),
    ))  # fmt: skip


def q6k_from_blocks(raw: np.ndarray, rows: int, cols: int) -> Q6KWeight:
    """Q6_K blocks (210 bytes per 256 inputs: 128 bytes of low nibbles, 64 of top bits, 16 int8
    scales, fp16 d) -> ``Q6KWeight``; ``Q6KBlocks`` keeps each part's bytes in the GGUF's order."""
    blocks = raw.reshape(rows, cols // 256, 210)

    def part(start: int, end: int, dtype: type = np.uint8) -> torch.Tensor:  # [rows, bytes of all blocks]
        return torch.from_numpy(np.ascontiguousarray(blocks[..., start:end]).view(dtype).reshape(rows, -1))

    return Q6KWeight.from_blocks(
        Q6KBlocks(part(0, 128), part(128, 192), part(192, 208, np.int8), part(208, 210, np.int16))
    )


def q8_from_blocks(raw: np.ndarray, rows: int, cols: int, quant_type: object) -> Q8Weight:
    """Q8_0 / Q5_0 / Q4_0 blocks (an fp16 scale ``d`` first, then 32 small integers) -> int8 values
    with that scale: ``round(dequantized / d)`` is the block's integer exactly."""
    from gguf.quants import dequantize

    block_bytes = raw.shape[-1] // (cols // 32)
    d = raw.reshape(rows, cols // 32, block_bytes)[..., 0:2].copy().view(np.float16)[..., 0]
    values = dequantize(raw, quant_type).reshape(rows, cols // 32, 32)
    scale = d.astype(np.float32)[..., None]
    ints = np.where(scale != 0, np.round(values / np.where(scale != 0, scale, 1)), 0)
    data = torch.from_numpy(ints.astype(np.int8).reshape(rows, cols))
    return Q8Weight.from_blocks(Q8Blocks(data, torch.from_numpy(d.view(np.int16).copy())))


def _row_orders(rows: int, heads: tuple[int, ...]) -> list[torch.Tensor | None]:
    """Row orders to try: as stored, or llama.cpp's q / k reordering taken back for ``heads``."""
    orders: list[torch.Tensor | None] = [None]
    for n in heads:
        if n and rows % (2 * n) == 0:
            # the GGUF row of each checkpoint row: the file holds (head, i, half) where the checkpoint
            # holds (head, half, i)
            index = torch.arange(rows).reshape(n, rows // n // 2, 2).transpose(1, 2).reshape(rows)
            orders.append(index)
    return orders


def _reorder(weight: BlockWeight, index: torch.Tensor) -> BlockWeight:
    return type(weight).from_blocks(weight.blocks().select_rows(index))


def _dequantized(weight: BlockWeight) -> torch.Tensor:
    return weight.dequantize()


def matching(weight: BlockWeight, dense: torch.Tensor, heads: tuple[int, ...]) -> BlockWeight | None:
    """``weight`` in the row order whose values equal ``dense`` (bf16), or None if none does."""
    for index in _row_orders(weight.shape[0], heads):
        candidate = weight if index is None else _reorder(weight, index)
        if torch.equal(_dequantized(candidate).to(dense.dtype), dense):
            return candidate
    return None


def extract_blocks(gguf_file: Path, model_dir: Path, progress: bool = True) -> Path:
    """Write ``model_dir``'s blocks file from ``gguf_file``; returns its path."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    heads = (hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", 0) or 0)
    handles = [
        safe_open(str(f), framework="pt", device="cpu")
        for f in sorted(model_dir.glob("*.safetensors"))
        if f.name != BLOCKS_FILE
    ]
    dense_names = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
    converters: dict[object, Callable] = {Q.Q4_K: q4k_from_blocks, Q.Q6_K: q6k_from_blocks}
    for kind in (Q.Q8_0, Q.Q5_0, Q.Q4_0):
        converters[kind] = lambda raw, r, c, kind=kind: q8_from_blocks(raw, r, c, kind)
    out: dict[str, torch.Tensor] = {}
    kept = left = 0
    for tensor in GGUFReader(gguf_file).tensors:
        name = checkpoint_name(tensor.name)
        if name is None or name not in dense_names:  # e.g. the output of a tied head
            continue
        convert = converters.get(tensor.tensor_type)
        cols, rows = (int(n) for n in tensor.shape[:2])
        if convert is None:
            left += 1
            continue
        dense = dense_names[name].get_tensor(name)
        weight = matching(convert(np.asarray(tensor.data), rows, cols), dense, heads)
        if weight is None:
            warnings.warn(f"{tensor.name} does not match {name}: it will be re-quantized", stacklevel=2)
            left += 1
            continue
        out.update(tensors_of(name, weight))
        kept += 1
    target = model_dir / BLOCKS_FILE
    tmp = target.with_name(f".{BLOCKS_FILE}.tmp-{os.getpid()}")
    save_file(out, str(tmp), metadata={"format": FORMAT, "source": gguf_file.name})
    tmp.replace(target)
    if progress:
        print(
            f"{model_dir.name}: {kept} matrices kept as GGUF blocks, {left} re-quantized at load",
            file=sys.stderr,
        )
    return target
