"""Kubernetes (KubeRay) manifests rendered from Settings: one source of truth for `serve` and the cluster.

Each overlay under ``k8s/overlays/<name>/`` holds ``settings.yaml`` (the application's settings: the
nested dict that ``serve_app.app:build_app`` is built from) and ``rayservice.yaml``, which this
module renders from those settings and from the overlay's cluster profile below (image, pod sizes,
node selectors). Nothing in the RayService that the settings determine is written by hand:

- ``serveConfigV2``: ``import_path: serve_app.app:build_app``, ``args`` = the settings, and the
  options of both deployments exactly as :func:`serve_app.app.deployment_options` /
  :func:`serve_app.app.ingress_options` compute them (Serve gives the config's options precedence
  over the code's; here they are the same values), ``http_options`` from ``server.host/port``;
- the worker group: one engine replica per worker pod, so the group scales between
  ``autoscaling.min_replicas`` and ``max_replicas`` pods, each with ``ceil(replica_num_cpus)`` Ray
  CPUs; the serve port is ``server.port``; the model cache volume is mounted at
  ``store.cache_dir``; the init container that fetches the models gets the model settings as
  ``SPECSERVE_*`` variables.

Commands (no cluster, no Ray started)::

    python -m serve_app.k8s_config --overlay cpu            # print the RayService YAML
    python -m serve_app.k8s_config --all --write             # rewrite every overlay's rayservice.yaml
    python -m serve_app.k8s_config --all --check             # exit 1 if a committed file is stale
    python -m serve_app.k8s_config fetch-models              # (init container) fetch the models that
                                                             # the SPECSERVE_* environment names

``tests/k8s`` check that the committed files equal the rendering (drift), and validate them against
Ray's ``ServeDeploySchema`` / ``AutoscalingConfig``, the KubeRay CRDs and Kubernetes' schemas.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import sys
import textwrap
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from serve_app.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
IMPORT_PATH = "serve_app.app:build_app"
APP_NAME = "specserve"  # the application name `specserve serve` uses too
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
WORKER_GROUP = "engine"
RAY_UID = 1000  # the image's user (Dockerfile), owner of the model cache volume through fsGroup
# Options of the engine deployment that a profile may add to what deployment_options() computes,
# because Settings has no field for them yet (GPUs per replica: a follow-up for config.py).
EXTRA_ACTOR_OPTIONS = frozenset({"num_gpus"})

# Ray node health (raylet through the dashboard agent, GCS through the dashboard), and Serve's HTTP
# proxy health, as KubeRay's own default probes check them (`wget` is in the image).
_RAYLET = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
_GCS = "wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"


def _serve_proxy(port: int) -> str:
    return f"wget -T 2 -q -O- http://localhost:{port}/-/healthz | grep success"


# --------------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class PodSize:
    """Requests = limits (Guaranteed QoS: Ray's resource view matches what the pod really has)."""

    cpu: str
    memory: str
    gpus: int = 0

    def resources(self) -> dict[str, Any]:
        amounts: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory}
        if self.gpus:
            amounts["nvidia.com/gpu"] = self.gpus
        return {"requests": dict(amounts), "limits": dict(amounts)}


@dataclass(frozen=True)
class ClusterProfile:
    """What an overlay's cluster needs besides the application settings (which are in its
    ``settings.yaml``): image tag, pod sizes, placement, extra (non-``SPECSERVE_``) environment."""

    name: str
    description: str
    image_tag_suffix: str
    head: PodSize
    worker_memory: str
    fetch: PodSize
    gpus_per_replica: int = 0
    head_node_selector: Mapping[str, str] = field(default_factory=dict)
    worker_node_selector: Mapping[str, str] = field(default_factory=dict)
    worker_tolerations: tuple[Mapping[str, Any], ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()


_LINUX = {"kubernetes.io/os": "linux"}

PROFILES: dict[str, ClusterProfile] = {
    "cpu": ClusterProfile(
        name="cpu",
        description="the Qwen pair on CPU nodes (x86 with AMX for bf16), as `make serve` runs it",
        image_tag_suffix="",
        head=PodSize(cpu="2", memory="4Gi"),
        # the 1.5B target (bf16) + 0.5B draft (int8) + KV cache of 8 slots x 4096 tokens, with room
        worker_memory="12Gi",
        # converting the 1.5B pack peaks near 9 GB (README, "Model packs")
        fetch=PodSize(cpu="2", memory="12Gi"),
        head_node_selector={**_LINUX, "kubernetes.io/arch": "amd64"},
        worker_node_selector={**_LINUX, "kubernetes.io/arch": "amd64"},
    ),
    "gpu": ClusterProfile(
        name="gpu",
        description=(
            "Llama 3.3 70B target, Llama 3.2 1B draft (one tokenizer), one 192 GB B200 per replica: "
            "the engine runs a model on one device and the 70B bf16 weights alone are 141 GB"
        ),
        image_tag_suffix="-cuda",
        head=PodSize(cpu="4", memory="16Gi"),
        worker_memory="240Gi",
        fetch=PodSize(cpu="4", memory="16Gi"),
        gpus_per_replica=1,
        head_node_selector=_LINUX,
        worker_node_selector={**_LINUX, "nvidia.com/gpu.product": "NVIDIA-B200"},
        worker_tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
        env=(
            # the Llama checkpoints are gated: a Secret `hf-token` with key `token` (optional)
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}},
            },
        ),
    ),
}


