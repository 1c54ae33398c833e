"""Where a replica gets its cost model: the cluster's (Redis), this machine's (the store's disk),
or a fresh profile, which it then shares with both.

Profiling the 1.5B pair takes minutes on a small CPU (~8 of the ~8.5 before a replica is ready on
a 2-core AVX2 EPYC), so a restart on the same machine should not repeat it: the disk copy lives
under ``<store.cache_dir>/cost-models/``, one JSON file per (hardware, model pair). Hardware is the
CPU's name and a digest of its flags (two EPYCs of one name may differ in AVX-512), the threads,
the dtype and the weight format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies import FittedCostModel
    from serve_app.engine.engine import SpecEngine
    from serve_app.observability.shared_stats import SharedStats

log = logging.getLogger("specserve.cost_model")


def hardware_key(engine: SpecEngine, threads: int) -> str:
    """What a cost model was measured on: CPU name and flags, threads, dtype, weight format."""
    from serve_app.native_build import cpu_flags

    model = engine.model
    flags = hashlib.sha1(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return f"{platform.machine()}-{_cpu_name()}-{flags}-{threads}t-{model.dtype}-{model.weight_format}"


def disk_path(cache_dir: Path, hardware: str, pair: str) -> Path:
    digest = hashlib.sha1(f"{hardware}|{pair}".encode()).hexdigest()[:20]
    return Path(cache_dir) / "cost-models" / f"{digest}.json"


def share_cost_model(
    engine: SpecEngine, stats: SharedStats, pair: str, threads: int, cache_dir: Path | None = None
) -> str:
    """Give ``engine`` a cost model for this hardware and model pair: the cluster's, else this
    machine's (``cache_dir``), else a fresh profile; share what it uses where it was missing.
    Returns where it came from: "cluster", "disk" or "profiled"."""
    from serve_app.engine.proposers.base import ModelDrafter

    hardware = hardware_key(engine, threads)
    # A cached model that lacks one of this engine's model-based proposers (e.g. shared by a replica
    # of the same pair without self-speculation) would price its draft steps at 0: not usable.
    drafters = {n for n, p in engine.proposers.items() if isinstance(p, ModelDrafter)}

    def usable(data: dict[str, Any] | None) -> FittedCostModel | None:
        cost = _readable(data)
        return cost if cost is not None and drafters <= set(cost.draft) else None

    path = disk_path(cache_dir, hardware, pair) if cache_dir is not None else None
    if (cost := usable(stats.get_cost_model(hardware, pair))) is not None:
        engine.use_cost_model(cost)
        return "cluster"
    if path is not None and (cost := usable(_read_json(path))) is not None:
        engine.use_cost_model(cost)
        stats.put_cost_model(hardware, pair, cost.to_dict())
        log.info("cost model from %s", path)
        return "disk"
    started = time.perf_counter()
    cost = engine.profile_cost_model()
    log.info("profiled the cost model in %.1f s", time.perf_counter() - started)
    stats.put_cost_model(hardware, pair, cost.to_dict())
    if path is not None:
        _write_json(path, cost.to_dict())
    return "profiled"


def _readable(data: dict[str, Any] | None) -> FittedCostModel | None:
    """A cached cost model, or None when there is none or it is of another version."""
    from policies import FittedCostModel

    if not data:
        return None
    try:
        return FittedCostModel.from_dict(data)
    except (ValueError, KeyError, TypeError):
        log.info("a cached cost model is unreadable (another version?); not used")
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (temp file + rename); a failure only loses the cache, never the replica."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not keep the cost model at %s: %s", path, exc)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip().replace(" ", "_")
    except OSError:
        pass
    return platform.processor() or "cpu"
