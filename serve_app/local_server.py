"""``specserve serve``: the Ray Serve application on a local Ray cluster, until Ctrl-C.

Starts (or joins, through ``RAY_ADDRESS``) a local cluster, never ``ray start --head``: port 6379
is Redis's on our machines. Fetches the models first, where their progress shows, deploys
``serve_app.app.build_app`` and prints the URL once the engine replica answers ``/health``; then,
while it serves, a line each time the engine deployment's replicas change (what ``serve status``
shows where the cluster has a dashboard; ours starts without one).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from serve_app.builder import model_store, models_needed, served_model_name
from serve_app.config import Settings

WATCH_INTERVAL_S = 2.0  # how often the serving loop reads serve.status() for replica changes


def _http_status(url: str) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _metrics_options(settings: Settings, address: str) -> dict[str, object]:
    """``ray.init`` options of a cluster we start: Ray's exporter on ``telemetry.metrics_export_port``
    (a taken port: any free one; ``GET /metrics`` finds it either way) and the report interval."""
    if address != "local":
        return {}  # joining a cluster: its own settings stand
    telemetry = settings.telemetry
    options: dict[str, object] = {
        "_system_config": {"metrics_report_interval_ms": telemetry.metrics_report_interval_ms}
    }
    port = telemetry.metrics_export_port
    if port and _port_free(port):
        options["_metrics_export_port"] = port
    elif port:
        print(f"[specserve] port {port} is taken; Ray's metrics exporter takes a free one", file=sys.stderr)
    return options


def engine_replicas_line(status: Any, app_name: str, deployment: str) -> str | None:
    """``deployment``'s state and replica counts in ``status`` (``serve.status()``), e.g.
    ``UPSCALING: 1 running, 1 starting``; None while the application has no such deployment."""
    app = status.applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return None
    overview = app.deployments[deployment]
    states = overview.replica_states.items()
    counts = sorted((str(getattr(state, "value", state)).lower(), n) for state, n in states)
    replicas = ", ".join(f"{n} {state}" for state, n in counts if n) or "no replicas"
    return f"{getattr(overview.status, 'value', overview.status)}: {replicas}"


def serve_locally(settings: Settings) -> int:
    """Serve the OpenAI-compatible API on a local Ray cluster until Ctrl-C, SIGINT or SIGTERM."""
    import os
    import signal

    # Fetch the packs here, where their progress shows; the replicas then find them in the store.
    store = model_store(settings)
    for ref in models_needed(settings):
        print(f"[specserve] model {ref}: {store.resolve(ref)}", flush=True)

    import ray
    from ray import serve

    from serve_app.app import APP_NAME, ENGINE_DEPLOYMENT, build_app

    started_ray = not ray.is_initialized()
    if started_ray:  # a local cluster (never `ray start --head`: port 6379 is Redis's here)
        address = os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False, **_metrics_options(settings, address))
    # SIGINT and SIGTERM both shut down cleanly, also where SIGINT was inherited as ignored
    # (a background job of a non-interactive shell) and after ray.init installed its SIGTERM exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        cpus = ray.cluster_resources().get("CPU", 0.0)
        needed = settings.autoscaling.replica_num_cpus * max(1, settings.autoscaling.min_replicas)
        if cpus < needed:
            print(
                f"[specserve] warning: the engine replicas need {needed:g} CPUs, the cluster has {cpus:g}; "
                "set SPECSERVE_AUTOSCALING__REPLICA_NUM_CPUS lower or they will never start",
                file=sys.stderr,
            )
        most = settings.autoscaling.replica_num_cpus * settings.autoscaling.max_replicas
        if needed <= cpus < most:
            print(
                f"[specserve] note: {settings.autoscaling.max_replicas} engine replicas would need {most:g} "
                f"CPUs, the cluster has {cpus:g}: autoscaling stops at "
                f"{int(cpus // settings.autoscaling.replica_num_cpus)}",
                file=sys.stderr,
            )
        host, port = settings.server.host, settings.server.port
        serve.start(http_options={"host": host, "port": port})
        app_name = APP_NAME
        serve.run_many(
            [serve.RunTarget(build_app(settings.model_dump(mode="json")), name=app_name, route_prefix="/")],
            wait_for_applications_running=False,
        )
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        url = f"http://{local}:{port}"
        print(f"[specserve] starting {app_name}: loading models into the engine replica(s) ...", flush=True)
        start = last = time.monotonic()
        while _http_status(f"{url}/health") != 200:
            status = serve.status().applications.get(app_name)
            if status is not None and str(status.status.value) == "DEPLOY_FAILED":
                print(f"[specserve] deployment failed: {status.message}", file=sys.stderr)
                return 1
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                state = str(status.status.value) if status is not None else "NOT_STARTED"
                details = "; ".join(
                    f"{name}: {d.status.value} {d.message}".strip()
                    for name, d in (status.deployments.items() if status is not None else ())
                )
                print(f"[specserve] {time.monotonic() - start:.0f}s: {state} {details}", flush=True)
            time.sleep(1)
        name = served_model_name(settings)
        key = settings.server.api_key
        auth = f" \\\n  -H 'Authorization: Bearer {key}'" if key else ""
        print(
            f"[specserve] ready after {time.monotonic() - start:.0f}s: {url}  (model {name!r}; "
            f"OpenAI base URL {url}/v1; Prometheus metrics {url}/metrics)\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"""  -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], """
            f""""max_tokens": 64}}'\n"""
            "[specserve] Ctrl-C to stop",
            flush=True,
        )
        shown = None
        while True:  # say when Serve adds or removes engine replicas (autoscaling, a replacement)
            try:
                line = engine_replicas_line(serve.status(), app_name, ENGINE_DEPLOYMENT)
            except Exception:  # the controller busy or restarting: a log line must not stop serving
                line = None
            if line != shown and line is not None:
                print(f"[specserve] {time.strftime('%H:%M:%S')} engine replicas {line}", flush=True)
                shown = line
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        print("\n[specserve] shutting down", flush=True)
        return 0
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
