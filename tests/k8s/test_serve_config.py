"""The RayService encodes the settings that `specserve serve` uses: one source of truth.

serveConfigV2's ``args`` are the overlay's settings; its deployment options are exactly what
``serve_app.app.deployment_options`` / ``ingress_options`` compute from them; the cluster's shape
(worker pods, CPUs, GPUs, port, cache volume) follows them; the pods' SPECSERVE_* variables are
real Settings fields; and the committed files equal what ``deploy.kuberay`` renders.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from deploy import kuberay, manifest, profiles
from deploy.fetch_models import fetch_models
from deploy.serve_config import check_serve_config, settings_from
from serve_app.app import (
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    build_app,
    deployment_options,
    ingress_options,
)
from serve_app.builder import models_needed
from serve_app.config import Settings, build_settings
from tests.k8s.helpers import K8S, OVERLAYS, REPO, find, pod_templates


def deployments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (app,) = config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def containers(rayservice: dict[str, Any], group: str, init: bool = False) -> list[dict[str, Any]]:
    spec = pod_templates(rayservice)[group]["spec"]
    return spec.get("initContainers" if init else "containers", [])


def env_dict(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def specserve_env(container: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in env_dict(container).items() if k.startswith("SPECSERVE_")}


# --------------------------------------------------------------------------------- Ray's schemas


def test_serve_config_validates_with_rays_schemas(serve_config: dict[str, Any], overlay: str) -> None:
    ServeDeploySchema.model_validate(serve_config)
    engine = deployments(serve_config)[ENGINE_DEPLOYMENT]
    AutoscalingConfig.model_validate(engine["autoscaling_config"])
    assert check_serve_config(serve_config, profiles.PROFILES[overlay]) == []


def test_serve_config_imports_build_app(serve_config: dict[str, Any]) -> None:
    (app,) = serve_config["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    assert app["name"] == "specserve" and app["route_prefix"] == "/"
    assert set(deployments(serve_config)) == {ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT}


# --------------------------------------------------------------------------------- one source of truth


def test_args_are_the_overlay_settings(serve_config: dict[str, Any], overlay_args: dict[str, Any]) -> None:
    (app,) = serve_config["applications"]
    assert app["args"] == overlay_args
    Settings(**app["args"])  # valid Settings (unknown keys would be errors)


def test_engine_options_are_deployment_options_of_the_args(
    serve_config: dict[str, Any], overlay: str, clean_env: pytest.MonkeyPatch
) -> None:
    (app,) = serve_config["applications"]
    expected = deployment_options(Settings(**app["args"]))
    engine = deployments(serve_config)[ENGINE_DEPLOYMENT]
    assert {k: v for k, v in engine.items() if k != "name"}.keys() == expected.keys()
    for option, value in expected.items():
        if option != "ray_actor_options":
            assert engine[option] == value, option
    actor = dict(engine["ray_actor_options"])
    gpus = profiles.PROFILES[overlay].gpus_per_replica
    # Settings has no GPU field yet: the profile adds num_gpus, and nothing else
    if gpus and "num_gpus" not in expected["ray_actor_options"]:
        assert actor.pop("num_gpus") == gpus
    assert actor == expected["ray_actor_options"]


def test_ingress_options_are_ingress_options_of_the_args(
    serve_config: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    (app,) = serve_config["applications"]
    ingress = deployments(serve_config)[INGRESS_DEPLOYMENT]
    assert {k: v for k, v in ingress.items() if k != "name"} == ingress_options(Settings(**app["args"]))


def test_http_options_follow_server_settings(
    serve_config: dict[str, Any], rayservice: dict[str, Any]
) -> None:
    (app,) = serve_config["applications"]
    server = Settings(**app["args"]).server
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": server.port}
    assert server.host == "0.0.0.0"
    for group in pod_templates(rayservice):
        ports = {p["name"]: p["containerPort"] for p in containers(rayservice, group)[0]["ports"]}
        assert ports["serve"] == server.port, group


def test_build_app_accepts_the_args_with_the_pods_env_and_starts_nothing(
    serve_config: dict[str, Any], rayservice: dict[str, Any], overlay: str, clean_env: pytest.MonkeyPatch
) -> None:
    """What Serve does in the cluster: build_app(args) with the Ray containers' environment."""
    import ray
    from ray import serve

    was_initialized = ray.is_initialized()
    for name, value in specserve_env(containers(rayservice, "head")[0]).items():
        clean_env.setenv(name, value)
    (app,) = serve_config["applications"]
    application = build_app(app["args"])
    assert isinstance(application, serve.Application)
    assert ray.is_initialized() == was_initialized  # building an Application starts no Ray
    settings = build_settings(app["args"])
    engine = deployments(serve_config)[ENGINE_DEPLOYMENT]
    assert deployment_options(settings)["autoscaling_config"] == engine["autoscaling_config"]
    # The settings the replicas receive: env for the endpoints, args for everything else.
    bound = getattr(application, "_bound_deployment", None)
    if bound is None:
        pytest.skip("this Ray's Application hides its bound deployment")
    replica_settings = Settings(**bound.init_args[1])
    assert replica_settings.telemetry.otlp_endpoint == manifest.OTLP_ENDPOINT
    if "stats" in Settings.model_fields:
        assert replica_settings.stats.redis_url == manifest.REDIS_URL
    assert replica_settings.model == build_settings(app["args"]).model


