"""k8s/: every manifest parses, the overlays and k8s/monitoring compose, and every object validates
offline against the real schemas: KubeRay's CRDs (``../shared/kuberay``), the Prometheus Operator's
(``tests/k8s/schemas``) and Kubernetes' (kubernetes-validate)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s import helpers
from tests.k8s.helpers import (
    K8S,
    OVERLAYS,
    api_server_defaults,
    crd_errors,
    crd_schema,
    find,
    k8s_errors,
    key,
    kubectl_kustomize,
    load_docs,
    pod_template_errors,
    pod_templates,
    render_kustomization,
    strategic_merge,
)

NOT_OBJECTS = {"kustomization.yaml", "settings.yaml"}  # kustomize's and the app's own files
EXPECTED = {
    ("ray.io/v1", "RayService", "specserve"),
    ("apps/v1", "Deployment", "specserve-redis"),
    ("v1", "Service", "specserve-redis"),
    ("v1", "ConfigMap", "specserve-otel-collector"),
    ("v1", "ConfigMap", "specserve-otel-backend"),
    ("apps/v1", "Deployment", "specserve-otel-collector"),
    ("v1", "Service", "specserve-otel-collector"),
    ("v1", "PersistentVolumeClaim", "specserve-model-cache"),
}
MONITORING = {
    ("monitoring.coreos.com/v1", "ServiceMonitor", "specserve"),
    ("monitoring.coreos.com/v1", "PodMonitor", "specserve-ray"),
    ("monitoring.coreos.com/v1", "PrometheusRule", "specserve"),
    ("v1", "ConfigMap", "specserve-grafana-dashboard"),
}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name not in NOT_OBJECTS)


def test_every_yaml_file_parses() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        docs = load_docs(path)
        assert docs, f"{path} is empty"
        if path.name in NOT_OBJECTS:
            assert all(isinstance(d, dict) for d in docs), path
            continue
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path}: not a Kubernetes object"
            assert doc["metadata"].get("name"), f"{path}: {doc['kind']} without a name"


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_renders_every_object(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert {key(d) for d in rendered[name]} == EXPECTED


def test_monitoring_renders_every_object(monitoring: list[dict[str, Any]]) -> None:
    assert {key(d) for d in monitoring} == MONITORING


def test_every_manifest_file_is_used_by_a_kustomization() -> None:
    referenced: set[Path] = set()
    for directory in [K8S / "base", K8S / "monitoring", *(K8S / "overlays" / n for n in OVERLAYS)]:
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
        referenced |= {(directory / r).resolve() for r in spec.get("resources", [])}
        referenced |= {(directory / p["path"]).resolve() for p in spec.get("patches", []) if "path" in p}
    assert {p.resolve() for p in manifest_files()} <= referenced


@pytest.mark.parametrize("name", OVERLAYS)
def test_our_renderer_agrees_with_kustomize(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Where kubectl (or kustomize) is installed, its build equals ours, object by object."""
    theirs = kubectl_kustomize(K8S / "overlays" / name)
    if theirs is None:
        pytest.skip("neither kubectl nor kustomize is installed; our renderer stands alone")
    assert {key(d): d for d in theirs} == {key(d): d for d in rendered[name]}


def test_our_renderer_agrees_with_kustomize_on_monitoring(monitoring: list[dict[str, Any]]) -> None:
    """The configMapGenerator too: kustomize's ConfigMap is ours, byte for byte in its data."""
    theirs = kubectl_kustomize(K8S / "monitoring")
    if theirs is None:
        pytest.skip("neither kubectl nor kustomize is installed; our renderer stands alone")
    assert {key(d): d for d in theirs} == {key(d): d for d in monitoring}


def test_monitoring_composes_with_an_overlay(tmp_path: Path) -> None:
    """An overlay that adds k8s/monitoring to its resources (README) renders both, nothing twice."""
    # relative paths: kustomize refuses absolute ones
    resources = [os.path.relpath(K8S / d, tmp_path) for d in ("overlays/cpu", "monitoring")]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": resources}))
    docs = render_kustomization(tmp_path)
    assert {key(d) for d in docs} == EXPECTED | MONITORING
    assert len(docs) == len(EXPECTED | MONITORING)
    theirs = kubectl_kustomize(tmp_path)
    if theirs is not None:
        assert {key(d): d for d in theirs} == {key(d): d for d in docs}


def test_gpu_overlay_patches_the_model_cache(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cpu = find(rendered["cpu"], "PersistentVolumeClaim")["spec"]
    gpu = find(rendered["gpu"], "PersistentVolumeClaim")["spec"]
    assert cpu["accessModes"] == ["ReadWriteOnce"] and gpu["accessModes"] == ["ReadWriteMany"]
    assert gpu["resources"]["requests"]["storage"] == "400Gi"


def test_renderer_primitives(tmp_path: Path) -> None:
    merged = strategic_merge({"a": {"b": 1, "c": [1, 2]}, "d": 1}, {"a": {"c": [3]}, "d": None})
    assert merged == {"a": {"b": 1, "c": [3]}}
    (tmp_path / "pod.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n"
        "spec: {containers: [{name: c, image: 'specserve:1'}, {name: d, image: 'redis:7'}]}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [pod.yaml]\nimages: [{name: specserve, newName: reg.example/team/specserve}]\n"
    )
    (pod,) = render_kustomization(tmp_path)
    assert [c["image"] for c in pod["spec"]["containers"]] == ["reg.example/team/specserve:1", "redis:7"]
    (tmp_path / "kustomization.yaml").write_text("configMapGenerator: [{name: c, files: [k=pod.yaml]}]\n")
    with pytest.raises(NotImplementedError, match="disableNameSuffixHash"):  # kustomize's hash: not ours
        render_kustomization(tmp_path)


# --------------------------------------------------------------------------------- KubeRay CRDs


@pytest.mark.parametrize("strict", [False, True], ids=["as-served", "strict"])
def test_rayservice_validates_against_the_crd(rayservice: dict[str, Any], strict: bool) -> None:
    """As the API server validates (nulls dropped, defaults applied); strict: no unknown field,
    which the server would otherwise prune silently (or reject under --validate=strict)."""
    assert crd_errors(rayservice, strict=strict) == []


def test_cluster_config_validates_as_a_raycluster(rayservice: dict[str, Any]) -> None:
    """The operator creates a RayCluster from rayClusterConfig: it must satisfy that CRD too."""
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "specserve-raycluster"},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    assert crd_errors(cluster, strict=True) == []


