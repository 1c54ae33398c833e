"""A throwaway ``redis-server`` of a test's own, for tests that hang, kill and restart Redis (the
shared one on 6379 is never touched): the statistics' outage test
(``tests/serve/observability/test_shared_stats_redis.py``) and the end-to-end one
(``tests/serve/test_redis_outage_e2e.py``).

``own_redis_server()`` starts one on a free port and kills it at the end; without a
``redis-server`` binary the test skips, and fails under CI (``unavailable``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis


def unavailable(message: str) -> None:
    """Skip the test, or fail it under CI (where Redis and ``redis-server`` must be there)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def wait_for(condition: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Poll ``condition`` until it is truthy or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A throwaway ``redis-server`` (nothing on disk) that can be hung, killed and restarted."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start a new, empty server on ``port`` and wait until it answers."""
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            ["redis-server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            if not wait_for(lambda: self._ping(client), timeout=10.0, interval=0.02):
                raise RuntimeError(f"redis-server did not start on port {self.port}")
        finally:
            client.close()

    @staticmethod
    def _ping(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def hang(self) -> None:
        """SIGSTOP: the kernel still accepts connections and takes commands, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL (a stopped server too): connections are refused until ``start``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def own_redis_server() -> Iterator[RedisServer]:
    """A started ``RedisServer`` on a free port, killed on exit."""
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not on PATH (needed to kill and restart a Redis of the test's own)")
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()
