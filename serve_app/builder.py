"""Settings -> a running engine: the one place that turns configuration into engine objects.

Everything that builds an engine goes through here: ``specserve generate``, a Ray Serve replica
(through :func:`build_async_engine`), the benchmarks and the calibration tools. Proposers come from
the registry: a replica loads ``speculation.loaded_proposers()``, each with its options section
and, when it drafts with a model, the model its ``model_role`` names in ``settings.model``.

A draft model left at its default that cannot serve the chosen target (another tokenizer, e.g.
the Qwen draft for a SmolLM2 target) is dropped with one warning, and the engine speculates with
the registry's fallback proposer (one that needs no model) instead. A draft model named explicitly
(flag, environment, YAML) that does not fit stays an error naming both models.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_app.config import OFF, Settings
from serve_app.engine.proposers.registry import fallback_proposer, proposer_spec
from serve_app.packs.store import ModelStore

if TYPE_CHECKING:
    from serve_app.async_engine import AsyncEngine
    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.engine_config import EngineConfig
    from serve_app.engine.planner import StatsSink

log = logging.getLogger(__name__)


def model_store(settings: Settings) -> ModelStore:
    """The model store of ``settings.store``."""
    return ModelStore(settings.store.cache_dir)


def served_model_name(settings: Settings) -> str:
    """What clients put in "model": the configured name, else the target (a folder: its name)."""
    if settings.server.served_model_name:
        return settings.server.served_model_name
    target = settings.model.target
    path = Path(target).expanduser()
    return path.name if path.is_dir() else target


def models_needed(settings: Settings) -> list[str]:
    """The model references a replica loads: the target, then each loaded proposer's model."""
    refs = [settings.model.target]
    for name in settings.speculation.loaded_proposers():
        role = proposer_spec(name).model_role
        ref = getattr(settings.model, role) if role else None
        if ref and ref not in refs:
            refs.append(ref)
    return refs


def model_pair(settings: Settings, method: str | None) -> str:
    """``target|model of the method`` ('-' without one): the key of the shared statistics."""
    role = proposer_spec(method).model_role if method else None
    second = getattr(settings.model, role) if role else None
    return f"{settings.model.target}|{second or '-'}"


