"""The corpus heads are trained on: text every machine has, cut into equal token chunks.

Source and documentation files of the Python standard library and the installed packages (``.py``,
``.md``, ``.rst``, ``.txt``), in an order fixed by the seed. Every other chunk of a file is wrapped
as an assistant's answer in the target's chat template (a user asking for code or an explanation),
so that the head also sees the features of the assistant turns it drafts in when served.
A file belongs to the held-out set when a hash of its path says so (1 in ``HELD_OUT_EVERY``):
training never reads it, evaluation reads only it.
"""

from __future__ import annotations

import hashlib
import random
import site
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".py", ".md", ".rst", ".txt")
HELD_OUT_EVERY = 20
MIN_FILE_BYTES = 400
MAX_FILE_BYTES = 200_000
ASKS = (
    "Write this code.",
    "Show me an implementation.",
    "Explain with an example.",
    "Continue the file.",
    "Write the module.",
)


@dataclass(frozen=True)
class CorpusSpec:
    """Which chunks a run reads: the same spec always yields the same chunks, in order."""

    seed: int = 0
    chunk_tokens: int = 256
    held_out: bool = False  # True: only the held-out files (evaluation)
    roots: tuple[str, ...] = ()  # folders to read; () = the standard library and site-packages
    chat_every: int = 2  # wrap every n-th chunk of a file in the chat template (0 = never)


def default_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], *site.getsitepackages()]
    seen: list[str] = []
    for root in roots:
        if root and Path(root).is_dir() and root not in seen:
            seen.append(root)
    return tuple(seen)


def is_held_out(path: Path) -> bool:
    return (
        int(hashlib.sha1(path.name.encode() + str(path.parent.name).encode()).hexdigest(), 16)
        % HELD_OUT_EVERY
        == 0
    )


def corpus_files(spec: CorpusSpec) -> list[Path]:
    """The corpus's files in the spec's order (training or held-out)."""
    found: set[Path] = set()
    for root in spec.roots or default_roots():
        for suffix in SUFFIXES:
            for path in Path(root).rglob(f"*{suffix}"):
                if "__pycache__" in path.parts or not path.is_file():
                    continue
                size = path.stat().st_size
                if MIN_FILE_BYTES <= size <= MAX_FILE_BYTES and is_held_out(path) == spec.held_out:
                    found.add(path)
    files = sorted(found)
    random.Random(spec.seed).shuffle(files)
    return files


def _chat_prefix(tokenizer: object, ask: str) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
    )


def token_chunks(
    tokenizer: object, spec: CorpusSpec, files: Sequence[Path] | None = None
) -> Iterator[list[int]]:
    """Chunks of exactly ``spec.chunk_tokens`` token ids, file after file (endless files aside,
    the stream ends with the corpus). Deterministic for a spec and a tokenizer."""
    rng = random.Random(spec.seed + 1)
    size = spec.chunk_tokens
    for path in files if files is not None else corpus_files(spec):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        for n, start in enumerate(range(0, len(ids) - size // 2, size)):
            chunk = ids[start : start + size]
            if spec.chat_every and n % spec.chat_every == 0:
                prefix = _chat_prefix(tokenizer, rng.choice(ASKS))
                if prefix is not None:
                    head = tokenizer(prefix, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
                    chunk = (head + ids[start:])[:size]
            if len(chunk) == size:
                yield chunk
