"""What one engine replica holds, read from outside to find leaks (a debug / test view).

A request that leaks leaves something behind: a KV slot never freed, an entry in the engine's
index of live requests, a stream the loop thread still serves, a thread, memory. Two parts say
what is held now (``EngineDeployment.stats`` returns both; ``specserve soak`` compares them before
and after thousands of requests, and ``loadtest.soak.judge`` decides what counts as a leak):

- :class:`EngineLoad`: the engine's queues and holdings. The engine's state belongs to its loop
  thread (``AsyncEngine``), so that thread builds a new, immutable ``EngineLoad`` after every step
  (and on idle wake-ups) and publishes it by swapping one reference; any other thread reads the last
  one whole, never a mix of before and after a step.
- :func:`process_state`: the replica process's resident memory, threads and file descriptors, read
  from ``/proc/self`` (Linux; elsewhere those fields are None).
"""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_app.engine.engine import SpecEngine


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queues and KV slots as of one moment of its loop thread (a snapshot)."""

    running: int = 0  # requests holding a KV slot
    waiting: int = 0  # requests queued for one
    free_slots: int = 0  # free slots of the target's KV cache
    slots: int = 0  # all slots of that cache
    requests: int = 0  # the engine's index of live requests: running + waiting unless one leaked
    # Free slots of the proposers with a KV cache of their own (a draft model), by proposer name.
    proposer_free_slots: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, engine: SpecEngine) -> EngineLoad:
        """Read ``engine`` now; call it on the thread that runs the engine."""
        scheduler, cache = engine.scheduler, engine.cache
        own_caches = (
            (name, proposer.cache.num_free)
            for name, proposer in sorted(engine.proposers.items())
            # Self-speculation drafts in the target's own cache: counted once, as the target's.
            if getattr(proposer, "cache", None) is not None and proposer.cache is not cache
        )
        return cls(
            running=scheduler.num_running,
            waiting=scheduler.num_waiting,
            free_slots=cache.num_free,
            slots=cache.num_slots,
            # Private on purpose (nothing else needs it); a debug view may look, and it is where a
            # request that finished without being released would stay.
            requests=len(engine._requests),
            proposer_free_slots=tuple(own_caches),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a stats view (``proposer_free_slots`` as a name -> count mapping)."""
        data = asdict(self)
        data["proposer_free_slots"] = dict(self.proposer_free_slots)
        return data


def _proc_status() -> dict[str, str]:
    """``/proc/self/status`` as key -> value text (empty where there is no procfs)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in fields}


def _kib(value: str | None) -> int | None:
    """Bytes of a ``/proc`` size such as ``"123456 kB"`` (None if absent)."""
    return int(value.split()[0]) * 1024 if value else None


def process_state(count_objects: bool = True) -> dict[str, Any]:
    """This process's resources now: what grows when something leaks.

    - ``rss_bytes`` / ``peak_rss_bytes``: resident memory now and at its highest (VmRSS, VmHWM);
    - ``threads``: Python threads (``threading.active_count()``); ``os_threads``: every thread of
      the process (Ray's, OpenMP's, gRPC's too);
    - ``open_fds``: open file descriptors (sockets included);
    - ``gc_objects``: objects the garbage collector tracks (containers), counted after a full
      collection so that garbage waiting for the collector does not count: a leak of Python
      objects shows here long before it shows in the RSS. Collecting and counting walk the heap
      (a fraction of a second in a replica), hence ``count_objects=False`` to skip it (then None).
      A Serve replica freezes what its start-up made (Ray Serve's ``gc.freeze()``), and frozen
      objects are not counted: there the count is what was made since and is still alive.
    """
    status = _proc_status()
    try:
        open_fds: int | None = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_fds = None
    return {
        "pid": os.getpid(),
        "rss_bytes": _kib(status.get("VmRSS")),
        "peak_rss_bytes": _kib(status.get("VmHWM")),
        "threads": threading.active_count(),
        "os_threads": int(status["Threads"]) if "Threads" in status else None,
        "open_fds": open_fds,
        "gc_objects": _tracked_objects() if count_objects else None,
    }


def _tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())
