"""Settings: one pydantic-settings root, the single source of truth for defaults.

Every field has a description; unknown keys are errors (``extra="forbid"``). Values come from, in
order of precedence: explicit keyword arguments (the CLI), environment variables with the prefix
``SPECSERVE_`` (nested with ``__``, e.g. ``SPECSERVE_RUNTIME__DTYPE=float32``), a YAML file named by
``SPECSERVE_CONFIG``, then the defaults written here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from policies.registry import DEFAULT_POLICY, registered_policies
from serve_app.engine.proposers.registry import DEFAULT_PROPOSER, proposer_specs, registered_proposers
from serve_app.service_settings import (
    AutoscalingSettings,
    LoadtestSettings,
    ServerSettings,
    StatsSettings,
    TelemetrySettings,
    _Section,
)

OFF = "off"  # speculation.method for plain decoding
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# speculation.tree_nodes: measured in BENCHMARKS.md (twenty-fifth session)
TREE_NODES = 4


def default_cache_dir() -> Path:
    """The model store's default root: ``$XDG_CACHE_HOME/specserve`` or ``~/.cache/specserve``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specserve"


class ModelSettings(_Section):
    target: str = Field(
        DEFAULT_TARGET,
        description="Target model: a pack name (`specserve models list`), a local HF folder, or a hub id.",
    )
    draft: str | None = Field(
        DEFAULT_DRAFT,
        description="Draft model for draft-model speculation (same tokenizer as the target); null for none.",
    )


class RuntimeSettings(_Section):
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Activation (and dense weight) dtype. auto: float32 when the weights are q8 or gguf on a "
        "CPU (our kernels take float32; bf16 costs conversions), else bfloat16 (AMX / AVX-512 BF16 units).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device to run on; auto picks CUDA when present, else CPU."
    )
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; null keeps torch's default (all cores)."
    )
    weight_format: Literal["auto", "dense", "q8", "gguf"] = Field(
        "auto",
        description="The target's matrices: dense (the dtype above); q8 (int8 with a scale per 32 inputs); "
        "gguf (a model pack's own GGUF blocks: Q4_K as they are, Q6_K as q8); auto: gguf for a model pack "
        "where our kernels are built, else dense. q8 and gguf multiply with int8 activations in our "
        "compiled kernels (row-invariant, so speculation stays exact).",
    )
    batch_invariant: bool = Field(
        True,
        description="Run every product on a row count whose rows agree with any other, so that speculative "
        "output is bit-identical to plain decoding (probed at start; off only to measure its cost).",
    )


class CacheSettings(_Section):
    max_slots: int = Field(8, ge=1, description="KV slots per model, i.e. the most requests running at once.")
    max_seq_len: int = Field(
        4096, ge=16, description="Longest sequence (prompt + output + draft lookahead) a slot can hold."
    )


def _proposer_options_model() -> type[BaseModel]:
    """``speculation.proposers``: one section per registered proposer, its own options model."""
    fields: dict[str, Any] = {
        spec.name: (spec.options, Field(default_factory=spec.options, description=spec.description))
        for spec in proposer_specs()
    }
    return create_model("ProposerOptions", __base__=_Section, **fields)


ProposerOptions = _proposer_options_model()


class SpeculationSettings(_Section):
    method: str = Field(
        DEFAULT_PROPOSER,
        description="Proposer for requests that leave speculation to the server ('auto'), or 'off' for "
        "plain decoding; any registered proposer (`specserve generate --help` lists them).",
    )
    extra_proposers: list[str] = Field(
        default_factory=list,
        description="Proposers loaded beside `method` (and those every replica loads, e.g. prompt lookup), "
        "so that requests and the policy can choose them.",
    )
    proposers: ProposerOptions = Field(  # type: ignore[valid-type]
        default_factory=ProposerOptions, description="Each proposer's options, by proposer name."
    )
    policy: str = Field(
        DEFAULT_POLICY, description="Who decides each request's proposer and depth (`specserve policies`)."
    )
    policy_params: dict[str, Any] = Field(
        default_factory=dict, description="Policy-specific knobs, e.g. {'table': {1: 6, 8: 2}}."
    )
    profile_cost_model: bool = Field(
        True,
        description="Time the models when a replica starts to fit the cost model (~16 s for the Qwen "
        "pair on 2 cores; cached per hardware and model in the shared stats).",
    )
    sampling: Literal["coupled", "rejection"] = Field(
        "coupled",
        description="How sampled tokens are drawn and verified: coupled = each token is the exponential "
        "race of p under noise fixed by (seed, position), so seeded output is the same with speculation on "
        "or off; rejection = classic speculative sampling (accept with min(1, p/q)).",
    )
    depth: int = Field(6, ge=1, le=32, description="Draft tokens proposed per step.")
    max_depth: int = Field(16, ge=1, le=32, description="The deepest speculation a request may ask for.")
    tree_nodes: int = Field(
        TREE_NODES, ge=0, le=32,
        description="Alternatives a draft may add beside its chain as a token tree, verified in the same "
        "forward, where the policy finds a tree pays (0: chains only). Greedy and coupled-sampling requests "
        "with a proposer that branches (draft model, n-gram), where attention keeps trees exact (float32).",
    )  # fmt: skip

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value != OFF and value not in registered_proposers():
            raise ValueError(
                f"unknown method {value!r}; choose {OFF!r} or one of {list(registered_proposers())}"
            )
        return value

    @field_validator("extra_proposers")
    @classmethod
    def _known_proposers(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in registered_proposers()]
        if unknown:
            raise ValueError(f"unknown proposers {unknown}; registered: {list(registered_proposers())}")
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in registered_policies():
            raise ValueError(f"unknown policy {value!r}; registered: {list(registered_policies())}")
        return value

    def loaded_proposers(self) -> list[str]:
        """The proposers a replica loads: ``method``, the extras, and those every replica loads."""
        names = [self.method] if self.method != OFF else []
        names += [n for n in self.extra_proposers if n not in names]
        names += [s.name for s in proposer_specs() if s.always_load and s.name not in names]
        return names