# --------------------------------------------------------------------------------- settings


class _ArgsOnlySettings(Settings):
    """``Settings`` from the given values only: the rendering must not depend on the SPECSERVE_*
    environment (or SPECSERVE_CONFIG file) of whoever runs it."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def settings_from(args: Mapping[str, Any]) -> Settings:
    """Validate an overlay's settings (nested dict) into ``Settings``, ignoring the environment."""
    return _ArgsOnlySettings(**args)


def overlay_dir(name: str, root: Path = ROOT) -> Path:
    return root / "k8s" / "overlays" / name


def load_overlay_settings(name: str, root: Path = ROOT) -> dict[str, Any]:
    """The overlay's ``settings.yaml``: the ``args`` of its serveConfigV2."""
    path = overlay_dir(name, root) / "settings.yaml"
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings sections")
    return data


def model_refs(settings: Settings) -> list[str]:
    """The models a replica loads: the target, and the draft when speculation uses it."""
    refs = [settings.model.target]
    if settings.speculation.method == "draft" and settings.model.draft:
        refs.append(settings.model.draft)
    return refs


def project_version(root: Path = ROOT) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


# --------------------------------------------------------------------------------- serveConfigV2


def serve_config(args: Mapping[str, Any], profile: ClusterProfile) -> dict[str, Any]:
    """The serveConfigV2 document for ``args`` (the settings) on ``profile``'s cluster."""
    from serve_app.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, deployment_options, ingress_options

    settings = settings_from(args)
    if settings.server.host not in ("0.0.0.0", "::"):
        raise ValueError(
            f"server.host is {settings.server.host!r}: in a pod Serve must listen on all interfaces "
            "(0.0.0.0) so that the serve Service and the probes reach it"
        )
    engine = deployment_options(settings)
    actor = dict(engine["ray_actor_options"])
    if profile.gpus_per_replica and "num_gpus" not in actor:
        actor["num_gpus"] = float(profile.gpus_per_replica)
    engine = {**engine, "ray_actor_options": actor}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": settings.server.host, "port": settings.server.port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": _plain(args),
                "deployments": [
                    {"name": ENGINE_DEPLOYMENT, **engine},
                    {"name": INGRESS_DEPLOYMENT, **ingress_options(settings)},
                ],
            }
        ],
    }


