"""``specserve loadtest``: run the load matrix (policy x users x workload mix) and write the report.

For every cell: start ``specserve serve`` with that policy (fresh, on the matrix's local Ray
cluster, shared statistics off so nothing carries over between cells), warm it up, read the
server's counters, run Locust headless for ``--run-time`` seconds (at most ``--max-requests``
requests; requests running at the end finish), read the counters again, stop the server. Then
compute the cell's figures (``loadtest.analysis``) and, at the end, ``report.md`` and the plots
(``loadtest.report``) in ``<out>/<UTC date and time>/``. Everything listens on 127.0.0.1.

Cells run load level by load level, every policy at one level before the next level, so slow
drift of the machine affects all policies alike. ``--until-saturation`` skips a policy's higher
load levels once one more level raised its tokens/s by less than 5%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests

from loadtest import analysis
from loadtest.chaos import RESTART_REDIS, ChaosInjector, chaos_figures, chaos_survived, injector_for
from loadtest.cluster import LocalCluster, ReplicaSampler, counter_delta, free_port
from loadtest.matrix_arguments import FIRST_POLICIES
from loadtest.progress import Progress
from loadtest.ramp import ramp_environment
from loadtest.redis_process import RedisServer, started_redis_server
from loadtest.server import ServerError, ServerProcess
from loadtest.streaming import RequestRecord
from loadtest.timeline import SpeculationTimeline
from loadtest.workloads import Conversation, load_workloads, mix_classes, mix_workloads
from policies.registry import FIXED_POLICY
from serve_app.app import APP_NAME
from serve_app.config import Settings, build_settings

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


def _policies(args: argparse.Namespace) -> list[str]:
    from policies import registered_policies

    known = list(registered_policies())
    if args.policies:
        unknown = [p for p in args.policies if p not in known]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; registered: {', '.join(known)}")
        return list(dict.fromkeys(args.policies))
    return [p for p in FIRST_POLICIES if p in known] + [p for p in known if p not in FIRST_POLICIES]


def _policy_params(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    params = {}
    for item in args.policy_params:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-params {item!r}: expected POLICY=JSON")
        params[name] = json.loads(text)
    return params


def cell_settings(
    base: Settings,
    args: argparse.Namespace,
    policy: str,
    params: dict[str, Any],
    redis_url: str | None = None,
) -> dict[str, Any]:
    """The whole settings of one cell's server (written to its settings.yaml); shared statistics
    only in ``redis_url``, a Redis of the cell's own (the restart-redis chaos cell)."""
    overrides: dict[str, Any] = {
        "model.target": args.model,
        "model.draft": args.draft_model,
        "speculation.method": args.method,
        "cache.max_slots": args.slots,
        "autoscaling.min_replicas": args.min_replicas,
        "autoscaling.max_replicas": args.max_replicas,
        "speculation.depth": args.static_depth if policy == FIXED_POLICY else None,
    }
    overrides = {key: value for key, value in overrides.items() if value is not None}
    overrides |= {
        "speculation.policy": policy,
        "speculation.policy_params": params,
        "server.host": "127.0.0.1",
        "server.port": free_port(),
        "server.api_key": None,
        "stats.redis_url": redis_url,  # every cell starts from nothing (no shared priors)
    }
    # The base's whole dump first, the cell's dotted keys over it (build_settings merges them).
    return build_settings({**base.model_dump(mode="json"), **overrides}, environment=False).model_dump(
        mode="json"
    )


def _warmup_bodies(model: str, mix: str, rounds: int, max_tokens: int) -> list[dict[str, Any]]:
    workloads = load_workloads()
    bodies = []
    for i in range(rounds):
        for name in mix_workloads(mix):
            conversation = Conversation(workloads[name], random.Random(f"warmup:{i}:{name}"))
            bodies.append(
                workloads[name].body(model, conversation.next_messages(), seed=i, max_tokens=max_tokens)
            )
    return bodies


