"""The target's own features and choices over the corpus, written as shards on disk.

One prefill forward per batch of chunks (no generation): for every position the target's final
normed hidden state (bf16 on disk) and its argmax token (what it would emit there). A shard holds
``chunks_per_shard`` chunks:

    tokens    [S, L] int32      the chunk's token ids
    features  [S, L, H] bf16    the target's hidden state after each token
    choices   [S, L] int32      the target's argmax after each token (predicts the next)

Shards are written atomically and named by index; the chunk stream is deterministic, so a run
that stops resumes at the first missing shard. Memory stays at one batch of chunks, whatever the
corpus: training streams the shards back (``read_shard``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import torch

from serve_app.engine.model import DecoderModel

SHARD_GLOB = "shard-*.safetensors"
ARGMAX_ROWS = 256  # logits rows per output-head call (151k floats each)


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.safetensors"


def existing_shards(folder: Path) -> list[Path]:
    return sorted(folder.glob(SHARD_GLOB))


@torch.inference_mode()
def target_features(model: DecoderModel, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features ``[B, L, H]``, choices ``[B, L]``) of equal-length chunks, one forward."""
    tokens = torch.tensor(chunks, device=model.device)  # [B, L]
    batch, length = tokens.shape
    cache = model.new_cache(batch, length)
    slots = [cache.allocate() for _ in range(batch)]
    hidden = model.forward(tokens, cache, slots)  # [B, L, H]
    flat = hidden.reshape(batch * length, -1)
    choices = torch.cat(
        [model.logits(flat[i : i + ARGMAX_ROWS]).argmax(dim=-1) for i in range(0, flat.shape[0], ARGMAX_ROWS)]
    )
    return hidden, choices.view(batch, length)


def extract_shards(
    model: DecoderModel,
    chunks: Iterable[list[int]],
    folder: Path,
    num_shards: int,
    chunks_per_shard: int,
    batch: int = 4,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write shards ``0 .. num_shards-1`` that are missing (the chunk stream skipped past the ones
    present); ``progress(tokens)`` after each batch. Returns the shards, in order."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    stream: Iterator[list[int]] = iter(chunks)
    paths = []
    for index in range(num_shards):
        path = shard_path(folder, index)
        group = list(islice(stream, chunks_per_shard))
        if len(group) < chunks_per_shard:
            break  # the corpus ran out
        paths.append(path)
        if path.is_file():
            if progress:
                progress(len(group) * len(group[0]))
            continue
        features, choices = [], []
        for start in range(0, len(group), batch):
            part = group[start : start + batch]
            hidden, chosen = target_features(model, part)
            features.append(hidden.to(torch.bfloat16))
            choices.append(chosen)
            if progress:
                progress(len(part) * len(part[0]))
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        save_file(
            {
                "tokens": torch.tensor(group, dtype=torch.int32),
                "features": torch.cat(features).contiguous(),
                "choices": torch.cat(choices).to(torch.int32),
            },
            str(tmp),
        )
        os.replace(tmp, path)
    return paths


def shard_rows(path: Path) -> int:
    """Chunks in a shard, read from its header (shards of answers vary in size)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return int(f.get_slice("tokens").get_shape()[0])


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
