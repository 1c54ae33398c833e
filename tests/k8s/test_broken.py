"""Broken manifests are caught: each check of the suite fails on the mistake it exists for."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deploy import kuberay, profiles
from deploy.serve_config import check_serve_config
from serve_app.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT
from tests.k8s.helpers import (
    crd_errors,
    find,
    k8s_errors,
    pod_template_errors,
    render_kustomization,
)


@pytest.fixture
def cpu(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return copy.deepcopy(find(rendered["cpu"], "RayService"))


@pytest.fixture
def config(cpu: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(cpu["spec"]["serveConfigV2"])


def engine(config: dict[str, Any]) -> dict[str, Any]:
    return next(d for d in config["applications"][0]["deployments"] if d["name"] == ENGINE_DEPLOYMENT)


def problems(config: dict[str, Any]) -> str:
    return "\n".join(check_serve_config(config, profiles.PROFILES["cpu"]))


# --------------------------------------------------------------------------------- RayService (CRD)


def test_misspelled_crd_key_is_caught_in_strict_mode(cpu: dict[str, Any]) -> None:
    head = cpu["spec"]["rayClusterConfig"]["headGroupSpec"]
    head["rayStartParam"] = head.pop("rayStartParams")
    errors = crd_errors(cpu, strict=True)
    assert any("rayStartParam" in e for e in errors), errors
    # the API server itself would silently prune the field: only the strict mode sees it
    assert crd_errors(cpu, strict=False) == []


def test_wrong_type_is_caught(cpu: dict[str, Any]) -> None:
    cpu["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    assert any("maxReplicas" in e and "integer" in e for e in crd_errors(cpu, strict=False))


def test_enum_and_missing_required_field_are_caught(cpu: dict[str, Any]) -> None:
    cluster = cpu["spec"]["rayClusterConfig"]
    cluster["autoscalerOptions"]["upscalingMode"] = "Fast"
    del cluster["workerGroupSpecs"][0]["groupName"]
    errors = crd_errors(cpu, strict=False)
    assert any("upscalingMode" in e for e in errors) and any("groupName" in e for e in errors), errors


def test_serve_config_must_be_a_string(cpu: dict[str, Any]) -> None:
    cpu["spec"]["serveConfigV2"] = yaml.safe_load(cpu["spec"]["serveConfigV2"])
    assert any("serveConfigV2" in e for e in crd_errors(cpu, strict=False))


# --------------------------------------------------------------------------------- pod templates


def test_misspelled_container_field_is_caught(cpu: dict[str, Any]) -> None:
    group = cpu["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert any("volumeMount" in e for e in pod_template_errors(group["template"]))
    assert any("volumeMount" in e for e in crd_errors(cpu, strict=True))


def test_wrong_type_in_pod_template_is_caught(cpu: dict[str, Any]) -> None:
    group = cpu["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    assert any("containerPort" in e for e in pod_template_errors(group["template"]))


def test_broken_builtin_object_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    redis = copy.deepcopy(find(rendered["cpu"], "Deployment", "specserve-redis"))
    redis["spec"]["replicas"] = "one"
    assert k8s_errors(redis)
    redis = copy.deepcopy(find(rendered["cpu"], "Deployment", "specserve-redis"))
    redis["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert k8s_errors(redis)


# --------------------------------------------------------------------------------- serveConfigV2


def test_max_replicas_below_min_replicas_is_caught(config: dict[str, Any]) -> None:
    scaling = engine(config)["autoscaling_config"]
    scaling["min_replicas"], scaling["max_replicas"] = 4, 2
    assert "autoscaling_config" in problems(config)


def test_max_replicas_below_min_replicas_in_the_settings_is_caught(config: dict[str, Any]) -> None:
    config["applications"][0]["args"]["autoscaling"]["min_replicas"] = 8
    assert "min_replicas" in problems(config)


def test_misspelled_autoscaling_key_is_caught_though_ray_ignores_it(config: dict[str, Any]) -> None:
    scaling = engine(config)["autoscaling_config"]
    scaling["target_ongoing_request"] = scaling.pop("target_ongoing_requests")
    ServeDeploySchema.model_validate(config)  # Ray accepts it (forward compatibility) ...
    found = problems(config)
    assert "target_ongoing_request: unknown key for AutoscalingConfig" in found  # ... we do not
    assert "target_ongoing_requests" in found  # and it no longer equals the settings' value


@pytest.mark.parametrize(
    "where",
    [
        lambda c: c,
        lambda c: c["http_options"],
        lambda c: c["applications"][0],
        lambda c: engine(c),
        lambda c: engine(c)["ray_actor_options"],
    ],
    ids=["root", "http_options", "application", "deployment", "ray_actor_options"],
)
def test_unknown_key_at_any_level_is_caught(config: dict[str, Any], where: Any) -> None:
    where(config)["max_ongoing_request"] = 3
    assert "max_ongoing_request: unknown key" in problems(config)


def test_wrong_type_in_serve_config_is_caught(config: dict[str, Any]) -> None:
    engine(config)["max_ongoing_requests"] = "ten"
    assert "ServeDeploySchema" in problems(config)


def test_misspelled_settings_key_is_caught(config: dict[str, Any]) -> None:
    config["applications"][0]["args"]["cache"]["max_slot"] = 4
    assert "args: not valid Settings" in problems(config)


def test_options_that_disagree_with_the_settings_are_caught(config: dict[str, Any]) -> None:
    engine(config)["max_ongoing_requests"] = 99  # a hand edit: valid for Ray, not what the app computes
    assert "max_ongoing_requests: 99 differs" in problems(config)
    ingress = next(d for d in config["applications"][0]["deployments"] if d["name"] == INGRESS_DEPLOYMENT)
    ingress["autoscaling_config"]["max_replicas"] = 9
    lines = problems(config).splitlines()
    assert any("autoscaling_config" in line and "(ingress_options)" in line for line in lines)


def test_extra_actor_options_are_only_gpus(config: dict[str, Any]) -> None:
    engine(config)["ray_actor_options"]["memory"] = 1024
    assert "unexpected ['memory']" in problems(config)


def test_unknown_deployment_and_import_path_are_caught(config: dict[str, Any]) -> None:
    config["applications"][0]["import_path"] = "serve_app.app:app"
    engine(config)["name"] = "Engine"
    found = problems(config)
    assert "import_path" in found and "'Engine' is not a deployment" in found


def test_render_refuses_invalid_settings(tmp_path: Path) -> None:
    import shutil

    from tests.k8s.helpers import K8S, REPO

    shutil.copytree(K8S, tmp_path / "k8s")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    settings = tmp_path / "k8s" / "overlays" / "cpu" / "settings.yaml"
    settings.write_text(settings.read_text().replace("host: 0.0.0.0", "host: 127.0.0.1"))
    with pytest.raises(ValueError, match="all interfaces"):
        kuberay.render("cpu", tmp_path)
    settings.write_text(settings.read_text().replace("max_slots: 8", "max_slot: 8"))
    with pytest.raises(ValueError, match="max_slot"):  # build_settings names the field
        kuberay.render("cpu", tmp_path)


# --------------------------------------------------------------------------------- kustomize


def test_renderer_rejects_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(NotImplementedError, match="namePrefix"):
        render_kustomization(tmp_path)


def test_patch_that_matches_nothing_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "patch.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [cm.yaml]\npatches: [{path: patch.yaml}]\n")
    with pytest.raises(ValueError, match="matches no resource"):
        render_kustomization(tmp_path)
