"""The local Ray cluster the load matrix runs on, and what the runner reads from it.

One cluster serves the whole matrix (started here with ``ray.init(address="local", ...)``, never
``ray start --head``: port 6379 is Redis's); each cell's ``specserve serve`` joins it through
``RAY_ADDRESS`` and deploys a fresh application, which it deletes when it stops. The runner reads:

- the server's own counters from Ray's Prometheus endpoint (``metrics_export_port``; the engine's
  ``ray.util.metrics`` series, e.g. ``ray_specserve_generation_tokens_total``), with a short
  metrics report interval so a snapshot is at most about a second old;
- replica-seconds: a background sampler counts the engine deployment's RUNNING replicas
  (``serve.status()``) every ``interval_s`` and integrates over a time window.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from collections.abc import Mapping
from types import TracebackType

from loadtest.analysis import GENERATION_TOKENS
from loadtest.timeline import SpeculationTimeline

ENGINE_DEPLOYMENT = "EngineDeployment"  # serve_app.app.ENGINE_DEPLOYMENT (not imported: no Ray at import)
METRICS_REPORT_INTERVAL_MS = 1000

# One Prometheus sample: name, optional {labels}, value (timestamps are not used by Ray's exporter).
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\d+)?$")

Series = tuple[str, str]  # (metric name, label string): one time series


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_prometheus(text: str, prefix: str = "ray_specserve_") -> dict[Series, float]:
    """The samples of a Prometheus text exposition whose names start with ``prefix``."""
    samples: dict[Series, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            samples[(match.group(1), match.group(2) or "")] = float(match.group(3))
        except ValueError:
            continue
    return samples


def counter_delta(before: Mapping[Series, float], after: Mapping[Series, float], name: str) -> float:
    """How much counter ``name`` grew, summed over its series (each replica process has its own).

    Series are compared one by one: a series that disappeared (a replica of an earlier cell that is
    gone) is ignored, a new one counts from 0.
    """
    return sum(value - before.get(key, 0.0) for key, value in after.items() if key[0] == name)


class LocalCluster:
    """A local Ray cluster with a known Prometheus port (a context manager)."""

    def __init__(self, num_cpus: int) -> None:
        self.num_cpus = num_cpus
        self.metrics_port = free_port()
        self.address = ""

    def __enter__(self) -> LocalCluster:
        import os

        import ray

        # Serve's handles and replicas push their load figures every 10 s by default: a scaling
        # decision would lag a cell of a few minutes by that much (the processes Ray starts inherit it).
        for name in ("HANDLE", "REPLICA"):
            os.environ.setdefault(f"RAY_SERVE_{name}_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
        ray.init(
            address="local",
            num_cpus=self.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            _metrics_export_port=self.metrics_port,
            _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
        )
        self.address = ray.get_runtime_context().gcs_address
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        import ray

        ray.shutdown()

    def scrape(self) -> dict[Series, float]:
        """The engine's metrics as Ray's exporter shows them now (empty if it does not answer)."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                return parse_prometheus(response.read().decode("utf-8", "replace"))
        except OSError:
            return {}

    def settled_scrape(self, name: str, timeout_s: float = 20.0) -> dict[Series, float]:
        """A scrape taken once counter ``name`` stopped moving for two report intervals."""
        interval = 2 * METRICS_REPORT_INTERVAL_MS / 1000 + 0.2
        deadline = time.monotonic() + timeout_s
        last = self.scrape()
        while time.monotonic() < deadline:
            time.sleep(interval)
            now = self.scrape()
            if now and counter_delta(last, now, name) == 0:
                return now
            last = now
        return last

    @staticmethod
    def running_replicas(app_name: str) -> int:
        """RUNNING replicas of the engine deployment of ``app_name`` (0 if it is not deployed)."""
        from ray import serve
        from ray.serve import context

        try:
            status = serve.status()
        except Exception:  # a handle to an earlier cell's controller, cached by Serve: find the new one
            context._disconnect()
            try:
                status = serve.status()
            except Exception:
                return 0
        app = status.applications.get(app_name)
        if app is None or ENGINE_DEPLOYMENT not in app.deployments:
            return 0
        states = app.deployments[ENGINE_DEPLOYMENT].replica_states
        return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


class ReplicaSampler:
    """Samples, every ``interval_s`` in a background thread, the replica count (for replica-seconds)
    and, given a cluster, the server's generated-token counter (for tokens/s during the load phase,
    whatever the drain after it does) and the speculation counters the report plots over time
    (:attr:`timeline`)."""

    def __init__(self, app_name: str, cluster: LocalCluster | None = None, interval_s: float = 1.0) -> None:
        self.app_name = app_name
        self.cluster = cluster
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (time.time(), running replicas)
        self.tokens: list[tuple[float, float]] = []  # (time.time(), generated tokens since the start)
        self.timeline = SpeculationTimeline()
        self._baseline: dict[Series, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-sampler", daemon=True)

    def __enter__(self) -> ReplicaSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            replicas = LocalCluster.running_replicas(self.app_name)
            self.samples.append((time.time(), replicas))
            if self.cluster is not None:
                scrape = self.cluster.scrape()
                if scrape:
                    if self._baseline is None:
                        self._baseline = scrape
                    delta = counter_delta(self._baseline, scrape, GENERATION_TOKENS)
                    now = time.time()
                    self.tokens.append((now, delta))
                    self.timeline.observe(now, scrape, replicas)
            self._stop.wait(self.interval_s)

    def replica_seconds(self, start: float, end: float) -> float:
        """Integral of the replica count over [start, end] (each sample holds until the next)."""
        return integrate_samples(self.samples, start, end)

    def tokens_per_s(self, start: float, end: float) -> float | None:
        """Generated tokens per second between the samples nearest ``start`` and ``end`` (None: too few)."""
        inside = [(t, n) for t, n in self.tokens if start - self.interval_s <= t <= end + self.interval_s]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        first = min(inside, key=lambda s: abs(s[0] - start))
        last = min(inside, key=lambda s: abs(s[0] - end))
        return (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else None


def integrate_samples(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Integral of a piecewise-constant count over [start, end]; before the first sample, the first holds."""
    if end <= start or not samples:
        return 0.0
    total = 0.0
    points = sorted(samples)
    for i, (t, count) in enumerate(points):
        seg_start = start if i == 0 else max(t, start)
        seg_end = points[i + 1][0] if i + 1 < len(points) else end
        seg_end = min(seg_end, end)
        if seg_end > seg_start:
            total += count * (seg_end - seg_start)
    return total
