"""`specserve soak`: the leak verdict, the planned traffic, the client's cancels, and a small real soak.

The verdict (``loadtest.soak_report.judge``) is checked on hand-made replica readings: clean ones
pass, and each kind of leak (a KV slot, a draft slot, a stream, a thread, memory or objects still
growing in the second half, a restarted replica, a failed request) is named. The client's cancel is
checked against a small streaming HTTP server: closing must reach the server as a disconnect. The
slow test runs the real command on SmolLM2 (its own local Ray cluster, in a subprocess, as the
load matrix's smoke test does).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadtest.soak import soak_settings
from loadtest.soak_report import MIB, Limits, judge, summarize
from loadtest.soak_traffic import Outcome, PlannedRequest, Tally, plan_request, send_all

MODEL = "smollm2-135m-instruct"


def reading(**changes: Any) -> dict[str, Any]:
    """One clean reading of an idle replica (EngineDeployment.stats), with ``changes``."""
    state = {
        "running": 0, "waiting": 0, "streams": 0, "requests": 0, "free_slots": 8, "slots": 8,
        "proposer_free_slots": {"draft": 8}, "steps": 100, "step_failures": 0, "aborts": 10,
        "healthy": True, "pid": 42, "rss_bytes": 900 * MIB, "peak_rss_bytes": 950 * MIB, "threads": 7,
        "os_threads": 41, "open_fds": 70, "gc_objects": 1000,
    }  # fmt: skip
    return state | changes


def readings(**per_point: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Readings at the four points; the soak's first half grew memory and objects (warm-up)."""
    base = {
        "before": reading(),
        "half": reading(rss_bytes=960 * MIB, gc_objects=1800, aborts=110),
        "after": reading(rss_bytes=964 * MIB, gc_objects=1900, aborts=210),
        "idle": reading(rss_bytes=964 * MIB, gc_objects=1900, aborts=210),
    }
    return {point: base[point] | per_point.get(point, {}) for point in base}


def tally(answered: int = 800, cancelled: int = 200, failed: int = 0, errors: dict | None = None) -> Tally:
    done = answered + cancelled + failed
    return Tally(done, answered, cancelled, failed, tokens=16 * answered, errors=errors or {})


def verdict(states: dict, counts: Tally | None = None, short: int = 0, sent: int = 1000) -> list[str]:
    return judge(counts or tally(), sent, short, states, 500, Limits())


def test_a_clean_soak_passes_though_warm_up_grew_memory_in_the_first_half() -> None:
    assert verdict(readings()) == []


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"after": {"free_slots": 7}}, "KV slots leaked: 8 of 8 free before, 7 after"),
        ({"after": {"proposer_free_slots": {"draft": 6}}}, "draft KV slots of 'draft' leaked"),
        ({"after": {"streams": 1}}, "the idle engine still holds {'streams': 1}"),
        (
            {"after": {"requests": 2, "running": 1}},
            "the idle engine still holds {'running': 1, 'requests': 2}",
        ),
        ({"idle": {"threads": 9}}, "Python threads grew from 7 to 9"),
        ({"after": {"rss_bytes": 1100 * MIB}}, "RSS grew by 140.0 MiB over the second half"),
        ({"after": {"gc_objects": 5000}}, "tracked Python objects grew by 6.40 per request"),
        ({"idle": {"pid": 43}}, "the replica restarted"),
        ({"after": {"step_failures": 1}}, "engine steps failed"),
        ({"after": {"aborts": 500}}, "the engine aborted 490 requests, more than the 200"),
    ],
)
def test_each_kind_of_leak_is_named(changes: dict, named: str) -> None:
    problems = verdict(readings(**changes))
    assert len(problems) == 1 and named in problems[0], problems


