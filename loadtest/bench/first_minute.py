"""``specserve bench --first-minute``: a new replica's first minute, warm from Redis or cold.

Three replicas are built one after the other as Serve builds one (``build_async_engine``: the
settings' models, proposers and policy; the shared statistics in the Redis of ``stats.redis_url``):

1. ``fill``: a replica under a fresh key prefix serves the load for ``--fill-s`` seconds, so the
   cluster's statistics (acceptance per proposer and workload) are in Redis, and closes (its last
   counts sent);
2. ``warm``: a new replica under the same prefix (it reads the cluster's view before serving);
3. ``cold``: a new replica under another, empty prefix (the cold guesses, explored).

Each serves the same closed loop: ``--users`` concurrent requests, each replaced the moment it
ends, over the trace prompts in turn (``loadtest.catalogue.TRACES``), ``--max-tokens`` each, greedy.
The figures per window of ``--window-s`` seconds since the replica's first request: tokens/s (every
streamed token at its arrival), the acceptance of the requests finished in the window and their
mean draft depth (drafted / speculative steps). Warm and cold alternate over ``--repeats`` (warm
first in odd repeats, cold first in even ones); the table shows the medians. The keys written are
deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.catalogue import TRACES, Prompt
from serve_app.config import Settings

WINDOW_S = 10.0


@dataclass
class Window:
    """What one replica did in one window of its first minute."""

    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    requests: int = 0

    def add(self, other: Window) -> None:
        """Count ``other``'s figures in this one."""
        self.tokens += other.tokens
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.spec_steps += other.spec_steps
        self.requests += other.requests

    def row(self, seconds: float) -> dict[str, float | None]:
        return {
            "tok_s": self.tokens / seconds,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "depth": self.drafted / self.spec_steps if self.spec_steps else None,
            "requests": self.requests,
        }


@dataclass
class Phase:
    """One replica's run: windows from its first request on, and its start-up time."""

    name: str
    startup_s: float
    windows: list[Window] = field(default_factory=list)


def _request(prompt: Prompt, index: int, max_tokens: int) -> Any:
    from serve_app.engine.params import SamplingParams
    from serve_app.wire import GenerateRequest

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if prompt.chat:
        messages = [{"role": "user", "content": prompt.text}]
        return GenerateRequest(f"fm-{index}", sampling, messages=messages)
    return GenerateRequest(f"fm-{index}", sampling, prompt=prompt.text)


