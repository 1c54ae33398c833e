"""The RayService manifest of an overlay: the Ray cluster, its pods and its serveConfigV2.

Nothing in it that the settings determine is written by hand:

- ``serveConfigV2``: see :mod:`deploy.serve_config`;
- the worker group: one engine replica per worker pod, so the group scales between
  ``autoscaling.min_replicas`` and ``max_replicas`` pods, each with ``ceil(replica_num_cpus)`` Ray
  CPUs; the serve port is ``server.port``; the model cache volume is mounted at
  ``store.cache_dir``; the init container that fetches the models (``fetch-models``, see
  :mod:`deploy.fetch_models`) gets the settings that choose them as ``SPECSERVE_*`` variables.

The rest comes from the overlay's :class:`~deploy.profiles.ClusterProfile` (image tag, pod sizes,
placement) and from the constants below (the ``k8s/base`` Services, the image's user).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from deploy.profiles import ClusterProfile, PodSize
from deploy.serve_config import serve_config, settings_from
from serve_app.config import Settings
from serve_app.engine.proposers.registry import proposer_spec

RAYSERVICE_NAME = "specserve"
IMAGE = "specserve"
# Must equal the Ray that the image installs (the Dockerfile's RAY_VERSION; a test checks both).
RAY_VERSION = "2.60.0"
# Services of k8s/base (tests check that these names and ports match the base manifests).
REDIS_URL = "redis://specserve-redis:6379/0"
OTLP_ENDPOINT = "http://specserve-otel-collector:4317"
MODEL_CACHE_CLAIM = "specserve-model-cache"
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
FETCH_CONTAINER = "fetch-models"
# The init container's command: `fetch-models` of the renderer's command line (deploy.kuberay).
FETCH_COMMAND = ("python", "-m", "deploy.kuberay", "fetch-models")
WORKER_GROUP = "engine"
RAY_UID = 1000  # the image's user (Dockerfile), owner of the model cache volume through fsGroup

# Ray node health (raylet through the dashboard agent, GCS through the dashboard), and Serve's HTTP
# proxy health, as KubeRay's own default probes check them (`wget` is in the image).
_RAYLET = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
_GCS = "wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"


def _serve_proxy(port: int) -> str:
    return f"wget -T 2 -q -O- http://localhost:{port}/-/healthz | grep success"


# --------------------------------------------------------------------------------- environment


def hf_home(settings: Settings) -> str:
    """Hub snapshots (hub ids as models) land on the model cache volume, next to the packs."""
    return str(Path(settings.store.cache_dir) / "huggingface")


def ray_env(settings: Settings, profile: ClusterProfile) -> list[dict[str, Any]]:
    """Environment of every Ray container (head and workers alike: Serve may build the application,
    i.e. call ``build_app``, on any node). ``SPECSERVE_*`` variables here name settings that the
    args leave out (where the Services are), never one that the args set."""
    return [
        {"name": "SPECSERVE_STATS__REDIS_URL", "value": REDIS_URL},
        {"name": "SPECSERVE_TELEMETRY__OTLP_ENDPOINT", "value": OTLP_ENDPOINT},
        {"name": "HF_HOME", "value": hf_home(settings)},
        *(dict(e) for e in profile.env),
    ]


def model_roles(settings: Settings) -> list[str]:
    """The ``model.<role>`` settings that the proposers a replica loads draft with (registry order)."""
    roles: list[str] = []
    for name in settings.speculation.loaded_proposers():
        role = proposer_spec(name).model_role
        if role and role not in roles:
            roles.append(role)
    return roles


def fetch_env(settings: Settings, profile: ClusterProfile) -> list[dict[str, Any]]:
    """Environment of the model-fetch init container: the settings that choose the models (those
    ``serve_app.builder.models_needed`` reads) and the store."""
    speculation = settings.speculation
    env = [{"name": "SPECSERVE_MODEL__TARGET", "value": settings.model.target}]
    for role in model_roles(settings):
        ref = getattr(settings.model, role)
        if ref:
            env.append({"name": f"SPECSERVE_MODEL__{role.upper()}", "value": ref})
    env.append({"name": "SPECSERVE_SPECULATION__METHOD", "value": speculation.method})
    if speculation.extra_proposers:  # a list: pydantic-settings reads it from the variable as JSON
        extra = json.dumps(list(speculation.extra_proposers))
        env.append({"name": "SPECSERVE_SPECULATION__EXTRA_PROPOSERS", "value": extra})
    env.append({"name": "SPECSERVE_STORE__CACHE_DIR", "value": str(settings.store.cache_dir)})
    return [*env, {"name": "HF_HOME", "value": hf_home(settings)}, *(dict(e) for e in profile.env)]


# --------------------------------------------------------------------------------- pods


def _probe(command: str, *, initial: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["bash", "-c", command]},
        "initialDelaySeconds": initial,
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_UID, "fsGroup": RAY_UID}


def _head_container(settings: Settings, profile: ClusterProfile, image: str) -> dict[str, Any]:
    return {
        "name": HEAD_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"name": "gcs-server", "containerPort": 6379},
            {"name": "dashboard", "containerPort": 8265},
            {"name": "client", "containerPort": 10001},
            {"name": "serve", "containerPort": settings.server.port},
            {"name": "metrics", "containerPort": 8080},
        ],
        "env": ray_env(settings, profile),
        "resources": profile.head.resources(),
        # The head must become ready before KubeRay submits the Serve config: Ray's health only.
        "readinessProbe": _probe(f"{_RAYLET} && {_GCS}", initial=10, period=5, failures=10),
        "livenessProbe": _probe(f"{_RAYLET} && {_GCS}", initial=30, period=5, failures=120),
        "volumeMounts": [{"name": "ray-logs", "mountPath": "/tmp/ray"}],
    }


def _worker_spec(settings: Settings, profile: ClusterProfile, image: str) -> dict[str, Any]:
    """The worker pod's spec: the fetch init container, the Ray worker, the volumes."""
    port = settings.server.port
    cache_mount = {"name": "model-cache", "mountPath": str(settings.store.cache_dir)}
    logs_mount = {"name": "ray-logs", "mountPath": "/tmp/ray"}
    worker_resources = PodSize(
        cpu=str(math.ceil(settings.autoscaling.replica_num_cpus)),
        memory=profile.worker_memory,
        gpus=profile.gpus_per_replica,
    ).resources()
    worker_container = {
        "name": WORKER_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "serve", "containerPort": port}, {"name": "metrics", "containerPort": 8080}],
        "env": ray_env(settings, profile),
        "resources": worker_resources,
        # Ready = Serve's proxy on this pod answers (the serve Service then routes here); alive =
        # the Ray node is. Serve itself health-checks each engine replica (check_health) and
        # replaces a stuck one.
        "readinessProbe": _probe(f"{_RAYLET} && {_serve_proxy(port)}", initial=10, period=5, failures=10),
        "livenessProbe": _probe(_RAYLET, initial=30, period=5, failures=120),
        "volumeMounts": [cache_mount, logs_mount],
    }
    fetch_container = {
        "name": FETCH_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(FETCH_COMMAND),
        "env": fetch_env(settings, profile),
        "resources": profile.fetch.resources(),
        "volumeMounts": [cache_mount],
    }
    spec: dict[str, Any] = {
        "securityContext": _pod_security(),
        "nodeSelector": dict(profile.worker_node_selector),
    }
    if profile.worker_tolerations:
        spec["tolerations"] = [dict(t) for t in profile.worker_tolerations]
    return spec | {
        "initContainers": [fetch_container],
        "containers": [worker_container],
        "volumes": [
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": MODEL_CACHE_CLAIM}},
            {"name": "ray-logs", "emptyDir": {}},
        ],
    }


