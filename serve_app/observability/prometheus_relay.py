"""``GET /metrics`` on the API port: the cluster's engine metrics under their vLLM-shaped names.

The replicas record through Ray's metrics API (``observability.metrics``), and Ray exports each
node's series on that node's metrics port (``ray_specserve_*``, tagged with Ray's bookkeeping
labels: worker, node, session). A Prometheus that scrapes the pods (KubeRay's port 8080) sees
those. A user of vLLM expects ``/metrics`` beside the API instead, so the ingress relays:

1. the alive nodes' metrics endpoints, from Ray's node table (cached for ``NODES_TTL_S``);
2. every endpoint scraped concurrently (a node that does not answer is skipped and logged);
3. our families kept (``metric_names.METRICS``), renamed (``ray_specserve_x`` ->
   ``specserve:x``), their labels cut to the ones we declare (plus ``le``), equal series summed
   (the same replica's counter seen twice cannot happen; Ray's labels are the only difference
   dropped), and rendered as Prometheus text with each metric's help and type.

Ray reports a worker's metrics to its node every ``metrics_report_interval_ms`` (``specserve
serve`` sets ``telemetry.metrics_report_interval_ms``), so a scrape is that much behind the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from serve_app.observability.metric_names import METRICS, RAY_PREFIX, MetricSpec, from_ray_name, ray_name

log = logging.getLogger(__name__)

NODES_TTL_S = 10.0  # how long the node table is reused between scrapes
SCRAPE_TIMEOUT_S = 5.0
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)

_BY_RAY_FAMILY: dict[str, MetricSpec] = {"ray_" + ray_name(spec.name): spec for spec in METRICS}


def ray_node_endpoints() -> list[str]:
    """``http://host:port/metrics`` of every alive node's Ray metrics exporter (needs Ray)."""
    import ray

    return [
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in ray.nodes()
        if node.get("Alive") and node.get("MetricsExportPort")
    ]


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8", "replace")


def relay_samples(texts: Iterable[str]) -> dict[str, dict[SeriesKey, float]]:
    """Our samples of Ray expositions, renamed and summed: ``{metric name: {series: value}}``."""
    merged: dict[str, dict[SeriesKey, float]] = {}
    for text in texts:
        if RAY_PREFIX not in text:
            continue
        for family in text_string_to_metric_families(text):
            spec = _BY_RAY_FAMILY.get(family.name)
            if spec is None:
                continue
            keep = set(spec.tag_keys) | {"le"}
            series = merged.setdefault(spec.name, {})
            for sample in family.samples:
                name = from_ray_name(sample.name)
                if name is None:
                    continue
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k in keep))
                key = (name, labels)
                series[key] = series.get(key, 0.0) + sample.value
    return merged


def _histogram_order(key: SeriesKey) -> tuple[tuple[tuple[str, str], ...], bool, float, str]:
    """A histogram's series grouped by label set (``le`` aside): buckets by bound (+Inf last), then
    ``_count`` and ``_sum``."""
    name, labels = key
    rest = tuple(item for item in labels if item[0] != "le")
    bound = next((value for label, value in labels if label == "le"), None)
    return rest, not name.endswith("_bucket"), float(bound) if bound is not None else 0.0, name


class _Relayed:
    """A prometheus_client collector over one relayed snapshot."""

    def __init__(self, samples: dict[str, dict[SeriesKey, float]]) -> None:
        self.samples = samples

    def collect(self) -> Iterator[Metric]:
        for spec in METRICS:
            series = self.samples.get(spec.name)
            if not series:
                continue
            metric = Metric(spec.name, spec.description, spec.kind)
            keys = sorted(series, key=_histogram_order) if spec.kind == "histogram" else sorted(series)
            for name, labels in keys:
                metric.add_sample(name, dict(labels), series[(name, labels)])
            yield metric


def render(samples: dict[str, dict[SeriesKey, float]]) -> bytes:
    """Prometheus text exposition (version 0.0.4) of relayed samples."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Relayed(samples))
    return generate_latest(registry)


class PrometheusRelay:
    """What ``GET /metrics`` answers: every node's engine series, scraped when asked."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]] = ray_node_endpoints,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        nodes_ttl_s: float = NODES_TTL_S,
    ) -> None:
        self._endpoints = endpoints
        self.timeout_s = timeout_s
        self.nodes_ttl_s = nodes_ttl_s
        self._nodes: list[str] = []
        self._nodes_at = float("-inf")

    async def _node_urls(self) -> list[str]:
        if time.monotonic() - self._nodes_at > self.nodes_ttl_s:
            self._nodes = await asyncio.to_thread(self._endpoints)
            self._nodes_at = time.monotonic()
        return self._nodes

    async def _scrape(self, url: str) -> str:
        try:
            return await asyncio.to_thread(_fetch, url, self.timeout_s)
        except OSError as exc:
            log.warning("metrics: node exporter %s did not answer (%s); its series are left out", url, exc)
            self._nodes_at = float("-inf")  # the node may be gone: ask Ray again next time
            return ""

    async def scrape(self) -> bytes:
        """The exposition now (an empty one when no node answers)."""
        texts = await asyncio.gather(*(self._scrape(url) for url in await self._node_urls()))
        return render(relay_samples(texts))
