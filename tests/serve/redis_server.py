"""A throwaway ``redis-server`` of a test's own, for tests that hang, kill and restart Redis (the
shared one on 6379 is never touched): the statistics' outage test
(``tests/serve/observability/test_shared_stats_redis.py``) and the end-to-end one
(``tests/serve/test_redis_outage_e2e.py``). The server itself is ``loadtest.redis_process``'s
(the load test's chaos cell uses it too).

``own_redis_server()`` starts one on a free port and kills it at the end; without a
``redis-server`` binary the test skips, and fails under CI (``unavailable``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from loadtest.cluster import free_port
from loadtest.redis_process import RedisServer, started_redis_server, wait_for

__all__ = ["RedisServer", "free_port", "own_redis_server", "unavailable", "wait_for"]


def unavailable(message: str) -> None:
    """Skip the test, or fail it under CI (where Redis and ``redis-server`` must be there)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def own_redis_server() -> Iterator[RedisServer]:
    """A started ``RedisServer`` on a free port, killed on exit."""
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not on PATH (needed to kill and restart a Redis of the test's own)")
    with started_redis_server() as server:
        yield server
