"""k8s/: every manifest parses, the overlays compose, and every object validates offline against the
real schemas: KubeRay's CRDs (``../shared/kuberay``) and Kubernetes' (kubernetes-validate)."""

from __future__ import annotations

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


def test_every_manifest_file_is_used_by_an_overlay(rendered: dict[str, list[dict[str, Any]]]) -> None:
    referenced: set[Path] = set()
    for directory in [K8S / "base", *(K8S / "overlays" / n for n in OVERLAYS)]:
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


# --------------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("name", OVERLAYS)
def test_builtin_objects_validate_against_kubernetes(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for doc in rendered[name]:
        if doc["apiVersion"].startswith("ray.io/"):
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
