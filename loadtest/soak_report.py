"""The soak's figures and verdict: what a phase's outcomes add up to, and what counts as a leak.

:func:`judge` compares the replica's stats (``EngineDeployment.stats``, see
``serve_app.observability.replica_state``) read at four points: ``before`` the soak (after the
warm-up), after its first ``half``, ``after`` its second half (each once the replica is idle), and
after an ``idle`` period. Memory and Python objects are judged over the second half only: the
first absorbs what warming up still grows, a leak grows in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loadtest.soak_traffic import Outcome, Tally

MIB = 1024 * 1024
HELD = ("running", "waiting", "streams", "requests")  # engine holdings that must be 0 when idle


@dataclass(frozen=True)
class Limits:
    """How much the replica may grow over the soak's second half (warm-up growth is over by then)."""

    rss_growth_mib: float = 48.0
    objects_per_request: float = 0.5  # tracked Python objects; a leak holds several per request
    thread_growth: int = 0


def judge(
    tally: Tally, sent: int, short: int, states: dict[str, dict[str, Any]], half: int, limits: Limits
) -> list[str]:
    """Every problem the soak shows, in words (empty: no failure, no leak).

    ``states``: the replica's stats at ``before`` (after warm-up), ``half``, ``after`` and ``idle``;
    ``half``: requests of the second half; ``short``: answered requests with fewer tokens than asked.
    """
    problems = []
    before, mid, after, idle = (states[k] for k in ("before", "half", "after", "idle"))
    if tally.failed:
        problems.append(f"{tally.failed} requests that were not cancelled failed: {tally.errors}")
    if tally.done != sent:
        problems.append(f"{sent - tally.done} of {sent} requests got no outcome")
    if short:
        problems.append(f"{short} answered requests carried fewer tokens than max_tokens")
    if len({s["pid"] for s in states.values()}) > 1:
        problems.append(f"the replica restarted: pids {[s['pid'] for s in states.values()]}")
    if after["free_slots"] != before["free_slots"] or after["free_slots"] != after["slots"]:
        problems.append(
            f"KV slots leaked: {before['free_slots']} of {before['slots']} free before, "
            f"{after['free_slots']} after"
        )
    for name, free in after["proposer_free_slots"].items():
        if free != before["proposer_free_slots"].get(name, free) or free != after["slots"]:
            problems.append(f"draft KV slots of {name!r} leaked: {free} of {after['slots']} free after")
    held = {key: after[key] for key in HELD if after[key]}
    if held:
        problems.append(f"the idle engine still holds {held}")
    if not after["healthy"] or after["step_failures"] > before["step_failures"]:
        problems.append(f"engine steps failed ({after['step_failures']}) or the replica is unhealthy")
    if after["aborts"] - before["aborts"] > tally.cancelled:
        problems.append(
            f"the engine aborted {after['aborts'] - before['aborts']} requests, "
            f"more than the {tally.cancelled} the client cancelled"
        )
    if idle["threads"] > before["threads"] + limits.thread_growth:
        problems.append(f"Python threads grew from {before['threads']} to {idle['threads']}")
    if after["rss_bytes"] is not None and mid["rss_bytes"] is not None:
        grown = (after["rss_bytes"] - mid["rss_bytes"]) / MIB
        if grown > limits.rss_growth_mib:
            problems.append(
                f"RSS grew by {grown:.1f} MiB over the second half (limit {limits.rss_growth_mib:g})"
            )
    if after["gc_objects"] is not None and mid["gc_objects"] is not None and half:
        per_request = (after["gc_objects"] - mid["gc_objects"]) / half
        if per_request > limits.objects_per_request:
            problems.append(
                f"tracked Python objects grew by {per_request:.2f} per request over the second half "
                f"({mid['gc_objects']} -> {after['gc_objects']}; limit {limits.objects_per_request:g})"
            )
    return problems


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        f"p{q}": ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)] for q in (50, 90, 99)
    }


def summarize(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    """Counts, tokens, rates and latencies of one phase's outcomes."""
    answered = [o for o in outcomes if o.status == "answered"]
    cancelled = [o for o in outcomes if o.status == "cancelled"]
    tokens = sum(o.tokens for o in answered)
    return {
        "sent": len(outcomes),
        "answered": len(answered),
        "cancelled": len(cancelled),
        "cancelled_before_first_token": sum(1 for o in cancelled if o.tokens == 0),
        "cancelled_mid_stream": sum(1 for o in cancelled if o.tokens > 0),
        "cancel_too_late": sum(1 for o in answered if o.cancel_planned),
        "failed": sum(1 for o in outcomes if o.status == "failed"),
        "tokens": tokens,
        "wall_s": wall_s,
        "requests_per_s": len(outcomes) / wall_s if wall_s > 0 else 0.0,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "latency_s": _percentiles([o.latency_s for o in answered]),
        "ttft_s": _percentiles([o.ttft_s for o in answered if o.ttft_s is not None]),
    }


def describe(report: dict[str, Any]) -> str:
    """The report in a few lines (what the command prints at the end)."""
    soak, states = report["soak"], report["states"]
    before, after, idle = states["before"], states["after"], states["idle"]

    def mib(state: dict[str, Any]) -> str:
        return f"{state['rss_bytes'] / MIB:.0f}" if state["rss_bytes"] is not None else "?"

    lines = [
        f"[soak] {soak['sent']} requests: {soak['answered']} answered ({soak['cancel_too_late']} of them "
        f"outran their cancel), {soak['cancelled']} cancelled ({soak['cancelled_before_first_token']} before "
        f"the first token, {soak['cancelled_mid_stream']} mid-stream), {soak['failed']} failed",
        f"[soak] {soak['tokens']} tokens in {soak['wall_s']:.0f} s: {soak['requests_per_s']:.1f} req/s, "
        f"{soak['tokens_per_s']:.1f} tok/s",
        f"[soak] replica RSS {mib(before)} -> {mib(states['half'])} -> {mib(after)} -> {mib(idle)} MiB "
        f"(before, half, after, idle); free KV slots {before['free_slots']}/{before['slots']} -> "
        f"{after['free_slots']}/{after['slots']}",
        f"[soak] threads {before['threads']} -> {idle['threads']} ({before['os_threads']} -> "
        f"{idle['os_threads']} in the OS); open files {before['open_fds']} -> {idle['open_fds']}; Python "
        f"objects {before['gc_objects']} -> {states['half']['gc_objects']} -> {after['gc_objects']}; "
        f"engine aborts {after['aborts'] - before['aborts']}",
    ]
    problems = report["problems"]
    lines.append(
        "[soak] no failure, no leak" if not problems else "[soak] PROBLEMS:\n  " + "\n  ".join(problems)
    )
    return "\n".join(lines)