def test_requests_not_answered_in_full_are_named() -> None:
    failed = tally(answered=799, failed=1, errors={"HTTP 503 overloaded": 1})
    assert verdict(readings(), failed) == [
        "1 requests that were not cancelled failed: {'HTTP 503 overloaded': 1}"
    ]
    assert verdict(readings(), short=3) == ["3 answered requests carried fewer tokens than max_tokens"]
    assert verdict(readings(), sent=1001) == ["1 of 1001 requests got no outcome"]


def test_summary_tells_cancels_before_the_first_token_from_mid_stream() -> None:
    outcomes = [
        Outcome(0, "answered", tokens=16, ttft_s=0.1, latency_s=0.5),
        Outcome(1, "answered", tokens=16, ttft_s=0.2, latency_s=0.7, cancel_planned=True),
        Outcome(2, "cancelled", tokens=0, latency_s=0.05),
        Outcome(3, "cancelled", tokens=5, latency_s=0.3),
        Outcome(4, "failed", error="HTTP 500 server_error"),
    ]
    summary = summarize(outcomes, wall_s=2.0)
    assert (summary["answered"], summary["cancelled"], summary["failed"]) == (2, 2, 1)
    assert (summary["cancelled_before_first_token"], summary["cancelled_mid_stream"]) == (1, 1)
    assert summary["cancel_too_late"] == 1 and summary["tokens"] == 32 and summary["requests_per_s"] == 2.5
    assert summary["latency_s"] == {"p50": 0.5, "p90": 0.7, "p99": 0.7}


def test_planned_requests_are_seeded_varied_and_cancel_the_asked_share() -> None:
    plans = [plan_request("m", i, 7, "soak", 16, 0.2, 1.5) for i in range(2000)]
    assert plans == [plan_request("m", i, 7, "soak", 16, 0.2, 1.5) for i in range(2000)]  # seeded
    assert plans != [plan_request("m", i, 8, "soak", 16, 0.2, 1.5) for i in range(2000)]
    cancels = [p.cancel_after_s for p in plans if p.cancel_after_s is not None]
    assert 0.17 < len(cancels) / len(plans) < 0.23 and all(0 <= c <= 1.5 for c in cancels)
    assert {p.path for p in plans} == {"/v1/completions", "/v1/chat/completions"}
    assert all(p.body["max_tokens"] == 16 and p.body["stream"] and p.body["ignore_eos"] for p in plans)
    words = {len(str(p.body.get("prompt") or p.body["messages"][0]["content"]).split()) for p in plans}
    assert min(words) < 8 and max(words) > 35 and len(words) > 20  # short prompts of many lengths


def test_the_server_is_one_replica_and_a_default_draft_of_another_tokenizer_falls_back() -> None:
    from serve_app.config import build_settings
    from serve_app.engine.proposers.registry import fallback_proposer
    from specserve.cli import build_parser

    base = build_settings({}, environment=False)  # the Qwen pair: draft-model speculation
    args = build_parser().parse_args(["soak", "--model", MODEL, "--threads", "1", "--slots", "4"])
    data = soak_settings(base, args)
    assert data["autoscaling"]["min_replicas"] == data["autoscaling"]["max_replicas"] == 1
    assert (data["runtime"]["threads"], data["cache"]["max_slots"]) == (1, 4)
    assert data["stats"]["redis_url"] is None and data["server"]["api_key"] is None
    # The replica would refuse the Qwen draft for SmolLM2 (its settings arrive whole): as `serve` does.
    assert data["model"]["draft"] is None and data["speculation"]["method"] == fallback_proposer()
    chosen = soak_settings(base, build_parser().parse_args(["soak", "--model", MODEL, "--draft", MODEL]))
    assert chosen["model"]["draft"] == MODEL and chosen["speculation"]["method"] == base.speculation.method