def test_crd_schema_is_the_served_v1_with_pod_templates() -> None:
    schema = crd_schema("RayService")
    cluster = schema["properties"]["spec"]["properties"]["rayClusterConfig"]
    template = cluster["properties"]["headGroupSpec"]["properties"]["template"]
    assert "containers" in template["properties"]["spec"]["properties"]  # the full PodTemplateSpec


def test_api_server_defaults_drop_nulls_and_fill_defaults() -> None:
    schema = crd_schema("RayService")
    obj = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "x"},
        "spec": {
            "serveService": None,
            "rayClusterConfig": {
                "headGroupSpec": {"template": {"spec": {"containers": []}}},
                "workerGroupSpecs": [{"groupName": "g", "template": {"spec": {"containers": []}}}],
            },
        },
    }
    prepared = api_server_defaults(obj, schema)
    assert "serveService" not in prepared["spec"]
    group = prepared["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["minReplicas"] == 0 and group["maxReplicas"] == 2147483647  # required, defaulted
    assert crd_errors(obj, strict=True) == []


def test_missing_crd_skips_outside_ci_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBERAY_CRD_DIR", str(tmp_path / "absent"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="KubeRay CRD"):
        helpers.crd_path("RayService")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        helpers.crd_path("RayService")


# --------------------------------------------------------------------------------- Prometheus Operator


@pytest.mark.parametrize("strict", [False, True], ids=["as-served", "strict"])
def test_monitoring_objects_validate_against_their_crds(
    monitoring: list[dict[str, Any]], strict: bool
) -> None:
    checked = 0
    for doc in monitoring:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert crd_errors(doc, strict=strict) == [], key(doc)
            checked += 1
    assert checked == 3


def test_monitoring_crds_are_the_operators_v1_schemas() -> None:
    rules = crd_schema("PrometheusRule")["properties"]["spec"]["properties"]["groups"]["items"]
    rule = rules["properties"]["rules"]["items"]
    assert rule["required"] == ["expr"] and "pattern" in rule["properties"]["for"]
    endpoints = crd_schema("ServiceMonitor")["properties"]["spec"]["properties"]["endpoints"]
    assert "relabelings" in endpoints["items"]["properties"]
    assert "podMetricsEndpoints" in crd_schema("PodMonitor")["properties"]["spec"]["properties"]
    for kind in helpers.MONITORING_CRD_FILES:
        assert "operator.prometheus.io/version" in helpers.crd_path(kind).read_text()


def test_broken_monitoring_objects_are_caught(monitoring: list[dict[str, Any]]) -> None:
    service_monitor = copy.deepcopy(find(monitoring, "ServiceMonitor"))
    service_monitor["spec"]["endpoint"] = service_monitor["spec"].pop("endpoints")
    strict = crd_errors(service_monitor, strict=True)
    assert any("'endpoint' was unexpected" in e for e in strict), strict  # strict: the unknown field
    assert crd_errors(service_monitor, strict=False) == ["spec: 'endpoints' is a required property"]
    rule = copy.deepcopy(find(monitoring, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "15 minutes"
    assert any("for" in e for e in crd_errors(rule, strict=False))


# --------------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("name", OVERLAYS)
def test_builtin_objects_validate_against_kubernetes(
    name: str, rendered: dict[str, list[dict[str, Any]]], monitoring: list[dict[str, Any]]
) -> None:
    for doc in rendered[name] + monitoring:
        if doc["apiVersion"].startswith(("ray.io/", "monitoring.coreos.com/")):
            continue
        assert k8s_errors(doc, strict=True) == [], key(doc)


def test_ray_pod_templates_validate_against_kubernetes(rayservice: dict[str, Any]) -> None:
    templates = pod_templates(rayservice)
    assert set(templates) == {"head", "engine"}
    for name, template in templates.items():
        assert pod_template_errors(template, name) == [], name


def test_ray_pods_probe_ray_and_serve(rayservice: dict[str, Any]) -> None:
    """Head: Ray's health only (the Serve config is submitted after the head is ready); workers:
    ready when Serve's proxy answers, alive while the Ray node is."""
    templates = pod_templates(rayservice)
    head = templates["head"]["spec"]["containers"][0]
    worker = templates["engine"]["spec"]["containers"][0]
    command = lambda probe: " ".join(probe["exec"]["command"])  # noqa: E731
    head_ready = command(head["readinessProbe"])
    assert "gcs_healthz" in head_ready and "/-/healthz" not in head_ready
    assert "/-/healthz" in command(worker["readinessProbe"])
    assert "local_raylet_healthz" in command(worker["livenessProbe"])
    assert "/-/healthz" not in command(worker["livenessProbe"])
