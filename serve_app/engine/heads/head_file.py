"""Draft heads on disk: one safetensors file per kind beside the target they were trained on.

    <model folder>/heads/<kind>.safetensors   the head's own weights (float32)
    <model folder>/heads/<kind>.json          manifest: kind, shape, the target's fingerprint,
                                              the file's sha256, how it was trained

A head reads the target's hidden states and shares its embedding and output head, so it is only
meaningful for the exact weights it was trained on. ``load_head`` checks the file's sha256 and the
target's fingerprint and refuses anything else with a :class:`HeadMismatchError` that names both.
The fingerprint hashes the target's ``config.json`` and evenly spaced samples of its weight files
(a few MB however large the model), so checking it costs milliseconds, not a full read.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HEADS_DIR = "heads"
HEAD_FORMAT = "specserve-heads/1"
_SAMPLES = 16  # sampled blocks per weight file
_SAMPLE_BYTES = 1 << 16
_BLOCKS_FILE_SUFFIX = "blocks.safetensors"  # the GGUF blocks: a re-extraction keeps the weights


class HeadMismatchError(ValueError):
    """A head file that cannot serve this target (another target, altered file, other format)."""


@dataclass(frozen=True)
class HeadManifest:
    """What is known about a head file besides its tensors."""

    kind: str  # the proposer it feeds (its registry name)
    config: dict[str, Any]  # its shape (sizes, head tokens); the builder of ``kind`` reads it
    target: str  # the target's name, for messages
    target_fingerprint: str
    sha256: str = ""  # of the safetensors file; filled in by ``save_head``
    training: dict[str, Any] = field(default_factory=dict)  # corpus, tokens, seconds, seed, loss

    def to_json(self) -> str:
        return json.dumps({"format": HEAD_FORMAT, **self.__dict__}, indent=2, sort_keys=True)


def heads_dir(model_path: str | Path) -> Path:
    return Path(model_path) / HEADS_DIR


def head_paths(model_path: str | Path, kind: str) -> tuple[Path, Path]:
    """(weights, manifest) of the ``kind`` head stored with the model in ``model_path``."""
    folder = heads_dir(model_path)
    return folder / f"{kind}.safetensors", folder / f"{kind}.json"


def target_fingerprint(model_path: str | Path) -> str:
    """A digest of the target's config and weights: equal for the same weights, cheap to compute."""
    path = Path(model_path)
    digest = hashlib.sha256()
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    digest.update(config.read_bytes())
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.endswith(_BLOCKS_FILE_SUFFIX))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def save_head(
    model_path: str | Path, manifest: HeadManifest, tensors: dict[str, torch.Tensor], out: Path | None = None
) -> Path:
    """Write the head (atomically: a temp file renamed) and its manifest; return the weights' path.

    ``out``: a folder other than the model's ``heads/`` (the manifest still names the target)."""
    from safetensors.torch import save_file

    weights, manifest_path = head_paths(model_path, manifest.kind)
    if out is not None:
        weights, manifest_path = Path(out) / weights.name, Path(out) / manifest_path.name
    weights.parent.mkdir(parents=True, exist_ok=True)
    tmp = weights.parent / f".{weights.name}.tmp-{os.getpid()}"
    save_file({k: v.detach().contiguous().float() for k, v in tensors.items()}, str(tmp))
    done = HeadManifest(**{**manifest.__dict__, "sha256": file_sha256(tmp)})
    manifest_tmp = manifest_path.parent / f".{manifest_path.name}.tmp-{os.getpid()}"
    manifest_tmp.write_text(done.to_json())
    os.replace(tmp, weights)
    os.replace(manifest_tmp, manifest_path)
    return weights


def read_manifest(weights: Path) -> HeadManifest:
    manifest_path = weights.with_suffix(".json")
    if not manifest_path.is_file():
        raise HeadMismatchError(f"head {weights} has no manifest {manifest_path.name} beside it")
    data = json.loads(manifest_path.read_text())
    if data.pop("format", None) != HEAD_FORMAT:
        raise HeadMismatchError(f"head {weights}: manifest format is not {HEAD_FORMAT}")
    return HeadManifest(**data)


def load_head(
    weights: str | Path, kind: str, target_path: str | Path, target_name: str = "the target"
) -> tuple[HeadManifest, dict[str, torch.Tensor]]:
    """The head's manifest and tensors, after checking kind, checksum and target; else
    :class:`HeadMismatchError` (FileNotFoundError where no head is stored)."""
    from safetensors.torch import load_file

    weights = Path(weights)
    if not weights.is_file():
        raise FileNotFoundError(
            f"no {kind} head at {weights}; train one with `specserve train-heads --model <target> "
            f"--kind {kind}`"
        )
    manifest = read_manifest(weights)
    if manifest.kind != kind:
        raise HeadMismatchError(f"head {weights} is a {manifest.kind} head, not a {kind} head")
    if file_sha256(weights) != manifest.sha256:
        raise HeadMismatchError(f"head {weights}: sha256 does not match its manifest (altered or truncated)")
    fingerprint = target_fingerprint(target_path)
    if fingerprint != manifest.target_fingerprint:
        raise HeadMismatchError(
            f"the {kind} head at {weights} was trained for target {manifest.target} "
            f"(fingerprint {manifest.target_fingerprint[:12]}), not for {target_name} "
            f"(fingerprint {fingerprint[:12]}); train one for it with `specserve train-heads`"
        )
    return manifest, load_file(str(weights))