def proposer_options(settings: Settings, store: ModelStore) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(options per proposer to load, the method requests with "auto" use; None = plain).

    Resolves (fetching, for a pack) the model of each proposer that drafts with one. A default
    model that cannot serve the target is dropped with a warning (see the module docstring).
    """
    spec = settings.speculation
    method: str | None = None if spec.method == OFF else spec.method
    options: dict[str, dict[str, Any]] = {}
    for name in spec.loaded_proposers():
        entry = proposer_spec(name)
        section = getattr(spec.proposers, name).model_dump()
        if entry.model_role is not None:
            ref = getattr(settings.model, entry.model_role, None)
            if not ref:
                if name == method:
                    raise ValueError(
                        f"speculation method {name!r} needs a model: set model.{entry.model_role}"
                    )
                continue
            explicit = entry.model_role in settings.model.model_fields_set
            problem = store.tokenizer_mismatch(settings.model.target, ref)
            if problem is not None:
                if explicit:
                    raise ValueError(problem)
                fallback = fallback_proposer()
                log.warning("%s; speculating with %r instead (name a model.%s to use one)",
                            problem, fallback, entry.model_role)  # fmt: skip
                method = fallback if name == method else method
                continue
            section |= {"model_path": str(store.resolve(ref)), "model_name": ref,
                        "target_name": settings.model.target}  # fmt: skip
        options[name] = section
    if method is not None and method not in options:  # the fallback, when it is not always loaded
        options[method] = getattr(spec.proposers, method).model_dump()
    return options, method


def engine_config(
    settings: Settings, options: dict[str, dict[str, Any]], method: str | None, max_slots: int | None = None
) -> EngineConfig:
    """The engine's configuration: cache sizes, speculation, the proposers' options, the policy."""
    from serve_app.engine.engine_config import EngineConfig

    spec = settings.speculation
    return EngineConfig(
        max_slots=max_slots or settings.cache.max_slots,
        max_seq_len=settings.cache.max_seq_len,
        spec_method=method,
        spec_depth=spec.depth,
        max_depth=spec.max_depth,
        tree_nodes=spec.tree_nodes,
        proposer_options=options,
        policy=spec.policy,
        policy_params=dict(spec.policy_params),
        sampling=spec.sampling,
        batch_invariant=settings.runtime.batch_invariant,
        weight_format=settings.runtime.weight_format,
    )


def build_engine(
    settings: Settings,
    *,
    max_slots: int | None = None,
    stats: StatsSink | None = None,
    store: ModelStore | None = None,
    **config_overrides: Any,
) -> SpecEngine:
    """A ``SpecEngine`` for ``settings``: models resolved through the store (packs fetched on first
    use), the proposers of the settings loaded. ``config_overrides`` replace ``EngineConfig``
    fields (e.g. a benchmark's ``max_seq_len``)."""
    from dataclasses import replace

    from serve_app.engine.engine import SpecEngine

    store = store or model_store(settings)
    path = store.resolve(settings.model.target)
    options, method = proposer_options(settings, store)
    config = replace(engine_config(settings, options, method, max_slots), **config_overrides)
    runtime = settings.runtime
    return SpecEngine.from_path(
        path, config, runtime.dtype, runtime.device, stats, model_pair(settings, method)
    )


def replica_threads(settings: Settings) -> int:
    """torch threads of a replica: ``runtime.threads``, else the CPUs it reserves (at least 1)."""
    return settings.runtime.threads or max(1, int(settings.autoscaling.replica_num_cpus))


def build_async_engine(settings: Settings, metrics_backend: str = "ray", tracer: Any = None) -> AsyncEngine:
    """A replica's engine: the models (packs fetched on first use), the shared statistics, the cost
    model (the cluster's, or profiled here and shared) when the policy reads one, and the loop
    thread that serves it (see ``serve_app.async_engine``)."""
    import os
    import socket

    from policies import policy_uses_cost_model
    from serve_app.async_engine import AsyncEngine
    from serve_app.cost_model_cache import share_cost_model
    from serve_app.engine.device import set_threads
    from serve_app.observability.metrics import EngineMetrics
    from serve_app.observability.shared_stats import EngineStatsSink, SharedStats

    threads = replica_threads(settings)
    replica = f"{socket.gethostname()}-{os.getpid()}"  # the replica in Redis and in metric labels
    stats = SharedStats(settings.stats, replica_id=replica)
    stats.start()

    def build() -> SpecEngine:  # on the engine's loop thread: all of a replica's torch work there
        set_threads(threads)
        engine = build_engine(settings, stats=EngineStatsSink(stats))
        if settings.speculation.profile_cost_model and policy_uses_cost_model(settings.speculation.policy):
            pair = model_pair(settings, engine.config.spec_method)
            share_cost_model(engine, stats, pair, threads, settings.store.cache_dir)
        # Warm start: the first step plans from the cluster's acceptance (read while the models
        # loaded; this waits only if that read is still under way), not from the cold guesses.
        keys = stats.wait_for_cluster_view(timeout_s=4 * settings.stats.socket_timeout_s)
        if settings.stats.redis_url is not None:
            start = (
                f"warm: {keys} acceptance keys from the cluster" if keys else "cold: no cluster statistics"
            )
            log.info("replica %s starts %s", replica, start)
        return engine

    name = served_model_name(settings)
    try:
        instance = AsyncEngine(
            build,
            model_name=name,
            max_tokens_limit=settings.server.max_tokens_limit,
            default_max_tokens=settings.sampling.max_tokens,
            request_timeout_s=settings.server.request_timeout_s,
            stream_interval=settings.server.stream_interval,
            metrics=EngineMetrics(name, backend=metrics_backend, replica=replica),
            tracer=tracer,
            threads=threads,
        )
    except BaseException:  # the build failed: nothing else will close the statistics
        stats.close()
        raise
    instance.on_shutdown.append(stats.close)
    return instance
