"""Offline checks of the k8s/ manifests: a small kustomize renderer, the KubeRay and Prometheus
Operator CRD schemas as JSON Schema (with the API server's null-dropping and defaulting), and
Kubernetes' own schemas."""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("cpu", "gpu")
# Kubernetes version whose schemas (from kubernetes-validate) the built-in objects must satisfy.
K8S_VERSION = "1.32.0"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# The Prometheus Operator's CRDs (k8s/monitoring), kept in the repository: tests/k8s/schemas/ (each
# file's header names its source and version).
SCHEMAS = Path(__file__).resolve().parent / "schemas"
MONITORING_CRD_FILES = {
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}


def load_docs(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------------- kustomize

# The kustomization features our overlays use; anything else is an error here, so that a new
# feature cannot slip past this renderer (and kubectl, where present, checks we agree with it).
_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images", "configMapGenerator"}
_GENERATOR_KEYS = {"name", "files", "options"}
_GENERATOR_OPTIONS = {"labels", "annotations", "disableNameSuffixHash"}


def strategic_merge(base: Any, patch: Any) -> Any:
    """Strategic merge as kustomize applies it where no list merge keys are involved: mappings
    merge recursively, a null deletes the key, anything else (lists too) replaces."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(base.get(k), v)
        return out
    return copy.deepcopy(patch)


def _split_image(image: str) -> tuple[str, str]:
    """``name[:tag|@digest]`` -> (name, suffix with its separator)."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_images(node: Any, rules: list[dict[str, Any]]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for container in v:
                    if isinstance(container, dict) and "image" in container:
                        container["image"] = _new_image(container["image"], rules)
            _set_images(v, rules)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, rules)


def _new_image(image: str, rules: list[dict[str, Any]]) -> str:
    name, suffix = _split_image(image)
    for rule in rules:
        if rule["name"] == name:
            new_name = rule.get("newName", name)
            if "digest" in rule:
                return f"{new_name}@{rule['digest']}"
            if "newTag" in rule:
                return f"{new_name}:{rule['newTag']}"
            return new_name + suffix
    return image


def generated_config_map(directory: Path, generator: dict[str, Any]) -> dict[str, Any]:
    """A ``configMapGenerator`` entry's ConfigMap: ``files`` (``path`` or ``key=path``) as data, the
    options' labels and annotations. Only without the name's hash suffix (kustomize's hash is not
    reproduced here)."""
    options = generator.get("options", {})
    unknown = (set(generator) - _GENERATOR_KEYS) | (set(options) - _GENERATOR_OPTIONS)
    if unknown:
        raise NotImplementedError(f"{directory}: generator keys this renderer lacks: {sorted(unknown)}")
    if options.get("disableNameSuffixHash") is not True:
        raise NotImplementedError(f"{directory}: {generator['name']} needs disableNameSuffixHash: true")
    data = {}
    for entry in generator.get("files", []):
        data_key, _, path = entry.rpartition("=")
        data[data_key or Path(path).name] = (directory / path).read_text()
    metadata: dict[str, Any] = {"name": generator["name"]}
    for meta in ("labels", "annotations"):
        if options.get(meta):
            metadata[meta] = dict(options[meta])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def render_kustomization(directory: Path) -> list[dict[str, Any]]:
    """Our own ``kustomize build`` for the subset k8s/ uses: resources (files and directories),
    ``configMapGenerator`` (files, no hash suffix), strategic-merge ``patches`` (by the patch's kind
    and name, or a ``target``) and ``images``."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - _KUSTOMIZATION_KEYS
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization keys this renderer lacks: {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        docs.extend(render_kustomization(path) if path.is_dir() else load_docs(path))
    docs.extend(generated_config_map(directory, g) for g in spec.get("configMapGenerator", []))
    seen = [key(d) for d in docs]
    if len(seen) != len(set(seen)):
        raise ValueError(f"{directory}: duplicate resources {sorted(s for s in seen if seen.count(s) > 1)}")
    for entry in spec.get("patches", []):
        patches = (
            load_docs(directory / entry["path"]) if "path" in entry else [yaml.safe_load(entry["patch"])]
        )
        for patch in patches:
            target = entry.get("target") or {"kind": patch["kind"], "name": patch["metadata"]["name"]}
            matched = [
                i
                for i, d in enumerate(docs)
                if d["kind"] == target.get("kind", d["kind"])
                and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])
            ]
            if not matched:
                raise ValueError(f"{directory}: patch {entry} matches no resource")
            for i in matched:
                docs[i] = strategic_merge(docs[i], patch)
    if spec.get("images"):
        for doc in docs:
            _set_images(doc, spec["images"])
    return docs


def kubectl_kustomize(directory: Path) -> list[dict[str, Any]] | None:
    """``kubectl kustomize`` (or ``kustomize build``) output, or None where neither is installed."""
    if shutil.which("kustomize"):
        command = ["kustomize", "build", str(directory)]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(directory)]
    else:
        return None
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc is not None]


# --------------------------------------------------------------------------------- KubeRay CRDs


def crd_dir() -> Path:
    return Path(os.environ.get("KUBERAY_CRD_DIR") or REPO.parent / "shared" / "kuberay")


def crd_path(kind: str) -> Path:
    """The CRD file for ``kind``: skip the test where it is missing, but fail under CI=true."""
    if kind in MONITORING_CRD_FILES:  # in the repository: always there
        return SCHEMAS / MONITORING_CRD_FILES[kind]
    path = crd_dir() / CRD_FILES[kind]
    if not path.is_file():
        reason = (
            f"the KubeRay CRD {path} is missing (expected ../shared/kuberay beside the checkout, "
            "or KUBERAY_CRD_DIR)"
        )
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(reason + "; under CI=true this is an error")
        pytest.skip(reason)
    return path


@functools.cache
def _openapi_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{path}: no version {version}")


def crd_schema(kind: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``kind``'s served ``v1`` version, as the CRD file has it."""
    return _openapi_schema(crd_path(kind))


