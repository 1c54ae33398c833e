"""The worker pods' init container: fetch the models a replica loads into the model cache volume.

``python -m deploy.kuberay fetch-models`` runs :func:`fetch_models` on the settings of the
environment (the ``SPECSERVE_*`` variables :func:`deploy.manifest.fetch_env` gives the container),
so that the engine replica finds its models in the store when it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from serve_app.builder import model_store, models_needed
from serve_app.config import Settings, build_settings

LOCK_NAME = ".fetch-models.lock"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One fetch at a time on a cache volume that several pods share (flock; NFS honours it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_models(settings: Settings | None = None) -> list[Path]:
    """Resolve (fetch and convert packs, download hub snapshots) the models ``settings`` serve
    (default: the environment's) into the store, as ``specserve serve`` does before it starts the
    application."""
    settings = settings or build_settings()
    store = model_store(settings)
    paths = []
    with _exclusive(Path(settings.store.cache_dir) / LOCK_NAME):
        for ref in models_needed(settings):
            path = store.resolve(ref)
            print(f"[specserve] model {ref}: {path}", flush=True)
            paths.append(path)
    return paths
