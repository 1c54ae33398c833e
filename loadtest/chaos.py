"""Faults injected into a load-test cell (``specserve loadtest --chaos KIND``), and what they cost.

A cell with chaos runs as any other; at ``--chaos-at`` (a fraction of ``--run-time``) after its
load starts, a background thread injects one fault and then watches for the recovery:

- ``kill-replica``: ``ray.kill`` of one engine replica actor (no restart by Ray: Serve's controller
  notices and starts a replacement). Recovered once Serve, having counted a replica fewer, runs as
  many as before again (the victim's actor name leaves Ray's list at once, which proves nothing).
  Run it with ``--min-replicas 2`` so the survivor serves meanwhile.
- ``restart-redis``: the cell's shared statistics point at a ``redis-server`` of the runner's own
  (``loadtest.redis_process``, a free port, never the shared 6379); it is killed, stays down for
  ``--chaos-outage-s``, and restarts empty. Recovered when the replicas' statistics are in the new
  Redis again (a key under the settings' ``stats.key_prefix``).

:func:`chaos_figures` then reads the cell's request records against the fault's time: requests in
flight at the fault and those of them that failed, requests started after it that failed, and
failures that were not clean (a cut stream, half a JSON event, a connection reset: anything but an
error event or an HTTP error in OpenAI's shape).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.cluster import ENGINE_DEPLOYMENT, LocalCluster
from loadtest.redis_process import RedisServer
from loadtest.streaming import RequestRecord

KILL_REPLICA = "kill-replica"
RESTART_REDIS = "restart-redis"
CHAOS_KINDS = (KILL_REPLICA, RESTART_REDIS)
CLEAN_ERRORS = ("stream error:", "HTTP ")  # how loadtest.streaming records a failure the server reported


@dataclass
class ChaosEvent:
    """One injected fault: what, when (``time.time()``), and when the service was whole again."""

    kind: str
    at: float = 0.0
    detail: str = ""
    recovered_at: float | None = None  # None: not seen recovered before the cell ended
    error: str | None = None  # the fault could not be injected

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def engine_replica_actors(app_name: str) -> list[str]:
    """Names of ``app_name``'s engine replica actors (Serve's namespace), oldest first as Ray lists them."""
    import ray

    return [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and f"{app_name}#{ENGINE_DEPLOYMENT}#" in actor["name"]
    ]


def kill_replica(app_name: str) -> str:
    """Kill one engine replica of ``app_name`` (no restart by Ray); the victim's actor name."""
    import ray

    actors = engine_replica_actors(app_name)
    if not actors:
        raise RuntimeError(f"no engine replica of application {app_name!r} to kill")
    ray.kill(ray.get_actor(actors[0], namespace="serve"), no_restart=True)
    return actors[0]


def redis_has_stats(url: str, key_prefix: str) -> bool:
    """Whether the Redis at ``url`` holds any key under ``key_prefix`` (False while it is down)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return next(iter(client.scan_iter(match=f"{key_prefix}:*", count=100)), None) is not None
    except redis.RedisError:
        return False
    finally:
        client.close()


class ChaosInjector:
    """Injects ``inject`` once, ``delay_s`` after ``start()``, then polls ``recovered`` every
    ``poll_s`` until it holds or ``stop()``; the outcome is :attr:`event` (a context manager)."""

    def __init__(
        self,
        kind: str,
        delay_s: float,
        inject: Callable[[], str],
        recovered: Callable[[], bool],
        poll_s: float = 0.25,
    ) -> None:
        self.event = ChaosEvent(kind)
        self.delay_s = delay_s
        self._inject = inject
        self._recovered = recovered
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"chaos-{kind}", daemon=True)

    def __enter__(self) -> ChaosInjector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        if self._stop.wait(self.delay_s):
            self.event.error = "the cell ended before the fault was due"
            return
        self.event.at = time.time()
        try:
            self.event.detail = self._inject()
        except Exception as exc:  # reported in the cell, not raised into the runner
            self.event.error = f"{type(exc).__name__}: {exc}"
            return
        while not self._stop.is_set():
            if self._recovered():
                self.event.recovered_at = time.time()
                return
            self._stop.wait(self._poll_s)


def injector_for(
    kind: str,
    delay_s: float,
    app_name: str,
    redis_server: RedisServer | None = None,
    key_prefix: str = "",
    outage_s: float = 5.0,
) -> ChaosInjector:
    """The injector of one fault of ``kind`` (``CHAOS_KINDS``) on the cell's application."""
    if kind == KILL_REPLICA:
        before: dict[str, Any] = {}

        def inject() -> str:
            before["replicas"] = LocalCluster.running_replicas(app_name)
            before["victim"] = kill_replica(app_name)
            return f"killed {before['victim']} (one of {before['replicas']} running)"

        def recovered() -> bool:
            # The victim's name leaves Ray's list at once, but Serve reports it RUNNING until its
            # controller notices: whole again only once the count was seen to drop and came back.
            running = LocalCluster.running_replicas(app_name)
            before["dropped"] = before.get("dropped", False) or running < before["replicas"]
            return before["dropped"] and running >= before["replicas"]

        return ChaosInjector(kind, delay_s, inject, recovered, poll_s=0.5)
    if kind == RESTART_REDIS:
        if redis_server is None:
            raise ValueError("restart-redis needs the cell's own redis-server")
        server = redis_server

        def restart() -> str:
            server.kill()
            time.sleep(outage_s)
            server.start()
            return f"redis-server on port {server.port} killed, restarted empty {outage_s:g} s later"

        return ChaosInjector(kind, delay_s, restart, lambda: redis_has_stats(server.url, key_prefix))
    raise ValueError(f"unknown chaos {kind!r}; known: {', '.join(CHAOS_KINDS)}")


def clean_failure(record: RequestRecord) -> bool:
    """Whether a failed request ended the way the API promises: an error event or an HTTP error."""
    return record.error is not None and record.error.startswith(CLEAN_ERRORS)


def chaos_figures(event: ChaosEvent, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The fault and what it cost, from the cell's request records (times relative to the first one)."""
    figures: dict[str, Any] = event.to_dict()
    if not records or event.error is not None:
        return figures
    first = min(r.start for r in records)
    in_flight = [r for r in records if r.start <= event.at < r.end]
    after = [r for r in records if r.start > event.at]
    failed = [r for r in records if not r.ok]
    figures.update(
        at_s=event.at - first,
        recovered_after_s=None if event.recovered_at is None else event.recovered_at - event.at,
        in_flight=len(in_flight),
        failed_in_flight=sum(1 for r in in_flight if not r.ok),
        started_after=len(after),
        failed_after=sum(1 for r in after if not r.ok),
        unclean_failures=sum(1 for r in failed if not clean_failure(r)),
        errors=sorted({r.error for r in failed if r.error})[:5],
    )
    return figures


def chaos_survived(figures: dict[str, Any]) -> bool:
    """Whether a chaos cell ended as promised: the fault came, the service was whole again, and every
    failure was clean (the failures themselves are the fault's expected cost, not the cell's error)."""
    return (
        figures.get("error") is None
        and figures.get("recovered_after_s") is not None
        and figures.get("unclean_failures") == 0
    )
