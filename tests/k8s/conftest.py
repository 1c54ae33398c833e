"""Fixtures for the k8s/ manifest tests: each overlay and k8s/monitoring rendered once (no cluster, no Ray
started)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.k8s.helpers import K8S, OVERLAYS, find, render_kustomization


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay as `kustomize build` renders it (our renderer; kubectl is checked against it)."""
    return {name: render_kustomization(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def monitoring() -> list[dict[str, Any]]:
    """k8s/monitoring rendered (ServiceMonitor, PodMonitor, PrometheusRule, the dashboard ConfigMap)."""
    return render_kustomization(K8S / "monitoring")


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rayservice(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> dict[str, Any]:
    return find(rendered[overlay], "RayService")


@pytest.fixture
def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


@pytest.fixture
def overlay_args(overlay: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / "overlays" / overlay / "settings.yaml").read_text())


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No SPECSERVE_* variables of the machine running the tests (only those a test sets)."""
    import os

    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    return monkeypatch