def _plain(value: Any) -> Any:
    """A YAML-safe deep copy (dicts in their order, lists, scalars)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (Optional/Union/List unwrapped)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_model_types(arg))
    return found


def unknown_keys(data: Any, model: type[BaseModel], path: str = "") -> list[str]:
    """Keys of ``data`` that ``model`` (recursively, through nested models) does not define.

    Ray's serve schemas ignore unknown keys (forward compatibility), so a misspelled option
    (``target_ongoing_request``) would be dropped silently; this check names it.
    """
    if not isinstance(data, Mapping):
        return []
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    problems: list[str] = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            problems.append(f"{where}: unknown key for {model.__name__}")
            continue
        info = fields.get(key) or next(f for f in fields.values() if f.alias == key)
        nested = _model_types(info.annotation)
        if len(nested) != 1:
            continue
        if isinstance(value, Mapping):
            problems.extend(unknown_keys(value, nested[0], where))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                problems.extend(unknown_keys(item, nested[0], f"{where}[{i}]"))
    return problems


def check_serve_config(config: Mapping[str, Any], profile: ClusterProfile | None = None) -> list[str]:
    """Every problem of a serveConfigV2 document (empty: none).

    Ray's ``ServeDeploySchema`` (types, constraints), ``AutoscalingConfig`` for each autoscaling
    block (e.g. ``max_replicas`` < ``min_replicas``), unknown keys at every level, ``args`` as
    ``Settings`` (unknown keys are errors there too), deployment names of this application, and the
    single source of truth: the deployments' options equal what ``deployment_options`` /
    ``ingress_options`` compute from the ``args`` (plus, for the engine, only the documented
    ``EXTRA_ACTOR_OPTIONS``).
    """
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from serve_app.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, deployment_options, ingress_options

    problems = unknown_keys(config, ServeDeploySchema)
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        problems.append(f"ServeDeploySchema: {exc}")
        return problems
    for i, app in enumerate(config.get("applications") or []):
        where = f"applications[{i}]"
        expected_by_name: dict[str, dict[str, Any]] = {}
        if app.get("import_path") != IMPORT_PATH:
            problems.append(f"{where}.import_path: {app.get('import_path')!r}, expected {IMPORT_PATH!r}")
        try:
            settings = settings_from(app.get("args") or {})
            expected_by_name = {
                ENGINE_DEPLOYMENT: deployment_options(settings),
                INGRESS_DEPLOYMENT: ingress_options(settings),
            }
        except ValidationError as exc:
            problems.append(f"{where}.args: not valid Settings: {exc}")
        except ValueError as exc:  # e.g. autoscaling.min_replicas > max_replicas
            problems.append(f"{where}.args: {exc}")
        for j, deployment in enumerate(app.get("deployments") or []):
            dwhere = f"{where}.deployments[{j}]"
            scaling = deployment.get("autoscaling_config")
            if isinstance(scaling, Mapping):
                try:
                    AutoscalingConfig.model_validate(dict(scaling))
                except ValidationError as exc:
                    problems.append(f"{dwhere}.autoscaling_config: {exc}")
            name = deployment.get("name")
            if name not in (ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT):
                problems.append(f"{dwhere}.name: {name!r} is not a deployment of {IMPORT_PATH}")
                continue
            if name not in expected_by_name:
                continue
            problems.extend(_compare_options(deployment, expected_by_name[name], name, dwhere, profile))
    return problems


def _compare_options(
    deployment: Mapping[str, Any],
    expected: Mapping[str, Any],
    name: str,
    where: str,
    profile: ClusterProfile | None,
) -> list[str]:
    from serve_app.app import ENGINE_DEPLOYMENT

    problems = []
    for key, value in expected.items():
        got = deployment.get(key)
        if key == "ray_actor_options" and name == ENGINE_DEPLOYMENT and isinstance(got, Mapping):
            extra = set(got) - set(value)
            if extra - EXTRA_ACTOR_OPTIONS:
                problems.append(
                    f"{where}.ray_actor_options: unexpected {sorted(extra - EXTRA_ACTOR_OPTIONS)}"
                )
            gpus = profile.gpus_per_replica if profile else got.get("num_gpus", 0)
            if "num_gpus" in extra and got["num_gpus"] != gpus:
                problems.append(f"{where}.ray_actor_options.num_gpus: {got['num_gpus']}, profile: {gpus}")
            got = {k: v for k, v in got.items() if k not in extra}
        if got != value:
            problems.append(
                f"{where}.{key}: {got!r} differs from {value!r}, which the settings (args) give "
                f"({'deployment_options' if name == ENGINE_DEPLOYMENT else 'ingress_options'})"
            )
    return problems


# --------------------------------------------------------------------------------- RayService


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


def fetch_env(settings: Settings, profile: ClusterProfile) -> list[dict[str, Any]]:
    """Environment of the model-fetch init container: the settings that choose the models."""
    env = [
        {"name": "SPECSERVE_MODEL__TARGET", "value": settings.model.target},
        {"name": "SPECSERVE_SPECULATION__METHOD", "value": settings.speculation.method},
        {"name": "SPECSERVE_STORE__CACHE_DIR", "value": str(settings.store.cache_dir)},
    ]
    if settings.model.draft:
        env.insert(1, {"name": "SPECSERVE_MODEL__DRAFT", "value": settings.model.draft})
    return [*env, {"name": "HF_HOME", "value": hf_home(settings)}, *(dict(e) for e in profile.env)]


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


def rayservice(args: Mapping[str, Any], profile: ClusterProfile, root: Path = ROOT) -> dict[str, Any]:
    """The RayService manifest for an overlay (a plain dict, in manifest order)."""
    settings = settings_from(args)
    config = serve_config(args, profile)
    image = f"{IMAGE}:{project_version(root)}{profile.image_tag_suffix}"
    port = settings.server.port
    scaling = settings.autoscaling
    ray_cpus = math.ceil(scaling.replica_num_cpus)
    labels = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/part-of": "specserve"}
    env = ray_env(settings, profile)
    cache_mount = {"name": "model-cache", "mountPath": str(settings.store.cache_dir)}
    logs_mount = {"name": "ray-logs", "mountPath": "/tmp/ray"}

    head_container = {
        "name": HEAD_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"name": "gcs-server", "containerPort": 6379},
            {"name": "dashboard", "containerPort": 8265},
            {"name": "client", "containerPort": 10001},
            {"name": "serve", "containerPort": port},
            {"name": "metrics", "containerPort": 8080},
        ],
        "env": env,
        "resources": profile.head.resources(),
        # The head must become ready before KubeRay submits the Serve config: Ray's health only.
        "readinessProbe": _probe(f"{_RAYLET} && {_GCS}", initial=10, period=5, failures=10),
        "livenessProbe": _probe(f"{_RAYLET} && {_GCS}", initial=30, period=5, failures=120),
        "volumeMounts": [logs_mount],
    }
    worker_resources = PodSize(
        cpu=str(ray_cpus), memory=profile.worker_memory, gpus=profile.gpus_per_replica
    ).resources()
    worker_container = {
        "name": WORKER_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "serve", "containerPort": port}, {"name": "metrics", "containerPort": 8080}],
        "env": env,
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
        "command": ["python", "-m", "serve_app.k8s_config", "fetch-models"],
        "env": fetch_env(settings, profile),
        "resources": profile.fetch.resources(),
        "volumeMounts": [cache_mount],
    }
    worker_start: dict[str, str] = {"num-cpus": str(ray_cpus)}
    if profile.gpus_per_replica:
        worker_start["num-gpus"] = str(profile.gpus_per_replica)
    worker_spec: dict[str, Any] = {
        "securityContext": _pod_security(),
        "nodeSelector": dict(profile.worker_node_selector),
    }
    if profile.worker_tolerations:
        worker_spec["tolerations"] = [dict(t) for t in profile.worker_tolerations]
    worker_spec |= {
        "initContainers": [fetch_container],
        "containers": [worker_container],
        "volumes": [
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": MODEL_CACHE_CLAIM}},
            {"name": "ray-logs", "emptyDir": {}},
        ],
    }
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
                            "containers": [head_container],
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
                        "template": {"metadata": {"labels": dict(labels)}, "spec": worker_spec},
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
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def render(name: str, root: Path = ROOT) -> str:
    """The text of ``k8s/overlays/<name>/rayservice.yaml``."""
    profile = PROFILES[name]
    args = load_overlay_settings(name, root)
    manifest = rayservice(args, profile, root)
    problems = check_serve_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]), profile)
    if problems:
        raise ValueError(f"overlay {name}: invalid serveConfigV2:\n  " + "\n  ".join(problems))
    header = (
        f"GENERATED by `python -m serve_app.k8s_config --overlay {name} --write` from "
        f"k8s/overlays/{name}/settings.yaml and the {name!r} profile in serve_app/k8s_config.py "
        f"({profile.description}). Do not edit: change those and re-render; tests/k8s fail when "
        "this file and the rendering differ."
    )
    return "".join(f"# {line}\n" for line in textwrap.wrap(header, 98)) + dump_yaml(manifest)


# --------------------------------------------------------------------------------- init container


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
    """Resolve (fetch and convert packs, download hub snapshots) the models ``settings`` serve into
    the store, as ``specserve serve`` does before it starts the application."""
    from serve_app.engine.store import ModelStore

    settings = settings or load_settings()
    store = ModelStore(settings.store.cache_dir)
    paths = []
    with _exclusive(Path(settings.store.cache_dir) / ".fetch-models.lock"):
        for ref in model_refs(settings):
            path = store.resolve(ref)
            print(f"[specserve] model {ref}: {path}", flush=True)
            paths.append(path)
    return paths


# --------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.k8s_config", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", nargs="?", choices=["render", "fetch-models"], default="render")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--overlay", choices=sorted(PROFILES), help="one overlay")
    which.add_argument("--all", action="store_true", help="every overlay")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write k8s/overlays/<name>/rayservice.yaml")
    mode.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)

    if args.command == "fetch-models":
        fetch_models()
        return 0
    if not (args.overlay or args.all):
        parser.error("name an --overlay or pass --all")
    names = sorted(PROFILES) if args.all else [args.overlay]
    stale = []
    for name in names:
        text = render(name, args.root)
        target = overlay_dir(name, args.root) / "rayservice.yaml"
        if args.write:
            target.write_text(text)
            print(f"wrote {target}", file=sys.stderr)
        elif args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(str(target))
        else:
            sys.stdout.write(text)
    if stale:
        print(
            "stale (re-render with `python -m serve_app.k8s_config --all --write`): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
