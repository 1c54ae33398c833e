"""`specserve serve`'s cluster options: Ray's metrics exporter port and report interval."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from serve_app.config import build_settings
from serve_app.local_server import _metrics_options
from tests.serve.conftest import free_port


def test_a_cluster_we_start_exports_metrics_on_the_configured_port() -> None:
    port = free_port()
    settings = build_settings(
        {"telemetry": {"metrics_export_port": port, "metrics_report_interval_ms": 500}}, environment=False
    )
    assert _metrics_options(settings, "local") == {
        "_system_config": {"metrics_report_interval_ms": 500},
        "_metrics_export_port": port,
    }


def test_a_taken_port_leaves_the_choice_to_ray_and_a_joined_cluster_keeps_its_own() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        settings = build_settings(
            {"telemetry": {"metrics_export_port": taken.getsockname()[1]}}, environment=False
        )
        options = _metrics_options(settings, "local")
    assert "_metrics_export_port" not in options and options["_system_config"]
    assert _metrics_options(settings, "ray://head:10001") == {}
    assert "_metrics_export_port" not in _metrics_options(
        build_settings({"telemetry": {"metrics_export_port": 0}}, environment=False), "local"
    )


def test_the_serving_loop_names_the_engine_replicas_as_serve_status_does() -> None:
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import DeploymentStatusOverview

    from serve_app.local_server import engine_replicas_line

    overview = DeploymentStatusOverview(
        status=DeploymentStatus.UPSCALING,
        status_trigger=DeploymentStatusTrigger.AUTOSCALING,
        replica_states={ReplicaState.RUNNING: 1, ReplicaState.STARTING: 1, ReplicaState.STOPPING: 0},
        message="",
    )
    app = SimpleNamespace(deployments={"EngineDeployment": overview})
    status = SimpleNamespace(applications={"specserve": app})
    assert engine_replicas_line(status, "specserve", "EngineDeployment") == "UPSCALING: 1 running, 1 starting"
    assert engine_replicas_line(status, "other", "EngineDeployment") is None
    assert engine_replicas_line(status, "specserve", "Ingress") is None
