"""``GET /metrics``: Prometheus text beside the API, as vLLM serves it (no API key, like ``/health``).

The HTTP layer only serves bytes it is given: the ingress passes
``observability.prometheus_relay.PrometheusRelay.scrape`` (the cluster's engine series).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Response

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def add_metrics_route(app: FastAPI, scrape: Callable[[], Awaitable[bytes]]) -> None:
    """Serve ``scrape()``'s exposition at ``GET /metrics``."""

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(await scrape(), media_type=PROMETHEUS_TEXT)
