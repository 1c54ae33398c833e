"""Per-cell figures of the load matrix, from the client's records and the server's counters.

A cell is one (policy, users, mix). Its window runs from the first request sent to the last one
finished (every request that started finishes: Locust's ``--stop-timeout`` lets them), so:

- output tokens/s = output tokens of all requests / window;
- latency, TTFT, TPOT: p50 / p95 / p99 over successful requests (TPOT over those with 2+ tokens);
- acceptance = accepted / drafted draft tokens, from the requests' ``speculation`` blocks (client)
  and from the server's counters (server);
- cost per 1M output tokens = replica-hours in the window x the hourly price / output tokens x 1e6;
  savings vs plain = 1 - cost / cost of ``plain`` at the same users and mix.

Counter checks: the client's token count (sum of ``usage.completion_tokens``) against the server's
``specserve_generation_tokens`` counter over the same run (warm-up excluded).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.streaming import RequestRecord
from policies.registry import PLAIN_POLICY

GENERATION_TOKENS = "ray_specserve_generation_tokens_total"
DRAFT_TOKENS = "ray_specserve_spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "ray_specserve_spec_decode_num_accepted_tokens_total"
REQUESTS = "ray_specserve_request_success_total"
BASELINE_POLICY = PLAIN_POLICY
PERCENTILES = (50, 95, 99)


REFUSAL_STATUSES = (429, 503)  # overload: the server refused at once and says when to retry


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation between closest ranks); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


@dataclass
class ServerCounters:
    """The server's counters over a cell's measured run (deltas; warm-up excluded)."""

    generation_tokens: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    requests: float = 0.0


@dataclass
class CellResult:
    """Every figure of one cell (one row of ``cells.json``)."""

    policy: str
    users: int
    mix: str
    requests: int = 0
    failures: int = 0  # requests that failed, refusals (below) excepted
    refused: int = 0  # overload: answered 429 / 503 before any output (the client may retry)
    refusal_latency_s: dict[str, float | None] = field(default_factory=dict)
    window_s: float = 0.0
    output_tokens: int = 0
    tokens_per_s: float = 0.0
    load_tokens_per_s: float | None = None  # the server's token counter during the load phase only
    requests_per_s: float = 0.0
    latency_s: dict[str, float | None] = field(default_factory=dict)
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    tpot_s: dict[str, float | None] = field(default_factory=dict)
    acceptance: float | None = None
    server_acceptance: float | None = None
    per_workload: dict[str, dict[str, Any]] = field(default_factory=dict)
    server: ServerCounters = field(default_factory=ServerCounters)
    token_mismatch: float | None = None  # |client - server| / server
    locust_requests: int = 0  # Locust's own final statistics (POST events; response length = tokens)
    locust_tokens: int = 0
    replica_seconds: float = 0.0
    replica_hour_price: float = 0.0
    cost_per_1m_tokens: float | None = None
    savings_vs_plain: float | None = None
    speedup_vs_plain: float | None = None
    startup_s: float = 0.0
    chaos: dict[str, Any] | None = None  # the injected fault and its cost (loadtest.chaos.chaos_figures)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        data = dict(data)
        data["server"] = ServerCounters(**data.get("server", {}))
        return cls(**data)


def read_records(path: Path) -> list[RequestRecord]:
    """The records file Locust wrote (missing file: no records)."""
    if not path.exists():
        return []
    lines = (line for line in path.read_text().splitlines() if line.strip())
    return [RequestRecord.from_dict(json.loads(line)) for line in lines]


def locust_totals(path: Path) -> tuple[int, int]:
    """(requests, output tokens) of the POST events in Locust's final statistics (``--json-file``)."""
    if not path.exists():
        return 0, 0
    entries = [e for e in json.loads(path.read_text()) if e.get("method") == "POST"]
    return sum(int(e["num_requests"]) for e in entries), sum(int(e["total_content_length"]) for e in entries)


def refused(record: RequestRecord) -> bool:
    """Whether the server refused the request at once for overload (429 / 503, no output)."""
    return not record.ok and record.status in REFUSAL_STATUSES and record.output_tokens == 0


