"""A throwaway ``redis-server`` (its own port, nothing on disk) that can be hung, killed and
restarted: the load test's ``--chaos restart-redis`` cell and the tests that take Redis away
(``tests/serve/redis_server.py``). The shared Redis on 6379 is never touched.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from loadtest.cluster import free_port


def wait_for(condition: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Poll ``condition`` until it is truthy or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


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
def started_redis_server() -> Iterator[RedisServer]:
    """A started ``RedisServer`` on a free port, killed on exit."""
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()