# --------------------------------------------------------------------------------- environment


def test_pod_env_vars_are_settings_fields(rayservice: dict[str, Any], clean_env: pytest.MonkeyPatch) -> None:
    for group in pod_templates(rayservice):
        for container in containers(rayservice, group) + containers(rayservice, group, init=True):
            for name, value in specserve_env(container).items():
                section, _, field = name.removeprefix("SPECSERVE_").lower().partition("__")
                if section not in Settings.model_fields:
                    # `stats` (SPECSERVE_STATS__REDIS_URL) comes with the shared-statistics change;
                    # until Settings has it, the variable is inert and cannot be checked here.
                    assert name == "SPECSERVE_STATS__REDIS_URL", name
                    continue
                section_model = Settings.model_fields[section].annotation
                assert field in section_model.model_fields, f"{name}: no settings field {section}.{field}"
                clean_env.setenv(name, value)
                loaded = getattr(getattr(Settings(), section), field)
                assert str(loaded) == value, name
                clean_env.delenv(name)


def test_ray_env_sets_nothing_the_args_set(serve_config: dict[str, Any], rayservice: dict[str, Any]) -> None:
    """Args take precedence over the environment, so an overlapping variable would be dead."""
    (app,) = serve_config["applications"]
    given = {f"SPECSERVE_{s}__{f}".upper() for s, fields in app["args"].items() for f in fields}
    for group in pod_templates(rayservice):
        assert not given & set(specserve_env(containers(rayservice, group)[0])), group


def test_every_ray_container_has_the_same_env(rayservice: dict[str, Any]) -> None:
    """Serve builds the application (build_app, reading the environment) on any node."""
    envs = [containers(rayservice, group)[0]["env"] for group in pod_templates(rayservice)]
    assert all(env == envs[0] for env in envs)
    names = {e["name"] for e in envs[0]}
    assert {"SPECSERVE_STATS__REDIS_URL", "SPECSERVE_TELEMETRY__OTLP_ENDPOINT"} <= names


