"""``specserve soak``: thousands of short requests, a fifth cancelled, then: did anything leak?

One fresh ``specserve serve`` with ONE engine replica joins a local Ray cluster started here (as
``specserve loadtest`` does). Phases, each a run of :mod:`loadtest.soak_traffic` requests:

1. calibrate: ``2 x concurrency`` requests, none cancelled; their median latency is the window the
   cancel delays are drawn from (so about half the cancels close before the first token);
2. warm-up: ``--warmup`` requests with cancels, so that allocator arenas, thread pools and caches
   reach their working size before anything is measured;
3. the soak: ``--requests`` in two halves. Between phases the runner waits until the replica is
   idle (nothing running, waiting or streaming, every KV slot free) and reads what it holds
   (``EngineDeployment.stats``: free slots, RSS, threads, tracked Python objects, aborts); after the
   soak it waits ``--idle`` seconds more and reads once again.

:func:`judge` names every problem: a request that was not cancelled and was not answered in full,
a KV slot or engine entry not given back, a replica that restarted, more threads than before,
memory or Python objects still growing in the second half (the first half absorbs what warming up
grows; a leak grows in both). The report (``soak.json``, every request in ``requests.jsonl``,
the server's settings and log) goes to ``<out>/soak-<UTC time>/``; the exit status is 1 when
:func:`judge` found anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.cluster import LocalCluster, free_port
from loadtest.progress import Progress
from loadtest.server import ServerError, ServerProcess
from loadtest.soak_report import HELD, Limits, describe, judge, summarize
from loadtest.soak_traffic import Outcome, Tally, plan_request, send_all
from serve_app.app import APP_NAME, ENGINE_DEPLOYMENT
from serve_app.config import OFF, Settings, build_settings
from serve_app.engine.proposers.registry import fallback_proposer, proposer_spec, registered_proposers

REPO = Path(__file__).resolve().parent.parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``specserve soak`` flags."""
    p.add_argument("--model", help="target model (default: settings)")
    p.add_argument("--draft", dest="draft_model", help="draft model (default: settings)")
    p.add_argument("--method", choices=[OFF, *registered_proposers()], help="speculation (default: settings)")
    p.add_argument("--policy", help="speculation policy (default: settings)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], help="default: settings (auto)")
    p.add_argument("--threads", type=int, help="torch threads of the replica (default: settings)")
    p.add_argument("--slots", type=int, help="KV slots of the replica (default: settings)")
    p.add_argument("--requests", type=int, default=10_000, help="requests of the soak (default: 10000)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    p.add_argument(
        "--cancel-fraction", type=float, default=0.2, help="share the client closes (default: 0.2)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default: 16)")
    p.add_argument(
        "--warmup", type=int, default=200, help="warm-up requests, cancels included (default: 200)"
    )
    p.add_argument(
        "--idle", type=float, default=10.0, help="seconds idle before the last reading (default: 10)"
    )
    p.add_argument("--settle-timeout", type=float, default=60.0, help="seconds to wait for an idle replica")
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=Limits.rss_growth_mib,
        help=f"RSS growth allowed over the second half (default: {Limits.rss_growth_mib:g})",
    )
    p.add_argument(
        "--max-objects-per-request",
        type=float,
        default=Limits.objects_per_request,
        help="tracked Python objects per request allowed to stay over the second half "
        f"(default: {Limits.objects_per_request:g})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, sampling and cancels")
    p.add_argument("--cpus", type=int, help="CPUs of the local Ray cluster (default: the machine's)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds the server may take to start")
    p.add_argument("--out", default=str(REPO / "loadtest" / "results"), help="results root folder")