def _acceptance(records: Iterable[RequestRecord]) -> float | None:
    drafted = accepted = 0
    for r in records:
        drafted += r.drafted
        accepted += r.accepted
    return accepted / drafted if drafted else None


def _per_workload(records: list[RequestRecord], window: float) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for name in sorted({r.workload for r in records}):
        rows = [r for r in records if r.workload == name]
        ok = [r for r in rows if r.ok]
        tokens = sum(r.output_tokens for r in rows)
        table[name] = {
            "requests": len(rows),
            "failures": sum(1 for r in rows if not r.ok and not refused(r)),
            "refused": sum(1 for r in rows if refused(r)),
            "output_tokens": tokens,
            "tokens_per_s": tokens / window if window > 0 else 0.0,
            "acceptance": _acceptance(rows),
            "tpot_p50_s": percentile([r.tpot_s for r in ok if r.tpot_s is not None], 50),
        }
    return table


def cell_result(
    policy: str,
    users: int,
    mix: str,
    records: list[RequestRecord],
    server: ServerCounters,
    replica_seconds: float,
    replica_hour_price: float,
) -> CellResult:
    """One cell's figures (comparisons with plain are filled in later by :func:`compare_to_plain`)."""
    result = CellResult(policy, users, mix, server=server, replica_hour_price=replica_hour_price)
    if not records:
        result.errors.append("no requests were recorded")
        return result
    ok = [r for r in records if r.ok]
    refusals = [r for r in records if refused(r)]
    result.requests = len(records)
    result.refused = len(refusals)
    result.refusal_latency_s = _percentiles([r.latency_s for r in refusals])
    result.failures = len(records) - len(ok) - len(refusals)
    result.errors = sorted({r.error for r in records if r.error and not refused(r)})[:10]
    result.window_s = max(r.end for r in records) - min(r.start for r in records)
    result.output_tokens = sum(r.output_tokens for r in records)
    if result.window_s > 0:
        result.tokens_per_s = result.output_tokens / result.window_s
        result.requests_per_s = len(ok) / result.window_s
    result.latency_s = _percentiles([r.latency_s for r in ok])
    result.ttft_s = _percentiles([r.ttft_s for r in ok if r.ttft_s is not None])
    result.tpot_s = _percentiles([r.tpot_s for r in ok if r.tpot_s is not None])
    result.acceptance = _acceptance(records)
    if server.draft_tokens > 0:
        result.server_acceptance = server.accepted_tokens / server.draft_tokens
    result.per_workload = _per_workload(records, result.window_s)
    if server.generation_tokens > 0:
        result.token_mismatch = (
            abs(result.output_tokens - server.generation_tokens) / server.generation_tokens
        )
    result.replica_seconds = replica_seconds
    if result.output_tokens > 0:
        result.cost_per_1m_tokens = replica_seconds / 3600 * replica_hour_price / result.output_tokens * 1e6
    return result


def compare_to_plain(results: list[CellResult]) -> None:
    """Fill in savings and speedup of every cell against ``plain`` at the same users and mix."""
    plain = {(r.users, r.mix): r for r in results if r.policy == BASELINE_POLICY}
    for r in results:
        base = plain.get((r.users, r.mix))
        if base is None:
            continue
        if base.cost_per_1m_tokens and r.cost_per_1m_tokens is not None:
            r.savings_vs_plain = 1 - r.cost_per_1m_tokens / base.cost_per_1m_tokens
        if base.tokens_per_s > 0:
            r.speedup_vs_plain = r.tokens_per_s / base.tokens_per_s


def saturated(results: list[CellResult], policy: str, mix: str, gain: float = 0.05) -> bool:
    """True when ``policy``'s last load level raised tokens/s by less than ``gain`` over the one before."""
    rows = sorted((r for r in results if r.policy == policy and r.mix == mix), key=lambda r: r.users)
    if len(rows) < 2 or rows[-2].tokens_per_s <= 0:
        return False
    return rows[-1].tokens_per_s < rows[-2].tokens_per_s * (1 + gain)
