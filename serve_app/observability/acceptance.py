"""Acceptance counts: what is counted per (model pair, proposer, workload), and how it is stored.

A key's counts are per draft position: ``drafted[j]`` drafts reached position j and ``accepted[j]``
of them were accepted there, plus ``steps`` verification steps. In Redis one bucket of one key is a
HASH of ``d{j}`` / ``a{j}`` / ``steps`` fields (see ``serve_app.observability.shared_stats``); the
index of known keys holds each key as a JSON member.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

MAX_POSITIONS = 64  # draft positions tracked per key (deeper positions are ignored)


@dataclass(frozen=True)
class AcceptanceKey:
    """What acceptance statistics are kept per, e.g. model_pair "qwen2.5-coder-1.5b-instruct|qwen2.5-
    coder-0.5b-instruct" (target|draft), proposer "draft", workload "code"."""

    model_pair: str
    proposer: str
    workload: str

    def member(self) -> str:
        """The key as a member of the Redis index (JSON)."""
        return json.dumps([self.model_pair, self.proposer, self.workload])

    @staticmethod
    def from_member(member: str) -> AcceptanceKey | None:
        """The key of an index member; None when the member is not one."""
        try:
            pair, proposer, workload = json.loads(member)
        except (ValueError, TypeError):
            return None
        if not all(isinstance(x, str) for x in (pair, proposer, workload)):
            return None
        return AcceptanceKey(pair, proposer, workload)


@dataclass(frozen=True)
class AcceptanceCounts:
    """Counts over the rolling window: ``drafted[j]`` drafts reached position j, ``accepted[j]`` of
    them were accepted there; ``steps`` verification steps. ``source``: "cluster" or "local"."""

    drafted: tuple[int, ...]
    accepted: tuple[int, ...]
    steps: int
    source: str = "local"

    def acceptance(self) -> tuple[float, ...]:
        """Conditional acceptance per position: accepted_j / drafted_j, up to the first position
        no draft reached."""
        out: list[float] = []
        for d, a in zip(self.drafted, self.accepted, strict=False):
            if d <= 0:
                break
            out.append(min(1.0, max(0.0, a / d)))
        return tuple(out)


def position_counts(drafted: int, accepted: int) -> tuple[list[int], list[int]]:
    """Per-position counts of ONE draft of ``drafted`` tokens of which the first ``accepted`` were
    accepted: (``[1] * drafted``, ``[1] * accepted + [0] * (drafted - accepted)``)."""
    drafted = max(0, drafted)
    accepted = min(max(0, accepted), drafted)
    return [1] * drafted, [1] * accepted + [0] * (drafted - accepted)


class Counts:
    """Mutable per-position counts (one key, one bucket, or a sum of them)."""

    __slots__ = ("accepted", "drafted", "steps")

    def __init__(self) -> None:
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.steps = 0

    def add(self, drafted: Sequence[int], accepted: Sequence[int], steps: int) -> None:
        n = min(max(len(drafted), len(accepted)), MAX_POSITIONS)
        if len(self.drafted) < n:
            grow = n - len(self.drafted)
            self.drafted.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for j in range(min(len(drafted), n)):
            self.drafted[j] += int(drafted[j])
        for j in range(min(len(accepted), n)):
            self.accepted[j] += int(accepted[j])
        self.steps += int(steps)

    def merge(self, other: Counts) -> None:
        self.add(other.drafted, other.accepted, other.steps)

    def fields(self) -> dict[str, int]:
        """The non-zero counts as Redis HASH fields (``d{j}``, ``a{j}``, ``steps``)."""
        out = {f"d{j}": d for j, d in enumerate(self.drafted) if d}
        out.update({f"a{j}": a for j, a in enumerate(self.accepted) if a})
        if self.steps:
            out["steps"] = self.steps
        return out

    def add_fields(self, fields: dict[str, str]) -> None:
        """Add the counts of a Redis HASH (fields that are not counts are ignored)."""
        for name, value in fields.items():
            try:
                count = int(value)
            except ValueError:
                continue
            if name == "steps":
                self.steps += count
                continue
            kind, index = name[:1], name[1:]
            if kind not in ("d", "a") or not index.isdigit() or int(index) >= MAX_POSITIONS:
                continue
            j = int(index)
            if len(self.drafted) <= j:
                grow = j + 1 - len(self.drafted)
                self.drafted.extend([0] * grow)
                self.accepted.extend([0] * grow)
            (self.drafted if kind == "d" else self.accepted)[j] += count

    def frozen(self, source: str) -> AcceptanceCounts:
        return AcceptanceCounts(tuple(self.drafted), tuple(self.accepted), self.steps, source)
