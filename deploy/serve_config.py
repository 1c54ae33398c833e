"""The serveConfigV2 document of a RayService, and its checks.

:func:`serve_config` writes the document for an overlay: ``import_path: serve_app.app:build_app``,
``args`` = the settings, and the options of both deployments exactly as
:func:`serve_app.app.deployment_options` / :func:`serve_app.app.ingress_options` compute them
(Serve gives the config's options precedence over the code's; here they are the same values),
``http_options`` from ``server.host/port``.

:func:`check_serve_config` lists every problem of such a document: Ray's schemas, unknown keys at
every level (which Ray ignores), the ``args`` as Settings, and options that differ from what the
settings give.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from deploy.profiles import ClusterProfile
from serve_app.app import (
    APP_NAME,
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    deployment_options,
    ingress_options,
)
from serve_app.config import Settings, build_settings

IMPORT_PATH = "serve_app.app:build_app"
# Options of the engine deployment that a profile may add to what deployment_options() computes,
# because Settings has no field for them yet (GPUs per replica: a follow-up for config.py).
EXTRA_ACTOR_OPTIONS = frozenset({"num_gpus"})
# Where Serve listens in a pod: every interface, so that the serve Service and the probes reach it.
ALL_INTERFACES = ("0.0.0.0", "::")


def settings_from(args: Mapping[str, Any]) -> Settings:
    """Validate an overlay's settings (nested dict) into ``Settings``, ignoring the environment:
    the rendering must not depend on the SPECSERVE_* variables of whoever runs it. An invalid
    value is a ``ValueError`` naming the field."""
    return build_settings(args, environment=False)


def serve_config(args: Mapping[str, Any], profile: ClusterProfile) -> dict[str, Any]:
    """The serveConfigV2 document for ``args`` (the settings) on ``profile``'s cluster."""
    settings = settings_from(args)
    if settings.server.host not in ALL_INTERFACES:
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


# --------------------------------------------------------------------------------- checks


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

    problems = unknown_keys(config, ServeDeploySchema)
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        problems.append(f"ServeDeploySchema: {exc}")
        return problems
    for i, app in enumerate(config.get("applications") or []):
        where = f"applications[{i}]"
        if app.get("import_path") != IMPORT_PATH:
            problems.append(f"{where}.import_path: {app.get('import_path')!r}, expected {IMPORT_PATH!r}")
        expected_by_name, problem = _expected_options(app.get("args") or {})
        if problem:
            problems.append(f"{where}.args: {problem}")
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


def _expected_options(args: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(deployment name -> the options the settings ``args`` give, the problem of the args or None)."""
    try:
        settings = settings_from(args)
    except ValueError as exc:  # build_settings' ValueError names the field
        return {}, f"not valid Settings: {exc}"
    try:
        return {
            ENGINE_DEPLOYMENT: deployment_options(settings),
            INGRESS_DEPLOYMENT: ingress_options(settings),
        }, None
    except ValueError as exc:  # e.g. autoscaling.min_replicas > max_replicas
        return {}, str(exc)


def _compare_options(
    deployment: Mapping[str, Any],
    expected: Mapping[str, Any],
    name: str,
    where: str,
    profile: ClusterProfile | None,
) -> list[str]:
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
