"""What ``specserve bench`` measures: a method, its timed runs, the whole result the reports read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench.sweeps import CostCurve, Sweep
from loadtest.catalogue import Prompt


@dataclass(frozen=True)
class Run:
    """One timed generation of one method."""

    token_ids: list[int]
    seconds: float  # whole request, prefill included
    decode_seconds: float | None = None  # after the first token, where the method can tell
    drafted: int | None = None  # speculation (our speculative methods only): draft tokens verified
    accepted: int | None = None  # draft tokens the target kept
    spec_steps: int | None = None  # decode steps that verified a non-empty draft
    drafted_at: tuple[int, ...] = ()  # [j]: drafts verified at draft position j + 1
    accepted_at: tuple[int, ...] = ()  # [j]: of those, the ones the target kept
    draft_seconds: float | None = None  # in the proposers' ``propose`` (admission prefills not included)
    draft_calls: int | None = None  # ``propose`` calls: one per step that drafted


@dataclass(frozen=True)
class Method:
    """A way to generate: ``run(prompt ids) -> Run``; ``close()`` frees what it holds."""

    name: str
    run: Callable[[list[int]], Run]
    close: Callable[[], None] = lambda: None
    description: str = ""  # one line for the report


@dataclass
class PromptResult:
    """Every timed run of every method on one prompt."""

    prompt: Prompt
    prompt_tokens: int
    runs: dict[str, list[Run]] = field(default_factory=dict)  # method -> timed runs (no warm-up)


@dataclass
class BenchResult:
    """A whole benchmark run: what the report builders (``loadtest.bench.report``) read."""

    command: list[str]
    model: str
    dtype: str
    max_tokens: int
    repeats: int
    methods: list[str]  # in report order; specserve-plain (else the first) is the identity reference
    prompts: list[PromptResult]
    bytes_per_token: int  # weights read per decoded token (``loadtest.bench.machine``), base engine
    kv_bytes_per_position: int  # KV cache bytes read per context position per decoded token
    copy_bandwidth: float  # bytes/s, read + write
    machine: dict[str, Any]
    draft: str | None = None  # the draft model, when a method or the sweep used it
    method_notes: dict[str, str] = field(default_factory=dict)  # method -> what exactly it runs
    sweep: Sweep | None = None
    cost_curve: CostCurve | None = None
    # method -> the bytes its own target reads per token where its weight format differs (``+gguf``)
    method_bytes: dict[str, int] = field(default_factory=dict)
    server_path: list[dict[str, Any]] | None = None  # ``loadtest.bench.server_path`` rows


def write_table(out: str, prefix: str, markdown: str, rows: list[dict[str, Any]]) -> Path:
    """Write a side measurement's Markdown and JSON (with the command) into ``out``; print the
    Markdown. Returns the Markdown file's path."""
    import json
    import sys
    import time

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    (folder / f"{stem}.md").write_text(markdown)
    (folder / f"{stem}.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    print(markdown)
    return folder / f"{stem}.md"