def _run_locust(
    args: argparse.Namespace,
    server: ServerProcess,
    model: str,
    users: int,
    mix: str,
    folder: Path,
    progress: Progress,
) -> int:
    records = folder / "records.jsonl"
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{math.ceil(args.run_time)}s",
        "--stop-timeout",
        str(math.ceil(args.stop_timeout)),
        "--host",
        server.url,
        "--csv",
        str(folder / "locust"),
        "--json-file",
        str(folder / "locust_stats"),
        "--records",
        str(records),
        "--max-requests",
        str(args.max_requests),
        "--max-tokens",
        str(args.max_tokens),
        "--seed",
        str(args.seed),
        "--model",
        model,
        "--loglevel",
        "WARNING",
        "--only-summary",
        *mix_classes(mix),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if args.ramp:  # users from 1 up to this level and back over the run time (loadtest.ramp)
        env.update(ramp_environment(users, args.run_time))
    limit = args.run_time + args.stop_timeout + 120
    started = time.monotonic()
    with open(folder / "locust.log", "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while process.poll() is None:
                progress.live(records, started, args.run_time)
                if time.monotonic() - started > limit:
                    process.kill()
                    break
                time.sleep(1.0)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
            progress.end_live()
    return process.returncode


def run_cell(
    args: argparse.Namespace,
    cluster: LocalCluster,
    settings: dict[str, Any],
    policy: str,
    users: int,
    mix: str,
    folder: Path,
    progress: Progress,
    price: float,
    redis: RedisServer | None = None,
) -> tuple[analysis.CellResult, list[RequestRecord], SpeculationTimeline]:
    """Start, warm up, load, measure and stop one cell's server; its figures, records and the
    speculation counters scraped over the load (written to ``timeline.json`` in ``folder``).
    With ``--chaos``, one fault is injected during the load (``loadtest.chaos``)."""
    progress.phase("starting specserve serve")
    with ServerProcess(settings, folder, cluster.address, args.start_timeout) as server:
        model = server.model()
        progress.phase(f"ready after {server.startup_s:.0f} s; warming up")
        warm_tokens = 32 if not args.max_tokens else min(32, args.max_tokens)
        server.warm_up(_warmup_bodies(model, mix, args.warmup, warm_tokens))
        before = cluster.settled_scrape(analysis.GENERATION_TOKENS)
        progress.phase(f"load: {users} user(s), {args.run_time:.0f} s, mix {mix}")
        chaos = _chaos_injector(args, settings, redis)
        with ReplicaSampler(APP_NAME, cluster) as sampler, chaos or contextlib.nullcontext():
            load_start = time.time()
            code = _run_locust(args, server, model, users, mix, folder, progress)
            after = cluster.settled_scrape(analysis.GENERATION_TOKENS)
        records = analysis.read_records(folder / "records.jsonl")
        window = (min(r.start for r in records), max(r.end for r in records)) if records else (0.0, 0.0)
        counters = analysis.ServerCounters(
            **{
                key: counter_delta(before, after, name)
                for key, name in (
                    ("generation_tokens", analysis.GENERATION_TOKENS),
                    ("draft_tokens", analysis.DRAFT_TOKENS),
                    ("accepted_tokens", analysis.ACCEPTED_TOKENS),
                    ("requests", analysis.REQUESTS),
                )
            }
        )
        result = analysis.cell_result(
            policy, users, mix, records, counters, sampler.replica_seconds(*window), price
        )
        result.startup_s = server.startup_s
        if chaos is not None:
            result.chaos = chaos_figures(chaos.event, records)
        result.load_tokens_per_s = sampler.tokens_per_s(load_start, load_start + args.run_time)
        result.locust_requests, result.locust_tokens = analysis.locust_totals(folder / "locust_stats.json")
        if records and result.replica_seconds <= 0:
            result.errors.append("the replica count could not be read (serve.status()); cost unknown")
        if code not in (0, 1):  # 1: some requests failed (counted in the result)
            result.errors.append(f"locust exited with {code}; see {folder / 'locust.log'}")
        (folder / "timeline.json").write_text(json.dumps(sampler.timeline.to_dict()))
        progress.phase("stopping the server")
    return result, records, sampler.timeline


def run_matrix(args: argparse.Namespace, settings: Settings) -> int:
    """Run every cell, write ``cells.json`` as it goes and the report at the end; 0 if all cells ran."""
    from loadtest.report import write_report

    policies = _policies(args)
    params = _policy_params(args)
    for mix in args.mixes:
        mix_classes(mix)
    price = settings.loadtest.replica_hour_price if args.price is None else args.price
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H-%M-%SZ")
    root = Path(args.out) / stamp
    root.mkdir(parents=True, exist_ok=True)
    users_levels = sorted(set(args.users))
    cells = [(mix, users, policy) for mix in args.mixes for users in users_levels for policy in policies]
    progress = Progress(len(cells))
    probe = cell_settings(settings, args, policies[0], {})
    meta = {
        "started": stamp,
        "command": "specserve loadtest "
        + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["loadtest"] else sys.argv[1:]),
        "target": probe["model"]["target"],
        "draft_model": build_settings(probe, environment=False).model.draft,
        "method": probe["speculation"]["method"],
        "dtype": probe["runtime"]["dtype"],
        "slots": probe["cache"]["max_slots"],
        "replicas": f"{probe['autoscaling']['min_replicas']}-{probe['autoscaling']['max_replicas']}",
        "ramp": bool(args.ramp),
        "chaos": args.chaos and f"{args.chaos} at {args.chaos_at:g} of the run time",
        "warmup": args.warmup * max(len(mix_workloads(m)) for m in args.mixes),
        "run_time_s": args.run_time,
        "max_requests": args.max_requests,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "price": price,
        "policies": policies,
    }
    print(f"[loadtest] {len(cells)} cells -> {root}", flush=True)
    results: list[analysis.CellResult] = []
    records: dict[tuple[str, int, str], list[RequestRecord]] = {}
    timelines: dict[tuple[str, int, str], SpeculationTimeline] = {}
    skipped: set[tuple[str, str]] = set()
    started = time.monotonic()
    cpus = args.cpus or max(
        os.cpu_count() or 1,
        math.ceil(probe["autoscaling"]["replica_num_cpus"] * probe["autoscaling"]["max_replicas"]),
    )
    interrupted = False
    try:
        with LocalCluster(cpus) as cluster:
            # After ray.init (which sets its own SIGTERM exit): both signals unwind through the cell's
            # `with ServerProcess`, which stops the server, then the report is written.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _interrupt)
            for mix, users, policy in cells:
                progress.cell(policy, users, mix)
                if (policy, mix) in skipped:
                    progress.cell_done("skipped (saturated at a lower load)")
                    continue
                folder = root / mix / policy / f"u{users}"
                try:
                    with _cell_redis(args) as redis:
                        data = cell_settings(
                            settings, args, policy, params.get(policy, {}), redis and redis.url
                        )
                        result, cell_records, timelines[(policy, users, mix)] = run_cell(
                            args, cluster, data, policy, users, mix, folder, progress, price, redis
                        )
                except (ServerError, requests.RequestException) as exc:
                    result, cell_records = analysis.CellResult(policy, users, mix, errors=[str(exc)]), []
                results.append(result)
                records[(policy, users, mix)] = cell_records
                (folder / "cell.json").write_text(json.dumps(result.to_dict(), indent=2))
                progress.cell_done(
                    f"{result.requests} requests ({result.failures} failed), "
                    f"{result.tokens_per_s:.2f} tok/s, "
                    f"{result.cost_per_1m_tokens or 0:.2f} USD per 1M tokens"
                    + (f"; errors: {result.errors[0]}" if result.errors else "")
                )
                if args.until_saturation and analysis.saturated(results, policy, mix):
                    skipped.add((policy, mix))
    except KeyboardInterrupt:
        interrupted = True
        print("\n[loadtest] interrupted; writing the report of the cells that ran", flush=True)
    finally:
        analysis.compare_to_plain(results)
        meta["wall_s"] = time.monotonic() - started
        (root / "cells.json").write_text(
            json.dumps({"meta": meta, "cells": [r.to_dict() for r in results]}, indent=2)
        )
        if results:
            report = write_report(root, results, records, meta, timelines)
            print(f"[loadtest] report: {report}", flush=True)
    failed = [
        r
        for r in results
        if r.requests == 0 or (not chaos_survived(r.chaos) if r.chaos is not None else bool(r.errors))
    ]
    return 130 if interrupted else 1 if failed else 0


def _chaos_injector(
    args: argparse.Namespace, settings: dict[str, Any], redis: RedisServer | None
) -> ChaosInjector | None:
    """The cell's fault (``--chaos``), due ``--chaos-at`` of the run time after the load starts."""
    if not args.chaos:
        return None
    delay_s = args.chaos_at * args.run_time
    prefix = settings["stats"]["key_prefix"]
    return injector_for(args.chaos, delay_s, APP_NAME, redis, prefix, args.chaos_outage_s)


@contextlib.contextmanager
def _cell_redis(args: argparse.Namespace) -> Iterator[RedisServer | None]:
    """A redis-server of the cell's own for the restart-redis chaos cell (None otherwise)."""
    if args.chaos != RESTART_REDIS:
        yield None
        return
    with started_redis_server() as server:
        yield server


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
