"""One local Ray cluster and Serve instance for the whole session (only tests that ask for it)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def serve_http() -> Iterator[str]:
    """Start Ray (a local cluster, never `ray start --head`: 6379 is Redis's) and Serve's HTTP
    proxy on a free port; yields the proxy's base URL and shuts both down at the end."""
    import ray
    from ray import serve

    port = free_port()
    # Autoscaling sees load within a second (Ray's default pushes the handles' and replicas' counts
    # every 10 s): the processes Ray starts inherit these (test_autoscaling_e2e).
    for name in ("HANDLE", "REPLICA"):
        os.environ.setdefault(f"RAY_SERVE_{name}_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    # Metrics reach a node's exporter (and GET /metrics) within a second, as `specserve serve` sets it.
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