def soak_settings(base: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """The server's whole settings: one engine replica, the flags' choices, nothing shared."""
    chosen = {
        "model.target": args.model, "model.draft": args.draft_model, "speculation.method": args.method,
        "speculation.policy": args.policy, "runtime.dtype": args.dtype, "runtime.threads": args.threads,
        "cache.max_slots": args.slots,
    }  # fmt: skip
    chosen_keys = {key for key, value in chosen.items() if value is not None}
    overrides = {key: chosen[key] for key in chosen_keys} | {
        "autoscaling.min_replicas": 1, "autoscaling.max_replicas": 1, "server.host": "127.0.0.1",
        "server.port": free_port(), "server.api_key": None, "stats.redis_url": None,
    }  # fmt: skip
    merged = build_settings({**base.model_dump(mode="json"), **overrides}, environment=False)
    data = merged.model_dump(mode="json")
    # A default model of another tokenizer falls back to a proposer without a model
    # (serve_app.builder), but only while it is unset, and a replica gets its settings whole (every
    # field set): so decide that fallback here.
    method = merged.speculation.method
    role = proposer_spec(method).model_role if method != OFF else None
    ref = getattr(merged.model, role) if role else None
    if role and ref and role not in base.model.model_fields_set and f"model.{role}" not in chosen_keys:
        from serve_app.builder import model_store

        if model_store(merged).tokenizer_mismatch(merged.model.target, ref):
            data["model"][role] = None
            data["speculation"]["method"] = fallback_proposer()
    return data


class SoakProgress(Progress):
    """Phase lines, and a live count of the requests (rewritten on a terminal, every 10 s else)."""

    def __init__(self) -> None:
        super().__init__(total_cells=1)
        self.phase_started = time.monotonic()

    def start(self, text: str) -> None:
        self.phase_started = time.monotonic()
        self.phase(text)

    def tick(self, tally: Tally, total: int) -> None:
        now = time.monotonic()
        if not self.tty and now - self._last_line < self.every_s:
            return
        self._last_line = now
        elapsed = max(now - self.phase_started, 1e-9)
        text = (
            f"    {elapsed:5.0f} s: {tally.done}/{total} requests ({tally.answered} answered, "
            f"{tally.cancelled} cancelled, {tally.failed} failed), {tally.tokens} tokens, "
            f"{tally.done / elapsed:.1f} req/s"
        )
        self._print("\r" + text.ljust(110) if self.tty else text, end="" if self.tty else "\n")


class Replica:
    """The engine replica's stats through a Serve handle (the runner is a driver of the cluster)."""

    def __init__(self) -> None:
        from ray import serve

        self.handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)

    def state(self, count_objects: bool = False) -> dict[str, Any]:
        return self.handle.stats.remote(count_objects).result(timeout_s=120)

    def settled(self, timeout_s: float) -> dict[str, Any]:
        """The state once the replica is idle with every slot free (or as it is after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state()
            frees = [state["free_slots"], *state["proposer_free_slots"].values()]
            if not any(state[key] for key in HELD) and all(f == state["slots"] for f in frees):
                break
            time.sleep(0.5)
        return self.state(count_objects=True)


def _median_latency(outcomes: list[Outcome]) -> float | None:
    """The median latency of the requests answered without a planned cancel (at least 50 ms)."""
    latencies = [o.latency_s for o in outcomes if o.status == "answered" and not o.cancel_planned]
    return max(statistics.median(latencies), 0.05) if latencies else None


def run_soak(args: argparse.Namespace, base: Settings) -> int:
    """Run the soak (see the module's docstring); 0 when nothing failed or leaked."""
    settings = soak_settings(base, args)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H-%M-%SZ")
    folder = Path(args.out) / f"soak-{stamp}"
    scaling, runtime, speculation = settings["autoscaling"], settings["runtime"], settings["speculation"]
    cpus = args.cpus or max(os.cpu_count() or 1, math.ceil(scaling["replica_num_cpus"]))
    meta = {
        "started": stamp, "command": "specserve " + shlex.join(sys.argv[1:]),
        "target": settings["model"]["target"], "method": speculation["method"],
        "policy": speculation["policy"], "dtype": runtime["dtype"], "weight_format": runtime["weight_format"],
        "threads": runtime["threads"], "slots": settings["cache"]["max_slots"], "requests": args.requests,
        "concurrency": args.concurrency, "cancel_fraction": args.cancel_fraction,
        "max_tokens": args.max_tokens, "warmup": args.warmup, "seed": args.seed, "cpus": cpus,
    }  # fmt: skip

    def save(report: dict[str, Any]) -> None:  # after every reading: a stopped soak keeps its figures
        (folder / "soak.json").write_text(json.dumps({"meta": meta, **report}, indent=2))

    progress = SoakProgress()
    print(f"[soak] {args.requests} requests, {args.concurrency} in flight, {args.cancel_fraction:.0%} "
          f"cancelled, {args.max_tokens} tokens each -> {folder}", flush=True)  # fmt: skip
    with LocalCluster(cpus) as cluster:
        progress.start("starting specserve serve (one engine replica)")
        try:
            with ServerProcess(settings, folder, cluster.address, args.start_timeout) as server:
                report = _soak(args, server, Replica(), progress, save)
                progress.start("stopping the server")
        except ServerError as exc:
            print(f"[soak] {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # the server is stopped on the way out; say so, not silently
            print(f"\n[soak] interrupted; the server was stopped ({folder / 'server.log'})", flush=True)
            return 130
    save(report)
    print(describe(report), flush=True)
    return 1 if report["problems"] else 0


def _soak(
    args: argparse.Namespace,
    server: ServerProcess,
    replica: Replica,
    progress: SoakProgress,
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    model = server.model()
    progress.start(f"ready after {server.startup_s:.0f} s; calibrating the cancel window")

    def phase(name: str, count: int, cancels: float, window: float) -> tuple[list[Outcome], float]:
        plans = [
            plan_request(model, i, args.seed, name, args.max_tokens, cancels, window) for i in range(count)
        ]
        tally, started = Tally(), time.monotonic()
        outcomes = asyncio.run(
            send_all(server.url, plans, args.concurrency, tally, lambda t: progress.tick(t, count))
        )
        progress.end_live()
        return outcomes, time.monotonic() - started

    calibration, _ = phase("calibrate", 2 * args.concurrency, 0.0, 0.0)
    window = _median_latency(calibration)
    if window is None:
        raise ServerError(f"no calibration request was answered: {[o.error for o in calibration][:3]}")
    progress.start(f"warm-up: {args.warmup} requests, cancels within {window:.2f} s")
    warmup, _ = phase("warmup", args.warmup, args.cancel_fraction, window)
    window = _median_latency(warmup) or window  # warm, at full concurrency: the soak's latency
    states = {"before": replica.settled(args.settle_timeout)}
    progress.phase(f"cancels within {window:.2f} s")
    first = args.requests // 2
    outcomes: list[Outcome] = []
    tally, wall = Tally(), 0.0
    for name, count in (("half", first), ("after", args.requests - first)):
        progress.start(f"soak: {count} requests")
        done, seconds = phase(f"soak-{name}", count, args.cancel_fraction, window)
        outcomes += done
        wall += seconds
        for outcome in done:
            tally.add(outcome)
        states[name] = replica.settled(args.settle_timeout)
        partial = {"soak": summarize(outcomes, wall), "cancel_window_s": window, "states": states}
        save({"complete": False, **partial})
    progress.start(f"idle {args.idle:g} s")
    time.sleep(args.idle)
    states["idle"] = replica.state(count_objects=True)
    limits = Limits(args.max_rss_growth_mib, args.max_objects_per_request)
    short = sum(1 for o in outcomes if o.status == "answered" and o.tokens != args.max_tokens)
    problems = judge(tally, args.requests, short, states, args.requests - first, limits)
    with open(server.folder / "requests.jsonl", "w") as f:
        f.writelines(json.dumps(asdict(o)) + "\n" for o in outcomes)
    summary = summarize(outcomes, wall)
    summary["errors"] = tally.errors
    return {"complete": True, "soak": summary, "cancel_window_s": window, "states": states,
            "limits": asdict(limits), "problems": problems}  # fmt: skip
