"""The peer of ``specserve bench --sweep``: llama.cpp's own server (continuous batching, one slot per
concurrent request) on the very GGUF our pack was converted from, with the benchmark's threads.

``llama-server`` is not part of ``llama-cpp-python``'s wheel: build it from the llama.cpp that its
sdist vendors (BENCHMARKS.md gives the commands) and point ``LLAMA_SERVER`` at the binary (or put
it on ``PATH``); where there is none the peer is skipped with a message. Each concurrency starts
a server with that many slots (``-np c``, ``c`` times the per-request context), sends the sweep's
prompts (the same token ids our engine gets; the GGUF has the same vocabulary) at once, greedy, EOS
ignored, and counts every generated token over the wall time, as the sweep counts ours.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NAME = "llama.cpp-server"
ENV = "LLAMA_SERVER"


def server_binary() -> Path | None:
    """``$LLAMA_SERVER`` or ``llama-server`` on PATH; None (with a message) where there is neither."""
    found = os.environ.get(ENV) or shutil.which("llama-server")
    if found and Path(found).is_file():
        return Path(found)
    print(f"[bench] skipping {NAME}: no llama-server ({ENV} or PATH)", file=sys.stderr)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LlamaServer:
    """One llama-server process with ``slots`` slots, stopped on ``close`` (a context manager)."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context: int, threads: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * context),
                "--cont-batching", "--no-warmup"]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.process.returncode}): {self.process.stderr.read()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.close()
        raise RuntimeError(f"llama-server did not become ready within {timeout:.0f} s")

    def complete(self, ids: Sequence[int], n: int) -> int:
        """Greedy completion of ``n`` tokens (EOS ignored); returns the tokens generated."""
        body = {"prompt": list(ids), "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "stream": False}  # fmt: skip
        return int(_post(f"{self.url}/completion", body, timeout=600)["tokens_predicted"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_server_sweep(
    binary: Path, gguf: Path, prompts: Sequence[Sequence[int]], concurrencies: Sequence[int], n: int,
    repeats: int, threads: int, context: int,
) -> dict[int, list[tuple[int, float]]]:  # fmt: skip
    """Per concurrency c: (tokens, seconds) of each timed batch of c requests sent at once (after
    one short warm-up batch), one server with c slots per concurrency."""
    results: dict[int, list[tuple[int, float]]] = {}
    for c in concurrencies:
        batch = [list(prompts[i % len(prompts)]) for i in range(c)]
        with LlamaServer(binary, gguf, c, context, threads) as server, ThreadPoolExecutor(c) as pool:
            runs = []
            for rep in range(repeats + 1):
                tokens = min(n, 16) if rep == 0 else n
                start = time.perf_counter()
                generated = sum(pool.map(lambda ids, k=tokens: server.complete(ids, k), batch))
                seconds = time.perf_counter() - start
                if rep:
                    runs.append((generated, seconds))
                    print(f"[sweep c={c}] {NAME} repeat {rep}/{repeats}: {generated / seconds:.2f} tok/s",
                          file=sys.stderr)  # fmt: skip
            results[c] = runs
    return results


def peer_sweep(
    store: object, pack: str, prompts: Sequence[Sequence[int]], concurrencies: Sequence[int], n: int,
    repeats: int, threads: int,
) -> dict[int, list[tuple[int, float]]]:  # fmt: skip
    """``measure_server_sweep`` on ``pack``'s GGUF, or {} (with a message) where there is no server
    binary or ``pack`` is not a model pack."""
    binary = server_binary()
    if binary is None:
        return {}
    if pack not in store.packs:
        print(f"[bench] skipping {NAME}: {pack} is not a model pack (no GGUF)", file=sys.stderr)
        return {}
    context = max(len(p) for p in prompts) + n + 16
    return measure_server_sweep(
        binary, store.gguf(pack), prompts, concurrencies, n, repeats, threads, context
    )
