"""Workloads of the load test: what each simulated user asks, loaded from ``loadtest/prompts/*.yaml``.

A workload is one kind of traffic with its sampling settings (temperature, max_tokens), its
prompts, an optional system message, think time, and for chat a number of turns per conversation
with follow-up questions. A *mix* names the Locust user classes one matrix cell runs
(``MIXES``): ``mixed`` draws every request from all workloads by weight (so even one user sees
the whole mix), the others run one workload alone.

Everything here is pure (no Locust, no HTTP): the Locust file and the tests share it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
WORKLOAD_NAMES = ("chat", "code", "json", "creative", "bulk")

# Locust user class (loadtest/locustfile.py) -> the workloads its requests are drawn from.
USER_CLASSES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "ChatUser": ("chat",),
        "CodeUser": ("code",),
        "JsonUser": ("json",),
        "CreativeUser": ("creative",),
        "BulkUser": ("bulk",),
        "MixedUser": WORKLOAD_NAMES,
    }
)

# Mix name -> the Locust user classes that run it.
MIXES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "mixed": ("MixedUser",),
        "chat": ("ChatUser",),
        "code": ("CodeUser",),
        "json": ("JsonUser",),
        "creative": ("CreativeUser",),
        "bulk": ("BulkUser",),
        "structured": ("CodeUser", "JsonUser"),  # where speculation helps most
        "unstructured": ("CreativeUser", "BulkUser"),  # where it helps least
    }
)


@dataclass(frozen=True)
class Workload:
    """One kind of request traffic (see the module docstring)."""

    name: str
    description: str
    prompts: tuple[str, ...]
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    weight: float = 1.0
    system: str | None = None
    turns: int = 1
    followups: tuple[str, ...] = ()
    think_time_s: tuple[float, float] = (0.0, 0.5)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"workload {self.name!r} has no prompts")
        if self.turns > 1 and not self.followups:
            raise ValueError(f"workload {self.name!r}: {self.turns} turns need follow-up questions")
        low, high = self.think_time_s
        if not 0 <= low <= high:
            raise ValueError(
                f"workload {self.name!r}: think_time_s must be [low, high] with 0 <= low <= high"
            )

    def body(
        self, model: str, messages: list[dict[str, str]], seed: int, max_tokens: int | None = None
    ) -> dict[str, Any]:
        """The streamed chat-completion request body (OpenAI schema plus our ``speculation`` block)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": min(self.max_tokens, max_tokens) if max_tokens else self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculation": {"mode": "auto"},  # the server's policy decides (what the matrix compares)
        }
        if self.temperature > 0:
            body["top_p"] = self.top_p
            body["seed"] = seed  # same seed, same output under every policy (speculation is lossless)
        return body


@dataclass
class Conversation:
    """One user's state in one workload: the chat history of the running conversation.

    The random generator is seeded per user, so a user asks the same sequence of prompts under
    every policy of the matrix.
    """

    workload: Workload
    rng: random.Random
    history: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0

    def next_messages(self) -> list[dict[str, str]]:
        """The messages of the next request (a new conversation, or the next turn of this one)."""
        w = self.workload
        if self.turn == 0 or self.turn >= w.turns:
            self.turn = 0
            self.history = [{"role": "system", "content": w.system}] if w.system else []
            self.history.append({"role": "user", "content": self.rng.choice(w.prompts)})
        else:
            self.history.append({"role": "user", "content": self.rng.choice(w.followups)})
        self.turn += 1
        return list(self.history)

    def answered(self, text: str | None) -> None:
        """Record the assistant's answer; a failed request (None) ends the conversation."""
        if text is None or self.turn >= self.workload.turns:
            self.turn = 0
            return
        self.history.append({"role": "assistant", "content": text})

    def think_time(self) -> float:
        low, high = self.workload.think_time_s
        return self.rng.uniform(low, high)


def _workload(name: str, data: Mapping[str, Any]) -> Workload:
    known = {
        "description", "prompts", "max_tokens", "temperature", "top_p", "weight", "system", "turns",
        "followups", "think_time_s",
    }  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"prompts/{name}.yaml: unknown keys {unknown}")
    think = data.get("think_time_s", (0.0, 0.5))
    return Workload(
        name=name,
        description=str(data.get("description", name)),
        prompts=tuple(str(p).strip() for p in data["prompts"]),
        max_tokens=int(data["max_tokens"]),
        temperature=float(data["temperature"]),
        top_p=float(data.get("top_p", 1.0)),
        weight=float(data.get("weight", 1.0)),
        system=data.get("system"),
        turns=int(data.get("turns", 1)),
        followups=tuple(str(p).strip() for p in data.get("followups", ())),
        think_time_s=(float(think[0]), float(think[1])),
    )


def load_workloads(folder: Path = PROMPTS_DIR) -> dict[str, Workload]:
    """Every workload of ``WORKLOAD_NAMES`` from ``<folder>/<name>.yaml``."""
    workloads = {}
    for name in WORKLOAD_NAMES:
        path = folder / f"{name}.yaml"
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping")
        workloads[name] = _workload(name, data)
    return workloads


def mix_classes(mix: str) -> tuple[str, ...]:
    """The Locust user classes of a mix (ValueError naming the known mixes)."""
    try:
        return MIXES[mix]
    except KeyError:
        raise ValueError(f"unknown workload mix {mix!r}; known: {', '.join(MIXES)}") from None


def mix_workloads(mix: str) -> tuple[str, ...]:
    """The workloads a mix sends, in ``WORKLOAD_NAMES`` order."""
    names = {w for cls in mix_classes(mix) for w in USER_CLASSES[cls]}
    return tuple(w for w in WORKLOAD_NAMES if w in names)