class StoreSettings(_Section):
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Model store root: downloaded wheels, joined GGUF files and converted models.",
    )


class SamplingDefaults(_Section):
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="A request that names no max_tokens generates at most this many; null: up to the end of "
        "the model's context (vLLM's default). Always within server.max_tokens_limit and the context.",
    )


class Settings(BaseSettings):
    """The root of all settings."""

    model_config = SettingsConfigDict(
        env_prefix="SPECSERVE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    model: ModelSettings = Field(default_factory=ModelSettings, description="Which models to serve.")
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings, description="Decoder runtime.")
    cache: CacheSettings = Field(default_factory=CacheSettings, description="KV cache sizing.")
    speculation: SpeculationSettings = Field(
        default_factory=SpeculationSettings, description="Speculative decoding defaults."
    )
    store: StoreSettings = Field(default_factory=StoreSettings, description="Model store.")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults, description="Request defaults.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="HTTP server.")
    autoscaling: AutoscalingSettings = Field(
        default_factory=AutoscalingSettings, description="Engine and ingress replicas: autoscaling, overload."
    )
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings, description="Tracing.")
    stats: StatsSettings = Field(
        default_factory=StatsSettings, description="Acceptance, cost and load statistics (shared via Redis)."
    )
    loadtest: LoadtestSettings = Field(
        default_factory=LoadtestSettings, description="`specserve loadtest`: the cost report's prices."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by ``SPECSERVE_CONFIG`` (if any)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("SPECSERVE_CONFIG")
        if not path:
            return {}
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"SPECSERVE_CONFIG={path}: expected a mapping at the top level")
        return data


def build_settings(overrides: Mapping[str, Any] | None = None, *, environment: bool = True) -> Settings:
    """The one way to build ``Settings``: ``overrides`` on top of the environment, the YAML file
    named by ``SPECSERVE_CONFIG`` and the defaults (``environment=False``: on the defaults alone, as
    the KubeRay renderer needs, whoever runs it).

    ``overrides`` may mix nested sections (``{"model": {"target": "x"}}``), dotted keys
    (``{"model.target": "x"}``, what ``serve run ... model.target=x`` passes), double underscores
    (``model__target``) and bare field names where only one section has that field
    (``{"target": "x", "max_slots": 4}``).
    Errors are ``ValueError``s naming the field.
    """
    nested = _nest(overrides or {})
    try:
        return Settings(**nested) if environment else _DefaultsOnlySettings(**nested)
    except ValidationError as exc:
        raise ValueError(f"invalid settings: {exc}") from None


def _nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides in any of ``build_settings``' shapes, as nested sections."""
    owners: dict[str, list[str]] = {}
    for section, info in Settings.model_fields.items():
        for name in getattr(info.annotation, "model_fields", {}):
            owners.setdefault(name, []).append(section)
    nested: dict[str, Any] = {}

    def put(section: str, name: str, value: Any) -> None:
        current = nested.setdefault(section, {})
        if not isinstance(current, dict):  # e.g. {"model": "x", "model.target": "y"}
            raise ValueError(f"settings section {section!r} must be a mapping of its fields")
        parts = name.split(".")
        for part in parts[:-1]:  # deeper keys, e.g. speculation.proposers.ngram.max_ngram
            current = current.setdefault(part, {})
        current[parts[-1]] = value

    for key, value in overrides.items():
        key = str(key)
        section, dot, name = key.replace("__", ".").partition(".")
        if dot:
            put(section, name, value)
        elif key in Settings.model_fields and isinstance(value, Mapping):
            for name, inner in value.items():
                put(key, str(name), inner)
        elif key not in Settings.model_fields and len(owners.get(key, ())) == 1:
            put(owners[key][0], key, value)
        else:
            nested[key] = value  # unknown keys: Settings (extra="forbid") names them
    return nested


class _DefaultsOnlySettings(Settings):
    """``Settings`` from the given values and the defaults only (no environment, no YAML file)."""

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
