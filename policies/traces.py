"""Recorded acceptance traces: what a proposer would have had accepted at every output position.

A trace is one real request replayed without a model. For each proposer it stores ``matches``:
``matches[g]`` is how many draft tokens the target accepts when drafting starts after ``g`` output
tokens of the request's greedy continuation (the first decode step is g = 0). A policy that
drafts k tokens there keeps ``min(matches[g], k)`` and moves on to ``g + kept + 1``: exact for a
deterministic proposer under greedy decoding, whatever depths the policy picks, because the
continuation itself does not depend on speculation (it is lossless).

Recording (``matches_from_steps``): run the request once per proposer at a fixed depth D (8) and
note each step's (g, drafted, accepted). A step at g with a accepted gives matches[g] = a, and the
positions it skipped over follow from it: a deterministic draft continues its own run, so
matches[g + j] = a - j for j = 1..a. When the whole draft was accepted (a = D) the true run may
be longer: the values are lower bounds, harmless when policies draft at most D.

Lookups. A proposer that knows before drafting how many tokens it would propose (n-gram,
``RequestView.draftable``) also has ``draftable[g]``: its draft length at position g (0 = no match;
then the engine never asks it, and the policy must choose something else). ``matches[g]`` is at
most ``draftable[g]``. Recorded exactly by replaying the lookup over the request's output
(``loadtest.bench.policies.lookup_trace``), with its matches.

Files: JSON ``{"format": 1, "model_pair": ..., "cost_model": {...}, "traces": [...]}``; a trace
is ``{"name", "workload", "prompt_len", "output_len", "matches": {proposer: [int, ...]}}``, with
``"draftable": {proposer: [int, ...]}`` for lookup proposers (absent in older files: no bound). The cost
model is ``FittedCostModel.to_dict()`` as measured on the machine that recorded them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1


@dataclass(frozen=True)
class StepRecord:
    """One recorded decode step of one request."""

    generated: int  # output tokens emitted before the step (0 = first decode step)
    drafted: int
    accepted: int


def matches_from_steps(steps: Iterable[StepRecord], output_len: int) -> tuple[int, ...]:
    """Per output position, the accepted-run length a draft starting there gets (see module doc)."""
    matches = [0] * max(0, output_len)
    for step in steps:
        for j in range(step.accepted + 1):
            if step.generated + j < len(matches):
                matches[step.generated + j] = step.accepted - j
    return tuple(matches)


@dataclass(frozen=True)
class RecordedTrace:
    """One request's prompt size, output size and per-proposer matches."""

    name: str
    workload: str
    prompt_len: int
    output_len: int
    matches: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    draftable: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # lookup proposers only

    def to_dict(self) -> dict:
        data = {
            "name": self.name, "workload": self.workload, "prompt_len": self.prompt_len,
            "output_len": self.output_len, "matches": {p: list(m) for p, m in self.matches.items()},
        }  # fmt: skip
        if self.draftable:
            data["draftable"] = {p: list(d) for p, d in self.draftable.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> RecordedTrace:
        matches = {str(p): tuple(int(x) for x in m) for p, m in dict(data.get("matches", {})).items()}
        for p, m in matches.items():
            if any(x < 0 for x in m):
                raise ValueError(f"trace {data.get('name')!r}: negative match length for {p!r}")
        draftable = {str(p): tuple(int(x) for x in d) for p, d in dict(data.get("draftable", {})).items()}
        for p, d in draftable.items():
            m = matches.get(p, ())
            if len(d) != len(m) or any(x > y for x, y in zip(m, d, strict=True)):
                raise ValueError(f"trace {data.get('name')!r}: {p!r} matches exceed its draftable lengths")
        return cls(str(data["name"]), str(data["workload"]), int(data["prompt_len"]),
                   int(data["output_len"]), matches, draftable)  # fmt: skip


@dataclass(frozen=True)
class TraceSet:
    """Traces recorded on one model pair, with the cost model measured beside them."""

    model_pair: str
    traces: tuple[RecordedTrace, ...]
    cost_model: Mapping[str, object] = field(default_factory=dict)
    notes: str = ""

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT, "model_pair": self.model_pair, "notes": self.notes,
            "cost_model": dict(self.cost_model), "traces": [t.to_dict() for t in self.traces],
        }  # fmt: skip
        Path(path).write_text(json.dumps(data, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TraceSet:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: trace format {data.get('format')!r}, expected {FORMAT}")
        traces = tuple(RecordedTrace.from_dict(t) for t in data["traces"])
        cost = dict(data.get("cost_model", {}))
        return cls(str(data["model_pair"]), traces, cost, str(data.get("notes", "")))

    def workloads(self) -> list[str]:
        return sorted({t.workload for t in self.traces})

    def select(self, workloads: Sequence[str]) -> list[RecordedTrace]:
        return [t for t in self.traces if t.workload in workloads]


def acceptance_priors(
    traces: Iterable[RecordedTrace], max_depth: int
) -> dict[tuple[str, str], tuple[float, ...]]:
    """Conditional acceptance per draft position, pooled per (proposer, workload) over ``traces``.

    What the shared statistics would hold after serving these requests: a draft starting at
    output position g reaches position j when ``matches[g] >= j`` and has it accepted when
    ``matches[g] > j``, so a_j = #(m > j) / #(m >= j) over every g of every trace of the class.
    Index example: matches (3, 2, 1, 0) give a_0 = 3/4, a_1 = 2/3, a_2 = 1/2. A position no draft
    reached repeats the one before it (``AcceptanceEstimator.set_prior`` pads the same way).
    For a lookup proposer (``draftable``) only drafts it could make count, as the engine only asks
    it then: position j is reached when ``matches[g] >= j`` and ``draftable[g] > j``.
    """
    reached: dict[tuple[str, str], list[int]] = {}
    accepted: dict[tuple[str, str], list[int]] = {}
    for trace in traces:
        for proposer, matches in trace.matches.items():
            key = (proposer, trace.workload)
            hits = reached.setdefault(key, [0] * max_depth), accepted.setdefault(key, [0] * max_depth)
            lengths = trace.draftable.get(proposer) or (max_depth,) * len(matches)
            for m, d in zip(matches, lengths, strict=True):
                for j in range(min(m + 1, d, max_depth)):
                    hits[0][j] += 1
                    hits[1][j] += j < m
    priors = {}
    for key, counts in reached.items():
        rates: list[float] = []
        for n, a in zip(counts, accepted[key], strict=True):
            rates.append(a / n if n else (rates[-1] if rates else 0.0))
        priors[key] = tuple(rates)
    return priors