def to_json_schema(node: Any, strict: bool) -> Any:
    """An OpenAPI v3 (structural) schema as JSON Schema: ``nullable`` becomes a null type,
    Kubernetes' ``x-kubernetes-*`` extensions and ``default`` go (defaults are applied to the
    object first, see :func:`api_server_defaults`); ``strict`` forbids unknown fields wherever
    properties are listed (what ``kubectl apply --validate=strict`` makes the API server do instead
    of pruning them)."""
    if isinstance(node, list):
        return [to_json_schema(item, strict) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "properties":
            out[k] = {name: to_json_schema(sub, strict) for name, sub in v.items()}
        elif k in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[k] = to_json_schema(v, strict)
        elif k.startswith("x-kubernetes-") or k in ("nullable", "default", "description", "example"):
            continue
        elif k == "pattern" and isinstance(v, str):
            # Go's regexp takes a flag group anywhere (the Prometheus Operator's `^(?i)...`);
            # Python's only at the start
            out[k] = re.sub(r"^\^(\(\?[a-z]+\))", r"\1^", v)
        else:
            out[k] = v
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if strict and "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def api_server_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """What the API server does before validating: drop keys whose value is null, then fill in
    every field that has a ``default`` in the schema (recursively, where the parent exists)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        out = {k: v for k, v in value.items() if v is not None}
        for name, sub in props.items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for k, v in out.items():
            if k in props:
                out[k] = api_server_defaults(v, props[k])
            elif isinstance(extra, dict):
                out[k] = api_server_defaults(v, extra)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [api_server_defaults(v, schema["items"]) for v in value]
    return value


@functools.cache
def _crd_validator(path: Path, strict: bool) -> jsonschema.Draft7Validator:
    schema = to_json_schema(_openapi_schema(path), strict)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def crd_errors(obj: dict[str, Any], strict: bool) -> list[str]:
    """Every violation of ``obj`` (a RayService, a RayCluster or a monitoring.coreos.com object)
    against its CRD's v1 schema."""
    path = crd_path(obj["kind"])
    prepared = api_server_defaults(obj, _openapi_schema(path))
    errors = _crd_validator(path, strict).iter_errors(prepared)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


# --------------------------------------------------------------------------------- Kubernetes


def k8s_errors(obj: dict[str, Any], strict: bool = True) -> list[str]:
    """The violation (kubernetes-validate reports the first) of a built-in object, or none."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=strict)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.absolute_path)) or '<root>'}: {exc.message}"]
    return []


def pod_template_errors(template: dict[str, Any], name: str = "template") -> list[str]:
    """A pod template checked as Kubernetes checks one (as a core/v1 PodTemplate), strictly."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
    return k8s_errors(wrapped, strict=True)


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The head's and each worker group's pod template of a RayService."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        templates[group["groupName"]] = group["template"]
    return templates
