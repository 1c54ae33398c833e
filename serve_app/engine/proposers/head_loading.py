"""What a head proposer (EAGLE, Medusa) needs from its options and the store: the head file
checked against the target, the target's dense output head, the tokens its head keeps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.engine.heads.eagle_head import dense_output_head
from serve_app.engine.heads.head_file import HeadManifest, head_paths, load_head
from serve_app.engine.proposers.draft_model import frequent_token_ids
from serve_app.engine.proposers.registry import ProposerContext


@dataclass(frozen=True)
class HeadParts:
    path: Path
    manifest: HeadManifest
    tensors: dict[str, torch.Tensor]
    head_ids: tuple[int, ...] | None  # the output head's rows the head reads tokens from
    output_head: torch.Tensor  # [vocab, hidden] the target's, dense
    weight_format: str  # dense | q8
    min_confidence: float


def load_head_parts(context: ProposerContext, kind: str) -> HeadParts:
    """The ``kind`` head for ``context``'s target: ``options.path``, else the one stored with the
    target (``heads/<kind>.safetensors`` in its folder). Missing: FileNotFoundError saying how to
    train one; trained for another target: ``HeadMismatchError``."""
    options = context.options
    if context.target_path is None:
        raise ValueError(f"the {kind} proposer needs the target's folder (ProposerContext.target_path)")
    path = Path(str(options["path"])) if options.get("path") else head_paths(context.target_path, kind)[0]
    target_name = str(options.get("target_name", context.target_path))
    manifest, tensors = load_head(path, kind, context.target_path, target_name)
    target = context.target
    head_tokens = int(options.get("head_tokens", 0) or 0) or int(manifest.config.get("head_tokens", 0) or 0)
    vocab = target.cfg.vocab_size  # type: ignore[attr-defined]
    head_ids = frequent_token_ids(context.tokenizer, head_tokens) if 0 < head_tokens < vocab else None
    weight_format = str(options.get("weight_format", "target"))
    if weight_format == "target":  # a quantized target's head in Q8; a dense target's as it is
        weight_format = "dense" if target.weight_format == "dense" else "q8"  # type: ignore[attr-defined]
    return HeadParts(
        path,
        manifest,
        tensors,
        head_ids,
        dense_output_head(target, context.target_path),  # type: ignore[arg-type]
        weight_format,
        float(options.get("min_confidence", 0.0) or 0.0),
    )
