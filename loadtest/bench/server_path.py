"""``specserve bench --server-path``: one streaming client through ``specserve serve`` against the
same engine in-process.

The in-process side is the benchmark's ``specserve-plain`` / ``specserve-auto`` methods. The server
side is ``specserve serve`` started here with the same settings (its own local Ray cluster, one
replica, the benchmark's thread count), and the official ``openai`` client streaming
``/v1/completions`` with the very token ids the in-process engine gets (chat prompts rendered by
the same template), greedy, ``max_tokens`` each, EOS ignored, speculation "off" or "auto" per
request. Runs interleave: every repeat takes each prompt through each mode in-process and then
through the server, so both see the same machine state. tok/s = tokens / request time (the
client's, first byte sent to last chunk received). Outputs must match token for token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from loadtest.bench.results import Method
from serve_app.config import OFF, Settings

AUTO = "auto"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``specserve serve`` with ``settings`` on a free port (a context manager)."""

    def __init__(self, settings: Settings, folder: Path, timeout_s: float = 900.0) -> None:
        self.port = _free_port()
        server = settings.server.model_copy(update={"port": self.port})
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "server-path-settings.yaml"
        config.write_text(
            yaml.safe_dump(settings.model_copy(update={"server": server}).model_dump(mode="json"))
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_") and k != "RAY_ADDRESS"}
        env.update(SPECSERVE_CONFIG=str(config), PYTHONUNBUFFERED="1")
        self.log = open(folder / "server-path.log", "wb")  # noqa: SIM115 (closed in close())
        command = [sys.executable, "-m", "specserve.cli", "serve"]
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._wait(timeout_s, folder)

    def _wait(self, timeout_s: float, folder: Path) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"specserve serve exited ({self.process.returncode}); see {folder}")
            try:
                with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.close()
        raise RuntimeError(f"specserve serve not healthy after {timeout_s:g} s; see {folder}")

    def close(self) -> None:
        for sig, wait in ((signal.SIGINT, 60.0), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break
            os.killpg(self.process.pid, sig) if sig == signal.SIGKILL else self.process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait)
        self.log.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def streamed(client: Any, model: str, ids: Sequence[int], n: int, mode: str) -> tuple[str, int, float]:
    """One streamed completion: (text, tokens the server counted, seconds to the last chunk)."""
    start = time.perf_counter()
    stream = client.completions.create(
        model=model, prompt=list(ids), max_tokens=n, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "speculation": {"mode": mode}},
    )  # fmt: skip
    text, tokens = [], 0
    for chunk in stream:
        text += [choice.text for choice in chunk.choices]
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens, time.perf_counter() - start


def measure_server_path(
    methods: dict[str, Method], settings: Settings, prompts: Sequence[Any], encoded: dict[Any, list[int]],
    n: int, repeats: int, folder: Path, decode: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per prompt and mode: median in-process and server tok/s, and whether the outputs match
    (the server's text against ``decode`` of the in-process tokens)."""
    from openai import OpenAI

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with LocalServer(settings, folder) as server:
        client = OpenAI(base_url=server.url, api_key=settings.server.api_key or "none", max_retries=0)
        model = client.models.list().data[0].id
        for prompt in prompts:  # warm-up: one short request per mode on both sides
            for mode, method in methods.items():
                method.run(encoded[prompt][:8])
                streamed(client, model, encoded[prompt][:8], 4, mode)
        for rep in range(repeats):
            for prompt in prompts:
                ids = encoded[prompt]
                for mode, method in methods.items():
                    ours = method.run(ids)
                    text, served, seconds = streamed(client, model, ids, n, mode)
                    row = rows.setdefault((prompt.name, mode), {"prompt": prompt.name, "kind": prompt.kind,
                                                                 "mode": mode, "inproc": [], "server": [],
                                                                 "identical": True})  # fmt: skip
                    row["inproc"].append(len(ours.token_ids) / ours.seconds)
                    row["server"].append(served / seconds)
                    row["identical"] &= served == len(ours.token_ids) and text == decode(list(ours.token_ids))
                    rates = f"in-process {row['inproc'][-1]:.2f}, server {row['server'][-1]:.2f} tok/s"
                    print(f"[server-path {rep + 1}/{repeats}] {prompt.name} {mode}: {rates}", file=sys.stderr)
    out = []
    for row in rows.values():
        inproc, served = statistics.median(row["inproc"]), statistics.median(row["server"])
        out.append({**row, "inproc": inproc, "server": served, "ratio": served / inproc})
    return out


def server_path_markdown(rows: list[dict[str, Any]], n: int, repeats: int) -> str:
    lines = ["### Through the server: one streaming client", "",
             f"Greedy, {n} new tokens (EOS ignored), tok/s = tokens / request time, median of {repeats}; "
             "the server streams `/v1/completions` to the `openai` client.", "",
             "| prompt | kind | mode | in-process tok/s | server tok/s | server / in-process | output |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        output = "identical" if r["identical"] else "DIFFERS"
        lines.append(f"| {r['prompt']} | {r['kind']} | {r['mode']} | {r['inproc']:.2f} | {r['server']:.2f} | "
                     f"{r['ratio']:.2f}x | {output} |")  # fmt: skip
    for mode in dict.fromkeys(r["mode"] for r in rows):
        ratios = [r["ratio"] for r in rows if r["mode"] == mode]
        lines.append(f"| **all** |  | {mode} |  |  | {statistics.median(ratios):.2f}x (median) |  |")
    return "\n".join([*lines, ""])


MODES = {OFF: "specserve-plain", AUTO: "specserve-auto"}
