"""One matrix cell's server: ``specserve serve`` as a subprocess, started fresh, warmed up, stopped.

The cell's settings are written to a YAML file (the whole ``Settings``, so the results folder says
exactly what ran) and passed through ``SPECSERVE_CONFIG``; other ``SPECSERVE_*`` variables of the
runner's environment are not passed on (they would take precedence over the file). The server
joins the matrix's Ray cluster through ``RAY_ADDRESS``. Stopping sends SIGINT (``specserve serve``
then deletes its application and disconnects), SIGTERM after a grace period, SIGKILL last.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import requests
import yaml


class ServerError(RuntimeError):
    """The server did not come up (its log says why)."""


class ServerProcess:
    """``specserve serve`` for one cell (a context manager: started on enter, stopped on exit)."""

    def __init__(
        self, settings: dict[str, Any], folder: Path, ray_address: str, start_timeout_s: float = 900.0
    ) -> None:
        self.settings = settings
        self.port = int(settings["server"]["port"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder = folder
        self.ray_address = ray_address
        self.start_timeout_s = start_timeout_s
        self.config_path = folder / "settings.yaml"
        self.log_path = folder / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers 200 (ServerError if it exits first)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.settings, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
        env.update(SPECSERVE_CONFIG=str(self.config_path), RAY_ADDRESS=self.ray_address, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve"],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the terminal's Ctrl-C reaches the runner, which stops us in order
        )
        while time.monotonic() - started < self.start_timeout_s:
            if self.process.poll() is not None:
                raise ServerError(
                    f"specserve serve exited with {self.process.returncode}; see {self.log_path}"
                )
            if self.healthy():
                self.startup_s = time.monotonic() - started
                return
            time.sleep(1.0)
        raise ServerError(
            f"specserve serve not healthy after {self.start_timeout_s:g} s; see {self.log_path}"
        )

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def model(self) -> str:
        response = requests.get(f"{self.url}/v1/models", timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def warm_up(self, bodies: list[dict[str, Any]]) -> None:
        """Send each body once (not streamed), so compilation, allocation and first-use costs are paid
        before the measurement; a failure here is a ServerError."""
        for body in bodies:
            body = {**body, "stream": False}
            body.pop("stream_options", None)
            response = requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=600)
            if response.status_code != 200:
                raise ServerError(
                    f"warm-up request failed: HTTP {response.status_code}: {response.text[:300]}"
                )

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL (to the server's process group); its exit status."""
        process, self.process = self.process, None
        if process is not None:
            for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
                if process.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig) if sig == signal.SIGKILL else process.send_signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(wait)
        if self._log is not None:
            self._log.close()
            self._log = None
        return process.returncode if process is not None else None