def test_fetch_init_container_fetches_the_served_models(
    serve_config: dict[str, Any], rayservice: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    (app,) = serve_config["applications"]
    served = Settings(**app["args"])
    (fetch,) = containers(rayservice, manifest.WORKER_GROUP, init=True)
    assert fetch["command"] == ["python", "-m", "deploy.kuberay", "fetch-models"]
    for name, value in specserve_env(fetch).items():
        clean_env.setenv(name, value)
    fetched = Settings()
    assert models_needed(fetched) == models_needed(served)
    assert fetched.store.cache_dir == served.store.cache_dir


def test_fetch_init_container_fetches_the_models_of_extra_proposers(
    overlay: str, overlay_args: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    """A replica that speculates with a model-free proposer but also loads one that drafts with a
    model (``extra_proposers``): the init container fetches that model too."""
    from serve_app.engine.proposers.registry import fallback_proposer, proposer_specs

    with_model = [s.name for s in proposer_specs() if s.model_role]
    speculation = {
        **overlay_args["speculation"],
        "method": fallback_proposer(),
        "extra_proposers": with_model,
    }
    args = {**overlay_args, "speculation": speculation}
    served = settings_from(args)
    assert len(models_needed(served)) > 1  # the target and the extra proposers' models
    rendered = manifest.rayservice(args, profiles.PROFILES[overlay], kuberay.project_version())
    (fetch,) = containers(rendered, manifest.WORKER_GROUP, init=True)
    for name, value in specserve_env(fetch).items():
        clean_env.setenv(name, value)
    assert models_needed(Settings()) == models_needed(served)


# --------------------------------------------------------------------------------- cluster shape


def test_worker_group_follows_autoscaling_settings(
    serve_config: dict[str, Any], rayservice: dict[str, Any]
) -> None:
    """One engine replica per worker pod: the group spans min..max replicas, each pod offers
    exactly the CPUs (and GPUs) a replica reserves, the head none (no replica lands there)."""
    (app,) = serve_config["applications"]
    settings = Settings(**app["args"])
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] == settings.autoscaling.min_replicas == group["replicas"]
    assert group["maxReplicas"] == settings.autoscaling.max_replicas
    actor = deployments(serve_config)[ENGINE_DEPLOYMENT]["ray_actor_options"]
    cpus = int(group["rayStartParams"]["num-cpus"])
    assert cpus >= actor["num_cpus"] and cpus < 2 * actor["num_cpus"]  # room for one replica only
    assert cpus == math.ceil(settings.autoscaling.replica_num_cpus)
    (worker,) = containers(rayservice, group["groupName"])
    assert worker["resources"]["limits"]["cpu"] == str(cpus)
    gpus = worker["resources"]["limits"].get("nvidia.com/gpu", 0)
    assert gpus == actor.get("num_gpus", 0) == int(group["rayStartParams"].get("num-gpus", 0))
    assert (gpus > 0) == (settings.runtime.device == "cuda")


def test_model_cache_volume_is_the_store(
    serve_config: dict[str, Any], rayservice: dict[str, Any], overlay: str
) -> None:
    (app,) = serve_config["applications"]
    cache_dir = str(Settings(**app["args"]).store.cache_dir)
    spec = pod_templates(rayservice)[manifest.WORKER_GROUP]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == manifest.MODEL_CACHE_CLAIM
    for container in spec["containers"] + spec["initContainers"]:
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["model-cache"] == cache_dir, container["name"]
        assert env_dict(container)["HF_HOME"].startswith(cache_dir + "/"), container["name"]
    assert spec["securityContext"]["fsGroup"] == manifest.RAY_UID  # the image's user can write


def test_endpoints_point_at_the_base_services(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    redis = urlparse(manifest.REDIS_URL)
    assert redis.scheme == "redis"
    redis_service = find(docs, "Service", redis.hostname)
    assert redis.port in [p["port"] for p in redis_service["spec"]["ports"]]

    otlp = urlparse(manifest.OTLP_ENDPOINT)
    collector = find(docs, "Service", otlp.hostname)
    ports = {p["name"]: p["port"] for p in collector["spec"]["ports"]}
    args = yaml.safe_load((K8S / "overlays" / overlay / "settings.yaml").read_text())
    protocol = Settings(**args).telemetry.otlp_protocol
    assert otlp.port == ports[f"otlp-{protocol}"]
    config = yaml.safe_load(find(docs, "ConfigMap", "specserve-otel-collector")["data"]["collector.yaml"])
    assert config["receivers"]["otlp"]["protocols"][protocol]["endpoint"].endswith(f":{otlp.port}")
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"] and "debug" in traces["exporters"]
    assert all(e in config["exporters"] for e in traces["exporters"])
    backend = config["exporters"]["otlp/backend"]["endpoint"]
    assert backend == "${env:BACKEND_OTLP_ENDPOINT}"
    collector_pod = find(docs, "Deployment", "specserve-otel-collector")["spec"]["template"]["spec"]
    (container,) = collector_pod["containers"]
    source = {e["name"]: e for e in container["env"]}["BACKEND_OTLP_ENDPOINT"]["valueFrom"]["configMapKeyRef"]
    assert find(docs, "ConfigMap", source["name"])["data"][source["key"]]


def test_image_is_the_project_version(rayservice: dict[str, Any], overlay: str) -> None:
    version = kuberay.project_version()
    suffix = profiles.PROFILES[overlay].image_tag_suffix
    for group in pod_templates(rayservice):
        for container in containers(rayservice, group) + containers(rayservice, group, init=True):
            assert container["image"] == f"specserve:{version}{suffix}"


# --------------------------------------------------------------------------------- drift


@pytest.mark.parametrize("name", OVERLAYS)
def test_committed_rayservice_is_the_rendering(name: str) -> None:
    committed = (K8S / "overlays" / name / "rayservice.yaml").read_text()
    fix = f"python -m deploy.kuberay --overlay {name} --write"
    assert committed == kuberay.render(name), f"k8s/overlays/{name}/rayservice.yaml is stale: {fix}"


def test_cli_prints_the_rendering(capsys: pytest.CaptureFixture[str]) -> None:
    assert kuberay.main(["--overlay", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out == kuberay.render("cpu")
    assert yaml.safe_load(out)["kind"] == "RayService"


def test_check_detects_a_hand_edited_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "repo"
    shutil.copytree(K8S, root / "k8s")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    assert kuberay.main(["--all", "--check", "--root", str(root)]) == 0
    target = root / "k8s" / "overlays" / "cpu" / "rayservice.yaml"
    target.write_text(target.read_text().replace("max_ongoing_requests: 10", "max_ongoing_requests: 99"))
    assert kuberay.main(["--all", "--check", "--root", str(root)]) == 1
    assert "stale" in capsys.readouterr().err
    # a settings change re-renders the whole RayService consistently
    settings = root / "k8s" / "overlays" / "cpu" / "settings.yaml"
    settings.write_text(settings.read_text().replace("max_replicas: 4", "max_replicas: 6"))
    assert kuberay.main(["--overlay", "cpu", "--write", "--root", str(root)]) == 0
    rendered = yaml.safe_load(target.read_text())
    assert rendered["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] == 6
    engine = deployments(yaml.safe_load(rendered["spec"]["serveConfigV2"]))[ENGINE_DEPLOYMENT]
    assert engine["autoscaling_config"]["max_replicas"] == 6


def test_rendering_ignores_the_callers_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SPECSERVE_CACHE__MAX_SLOTS", "3")
    clean_env.setenv("SPECSERVE_AUTOSCALING__MAX_REPLICAS", "9")
    assert kuberay.render("cpu") == (K8S / "overlays" / "cpu" / "rayservice.yaml").read_text()


# --------------------------------------------------------------------------------- init container


def test_fetch_models_resolves_target_and_draft(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    from serve_app import builder

    resolved: list[str] = []

    class FakeStore:
        def __init__(self, root: Path) -> None:
            assert Path(root) == tmp_path

        def resolve(self, ref: str) -> Path:
            resolved.append(ref)
            return tmp_path / ref

    monkeypatch.setattr(builder, "ModelStore", FakeStore)  # what model_store builds
    clean_env.setenv("SPECSERVE_STORE__CACHE_DIR", str(tmp_path))
    clean_env.setenv("SPECSERVE_MODEL__TARGET", "t")
    clean_env.setenv("SPECSERVE_MODEL__DRAFT", "d")
    assert kuberay.main(["fetch-models"]) == 0
    assert resolved == ["t", "d"]
    clean_env.setenv("SPECSERVE_SPECULATION__METHOD", "ngram")  # no draft model to fetch
    assert fetch_models() == [tmp_path / "t"]


def test_both_overlays_are_profiled() -> None:
    assert set(profiles.PROFILES) == set(OVERLAYS)


def test_a_self_speculative_replica_needs_no_draft_model(
    overlay: str, overlay_args: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    """`model.draft: null` with `speculation.method: self`: the overlay renders and validates, the
    init container fetches the target only, and the engine loads the self-speculative proposer."""
    from deploy.serve_config import serve_config as build_serve_config
    from serve_app.builder import engine_config, model_store, proposer_options

    args = {**overlay_args, "model": {**overlay_args["model"], "draft": None},
            "speculation": {**overlay_args.get("speculation", {}), "method": "self"}}  # fmt: skip
    profile = profiles.PROFILES[overlay]
    config = build_serve_config(args, profile)
    ServeDeploySchema.model_validate(config)
    assert check_serve_config(config, profile) == []
    version = kuberay.project_version()
    (fetch,) = containers(manifest.rayservice(args, profile, version), manifest.WORKER_GROUP, init=True)
    env = specserve_env(fetch)
    assert "SPECSERVE_MODEL__DRAFT" not in env and env["SPECSERVE_SPECULATION__METHOD"] == "self"
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert models_needed(Settings()) == [args["model"]["target"]]
    settings = settings_from(args)
    engine = engine_config(settings, *proposer_options(settings, model_store(settings)))
    assert engine.spec_method == "self" and set(engine.proposer_options) == {"self", "ngram"}