# --------------------------------------------------------------------------------- RayService


def rayservice(args: Mapping[str, Any], profile: ClusterProfile, version: str) -> dict[str, Any]:
    """The RayService manifest for an overlay (a plain dict, in manifest order): ``args`` are its
    settings, ``version`` the project's version (the image tag, with the profile's suffix)."""
    settings = settings_from(args)
    config = serve_config(args, profile)
    image = f"{IMAGE}:{version}{profile.image_tag_suffix}"
    scaling = settings.autoscaling
    labels = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/part-of": "specserve"}
    worker_start: dict[str, str] = {"num-cpus": str(math.ceil(scaling.replica_num_cpus))}
    if profile.gpus_per_replica:
        worker_start["num-gpus"] = str(profile.gpus_per_replica)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": RAYSERVICE_NAME, "labels": labels},
        "spec": {
            "serveConfigV2": dump_yaml(config),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "upscalingMode": "Default",
                    "idleTimeoutSeconds": 60,
                    "resources": PodSize(cpu="500m", memory="512Mi").resources(),
                },
                "headGroupSpec": {
                    # no engine replica on the head: it runs GCS, the Serve controller and a proxy
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                    "template": {
                        "metadata": {"labels": dict(labels)},
                        "spec": {
                            "securityContext": _pod_security(),
                            "nodeSelector": dict(profile.head_node_selector),
                            "containers": [_head_container(settings, profile, image)],
                            "volumes": [{"name": "ray-logs", "emptyDir": {}}],
                        },
                    },
                },
                "workerGroupSpecs": [
                    {
                        # one engine replica per worker pod: pods scale with Serve's replicas
                        "groupName": WORKER_GROUP,
                        "replicas": scaling.min_replicas,
                        "minReplicas": scaling.min_replicas,
                        "maxReplicas": scaling.max_replicas,
                        "rayStartParams": worker_start,
                        "template": {
                            "metadata": {"labels": dict(labels)},
                            "spec": _worker_spec(settings, profile, image),
                        },
                    }
                ],
            },
        },
    }


# --------------------------------------------------------------------------------- YAML


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: shared lists are written out
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_yaml(data: Any) -> str:
    """YAML in the dict's order, block style, multi-line strings as ``|`` blocks, no anchors."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