async def _serve_slow_stream(seen: dict[str, int]) -> tuple[web.AppRunner, str]:
    """A server streaming 20 completion chunks 50 ms apart; it counts the requests it started,
    finished, and lost to a client that left."""

    async def handler(request: web.Request) -> web.StreamResponse:
        seen["started"] += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(20):
                await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                await asyncio.sleep(0.05)
            usage = {"choices": [], "usage": {"completion_tokens": 20}}
            await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            seen["left"] += 1
            raise
        seen["finished"] += 1
        return response

    return await _serve_completions(handler)


async def _serve_completions(handler: Any) -> tuple[web.AppRunner, str]:
    """A local server answering ``POST /v1/completions`` with ``handler``: its runner and URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_a_cancel_closes_the_connection_and_the_server_sees_the_client_go() -> None:
    seen = {"started": 0, "finished": 0, "left": 0}

    async def run() -> list[Outcome]:
        runner, url = await _serve_slow_stream(seen)
        try:
            requests = [
                PlannedRequest(0, "/v1/completions", {"prompt": "a"}, None),
                PlannedRequest(1, "/v1/completions", {"prompt": "b"}, 0.3),  # mid-stream
                PlannedRequest(2, "/v1/completions", {"prompt": "c"}, 0.0),  # before anything
            ]
            outcomes = await send_all(url, requests, concurrency=3, tally=Tally())
            for _ in range(100):  # the server notices a closed socket at its next write
                if seen["finished"] + seen["left"] == seen["started"]:
                    break
                await asyncio.sleep(0.05)
            return outcomes
        finally:
            await runner.cleanup()

    answered, mid, early = asyncio.run(run())
    assert (answered.status, answered.tokens, answered.error) == ("answered", 20, None)
    assert mid.status == "cancelled" and 1 <= mid.tokens < 20
    assert early.status == "cancelled" and early.tokens == 0
    # Each cancelled request that reached the server was cut there (the early one may not have).
    assert seen["finished"] == 1 and seen["left"] == seen["started"] - 1 >= 1


def test_an_error_answer_is_a_failure_with_its_code() -> None:
    async def run() -> Outcome:
        async def refuse(request: web.Request) -> web.Response:
            return web.json_response({"error": {"code": "overloaded", "type": "x"}}, status=503)

        runner, url = await _serve_completions(refuse)
        try:
            async with aiohttp.ClientSession() as session:
                from loadtest.soak_traffic import send_one

                plan = PlannedRequest(0, "/v1/completions", {"prompt": "a"}, None)
                return await send_one(session, url, plan)
        finally:
            await runner.cleanup()

    outcome = asyncio.run(run())
    assert (outcome.status, outcome.error) == ("failed", "HTTP 503 overloaded")


@pytest.mark.slow
@pytest.mark.pack(MODEL)
def test_a_small_soak_answers_every_request_and_leaks_nothing(tmp_path: Path, smollm2_path: Path) -> None:
    command = [
        sys.executable, "-m", "specserve.cli", "soak", "--model", MODEL, "--requests", "200",
        "--warmup", "32", "--concurrency", "8", "--slots", "4", "--threads", "1", "--max-tokens", "12",
        "--idle", "3", "--out", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    report = json.loads((folder / "soak.json").read_text())
    soak, states = report["soak"], report["states"]
    assert report["problems"] == []
    assert soak["sent"] == 200 and soak["failed"] == 0 and soak["answered"] + soak["cancelled"] == 200
    assert soak["cancelled"] >= 10  # ~40 planned; those that outran their cancel were answered
    assert soak["tokens"] == 12 * soak["answered"]
    before, after, idle = states["before"], states["after"], states["idle"]
    assert after["free_slots"] == before["free_slots"] == after["slots"] == 4
    assert idle["threads"] <= before["threads"] and after["requests"] == after["streams"] == 0
    assert 0 < after["aborts"] - before["aborts"] <= soak["cancelled"]
    assert (after["rss_bytes"] - states["half"]["rss_bytes"]) / MIB < Limits().rss_growth_mib
    lines = (folder / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 200 and "[soak] no failure, no leak" in run.stdout