async def _closed_loop(
    engine: Any, users: int, seconds: float, max_tokens: int, window_s: float
) -> list[Window]:
    """``users`` requests at a time for ``seconds``; windows from the start (requests running at the
    end finish, and are counted in the windows where their tokens arrived)."""
    windows = [Window() for _ in range(max(1, int(seconds // window_s)))]
    start = time.monotonic()
    counter = itertools.count()

    def window(now: float) -> Window | None:
        i = int((now - start) // window_s)
        return windows[i] if i < len(windows) else None

    async def user() -> None:
        while time.monotonic() - start < seconds:
            i = next(counter)
            last = None
            async for chunk in engine.generate(_request(TRACES[i % len(TRACES)], i, max_tokens)):
                if chunk.error is not None:
                    raise RuntimeError(f"request {i} failed: {chunk.error.message}")
                if (w := window(time.monotonic())) is not None:
                    w.tokens += len(chunk.token_ids)
                last = chunk
            spec = (last.speculation if last is not None else None) or {}
            if (w := window(time.monotonic())) is not None:
                w.requests += 1
                w.drafted += int(spec.get("drafted", 0))
                w.accepted += int(spec.get("accepted", 0))
                w.spec_steps += int(spec.get("spec_steps", 0))

    await asyncio.gather(*(user() for _ in range(users)))
    return windows


def _phase(name: str, settings: Settings, args: argparse.Namespace, seconds: float) -> Phase:
    from serve_app.builder import build_async_engine

    started = time.monotonic()
    engine = build_async_engine(settings, metrics_backend="memory")
    startup = time.monotonic() - started
    try:
        print(f"[first-minute] {name}: built in {startup:.1f} s; {seconds:.0f} s of load", file=sys.stderr)
        windows = asyncio.run(_closed_loop(engine, args.users, seconds, args.max_tokens, args.window_s))
    finally:
        engine.shutdown()
    return Phase(name, startup, windows)


def _with_prefix(settings: Settings, prefix: str) -> Settings:
    stats = settings.stats.model_copy(update={"key_prefix": prefix})
    return settings.model_copy(update={"stats": stats})


def _delete_keys(url: str, prefixes: list[str]) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        for prefix in prefixes:
            keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
            if keys:
                client.delete(*keys)
    finally:
        client.close()


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _cells(label: str, rows: dict[str, dict[str, float | None]]) -> str:
    """One table line: tok/s, acceptance and depth of warm, then cold."""
    w, c = rows["warm"], rows["cold"]
    cells = [
        _fmt(w["tok_s"], "{:.1f}"), _fmt(c["tok_s"], "{:.1f}"),
        _fmt(w["acceptance"], "{:.0%}"), _fmt(c["acceptance"], "{:.0%}"),
        _fmt(w["depth"], "{:.2f}"), _fmt(c["depth"], "{:.2f}"),
    ]  # fmt: skip
    return f"| {label} | " + " | ".join(cells) + " |"


def report(phases: dict[str, list[Phase]], window_s: float) -> str:
    """The Markdown table: per window, the median over repeats of warm and cold; then the whole
    span over all repeats."""
    n = min(len(p.windows) for runs in phases.values() for p in runs)
    lines = [
        "| window | tok/s warm | tok/s cold | acceptance warm | acceptance cold | depth warm | depth cold |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = ("tok_s", "acceptance", "depth")
    for i in range(n):
        rows = {name: [p.windows[i].row(window_s) for p in runs] for name, runs in phases.items()}
        medians = {name: {k: _median([r[k] for r in rs]) for k in keys} for name, rs in rows.items()}
        lines.append(_cells(f"{i * window_s:.0f}-{(i + 1) * window_s:.0f} s", medians))
    whole = {}
    for name, runs in phases.items():
        total = Window()
        for w in (p.windows[i] for p in runs for i in range(n)):
            total.add(w)
        whole[name] = total.row(n * window_s * len(runs))
    lines.append(_cells(f"**first {n * window_s:.0f} s**", whole))
    return "\n".join(lines)


def _phase_data(phase: Phase, window_s: float) -> dict[str, Any]:
    return {"startup_s": phase.startup_s, "windows": [w.row(window_s) for w in phase.windows]}


def run_first_minute(args: argparse.Namespace, settings: Settings) -> int:
    """Fill, then warm and cold replicas in alternation; print and write the table."""
    url = settings.stats.redis_url
    if url is None:
        raise ValueError("--first-minute needs a Redis: set stats.redis_url (SPECSERVE_STATS__REDIS_URL)")
    run = uuid.uuid4().hex[:8]
    shared, empty = f"specserve-first-minute-{run}", f"specserve-first-minute-{run}-cold"
    phases: dict[str, list[Phase]] = {"warm": [], "cold": []}
    used = [shared]
    try:
        fill = _phase("fill", _with_prefix(settings, shared), args, args.fill_s)
        for repeat in range(args.repeats):
            order = ("warm", "cold") if repeat % 2 == 0 else ("cold", "warm")
            for name in order:
                prefix = shared if name == "warm" else f"{empty}-{repeat}"
                used.append(prefix)
                phases[name].append(_phase(name, _with_prefix(settings, prefix), args, args.seconds))
    finally:
        _delete_keys(url, used)
    table = report(phases, args.window_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": sys.argv, "fill": _phase_data(fill, args.window_s)}
    data |= {name: [_phase_data(p, args.window_s) for p in runs] for name, runs in phases.items()}
    (out / "first_minute.json").write_text(json.dumps(data, indent=2))
    (out / "first_minute.md").write_text(table + "\n")
    print(table)
    return 0
