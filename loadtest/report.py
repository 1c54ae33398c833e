"""The load matrix's report: ``report.md`` with tables, and PNG plots, in the results folder.

Plots, one set per workload mix: output tokens/s per policy vs users, cost per 1M output tokens per
policy vs users, and CDFs of request latency and TTFT per policy at the lowest and the highest load;
per cell, the dashboard's speculation panels over time (``loadtest.speculation_plots``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.analysis import CellResult
from loadtest.speculation_plots import CellKey, speculation_section
from loadtest.streaming import RequestRecord
from loadtest.timeline import SpeculationTimeline


def _fmt(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _triple(p: Mapping[str, float | None], scale: float = 1.0, digits: int = 2) -> str:
    return " / ".join(_fmt(p.get(k), digits, scale) for k in ("p50", "p95", "p99"))


def _policies(results: Sequence[CellResult]) -> list[str]:
    seen: list[str] = []
    for r in results:
        if r.policy not in seen:
            seen.append(r.policy)
    return seen


def plot_mix(
    mix: str,
    results: Sequence[CellResult],
    records: Mapping[tuple[str, int, str], list[RequestRecord]],
    folder: Path,
) -> list[str]:
    """Write the mix's PNGs into ``folder``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.mix == mix]
    policies = _policies(rows)
    names = []
    for metric, label, fname in (
        ("tokens_per_s", "output tokens/s", f"throughput_{mix}.png"),
        ("cost_per_1m_tokens", "cost per 1M output tokens (USD)", f"cost_{mix}.png"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for policy in policies:
            points = sorted((r.users, getattr(r, metric)) for r in rows if r.policy == policy)
            points = [(u, v) for u, v in points if v is not None]
            if points:
                ax.plot([u for u, _ in points], [v for _, v in points], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs load ({mix})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    loads = sorted({r.users for r in rows})
    if loads:
        levels = [loads[0], loads[-1]] if len(loads) > 1 else loads
        fig, axes = plt.subplots(2, len(levels), figsize=(6.0 * len(levels), 8.0), squeeze=False)
        for col, users in enumerate(levels):
            for row, (attr, label) in enumerate(
                (("latency_s", "request latency (s)"), ("ttft_s", "TTFT (s)"))
            ):
                ax = axes[row][col]
                for policy in policies:
                    values = sorted(
                        getattr(r, attr)
                        for r in records.get((policy, users, mix), [])
                        if r.ok and getattr(r, attr) is not None
                    )
                    if values:
                        ax.step(
                            values,
                            [(i + 1) / len(values) for i in range(len(values))],
                            where="post",
                            label=policy,
                        )
                ax.set_xlabel(label)
                ax.set_ylabel("fraction of requests")
                ax.set_title(f"{label} CDF, {users} user(s) ({mix})")
                ax.grid(True, alpha=0.3)
                ax.legend()
        fig.tight_layout()
        fname = f"latency_cdf_{mix}.png"
        fig.savefig(folder / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def _mix_section(mix: str, rows: list[CellResult], plots: list[str]) -> list[str]:
    out = [f"## Mix `{mix}`", ""]
    out += [
        "| policy | users | requests (failed, refused) | output tok/s | load-phase tok/s | vs plain | "
        "latency p50/p95/p99 s | "
        "TTFT p50/p95/p99 s | TPOT p50/p95/p99 ms | acceptance client / server | replica-h | "
        "USD / 1M tok | savings vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.users, _policies(rows).index(r.policy))):
        speedup = "-" if r.speedup_vs_plain is None else f"{r.speedup_vs_plain:.2f}x"
        out.append(
            f"| {r.policy} | {r.users} | {r.requests} ({r.failures}, {r.refused}) | {r.tokens_per_s:.2f} | "
            f"{_fmt(r.load_tokens_per_s)} | {speedup} | "
            f"{_triple(r.latency_s)} | {_triple(r.ttft_s)} | {_triple(r.tpot_s, 1000, 0)} | "
            f"{_pct(r.acceptance)} / {_pct(r.server_acceptance)} | {r.replica_seconds / 3600:.4f} | "
            f"{_fmt(r.cost_per_1m_tokens)} | {_pct(r.savings_vs_plain)} |"
        )
    refusing = [r for r in rows if r.refused]
    if refusing:
        out += ["", "Overload: requests refused at once (429 / 503, before any output), and how fast.", ""]
        out += ["| policy | users | refused | refusal latency p50/p95/p99 ms |", "|---|---|---|---|"]
        for r in refusing:
            out.append(f"| {r.policy} | {r.users} | {r.refused} | {_triple(r.refusal_latency_s, 1000, 0)} |")
    out += _chaos_rows(rows)
    workloads = sorted({w for r in rows for w in r.per_workload})
    if workloads:
        out += ["", "Per workload: output tok/s / acceptance / TPOT p50 ms.", ""]
        out.append("| policy | users | " + " | ".join(workloads) + " |")
        out.append("|---|---|" + "---|" * len(workloads))
        for r in sorted(rows, key=lambda r: (r.users, _policies(rows).index(r.policy))):
            cells = []
            for w in workloads:
                d = r.per_workload.get(w)
                cells.append(
                    "-"
                    if d is None
                    else f"{d['tokens_per_s']:.2f} / {_pct(d['acceptance'])} / "
                    f"{_fmt(d['tpot_p50_s'], 0, 1000)}"
                )
            out.append(f"| {r.policy} | {r.users} | " + " | ".join(cells) + " |")
    out += [""] + [f"![{name}]({name})" for name in plots] + [""]
    return out


def _chaos_rows(rows: list[CellResult]) -> list[str]:
    """The table of the faults injected (``--chaos``) and what each cost; nothing without chaos."""
    hit = [r for r in rows if r.chaos]
    if not hit:
        return []
    out = ["", "Chaos: the fault injected during the load (`loadtest.chaos`), and what it cost.", ""]
    out += [
        "| policy | users | fault | at s | whole again after s | in flight: failed | started after: "
        "failed | unclean failures | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in hit:
        c = r.chaos or {}
        errors = "; ".join(c.get("errors") or ([c["error"]] if c.get("error") else []))[:200] or "-"
        out.append(
            f"| {r.policy} | {r.users} | {c.get('detail') or c.get('kind')} | {_fmt(c.get('at_s'), 1)} | "
            f"{_fmt(c.get('recovered_after_s'), 1)} | {c.get('in_flight', '-')}: "
            f"{c.get('failed_in_flight', '-')} | "
            f"{c.get('started_after', '-')}: {c.get('failed_after', '-')} | "
            f"{c.get('unclean_failures', '-')} | {errors} |"
        )
    return out


def write_report(
    folder: Path,
    results: Sequence[CellResult],
    records: Mapping[tuple[str, int, str], list[RequestRecord]],
    meta: Mapping[str, Any],
    timelines: Mapping[CellKey, SpeculationTimeline] | None = None,
) -> Path:
    """Write ``report.md`` and the plots into ``folder``; returns the report's path. ``timelines``:
    each cell's scraped speculation counters (:class:`~loadtest.cluster.ReplicaSampler`), plotted
    over time per cell."""
    lines = [f"# specserve load test, {meta.get('started', '')}", ""]
    lines += [
        f"- command: `{meta.get('command', '')}`",
        f"- target `{meta.get('target')}`, draft `{meta.get('draft_model')}`, method `{meta.get('method')}`, "
        f"{meta.get('dtype')}, {meta.get('slots')} KV slots, replicas {meta.get('replicas')}",
        f"- each cell: a fresh `specserve serve`, {meta.get('warmup')} warm-up request(s), then Locust for "
        f"{meta.get('run_time_s')} s (at most {meta.get('max_requests') or 'unbounded'} requests; running "
        f"requests finish), seed {meta.get('seed')}; max_tokens cap {meta.get('max_tokens') or 'none'}",
        *(
            ["- users: a ramp per cell, from 1 up to the cell's users and back (`loadtest.ramp`)"]
            if meta.get("ramp")
            else []
        ),
        *([f"- chaos: {meta['chaos']} (`loadtest.chaos`)"] if meta.get("chaos") else []),
        f"- price: {meta.get('price')} USD per replica-hour (settings `loadtest.replica_hour_price`)",
        f"- wall time of the matrix: {meta.get('wall_s', 0) / 60:.1f} min",
        "",
        "Output tok/s = output tokens of all requests / (last request end - first request start); "
        "load-phase tok/s = the server's token counter over the load phase only (before running requests "
        "drain). "
        "Cost per 1M output tokens = replica-hours in that window x price / output tokens x 1e6; "
        "savings = 1 - cost / cost of `plain` at the same users and mix. Acceptance = accepted / drafted "
        "draft tokens, from the requests' `speculation` blocks (client) and the server's counters.",
        "",
    ]
    for mix in dict.fromkeys(r.mix for r in results):
        rows = [r for r in results if r.mix == mix]
        lines += _mix_section(mix, rows, plot_mix(mix, results, records, folder))
        lines += speculation_section(mix, rows, timelines or {}, folder)
    lines += [
        "## Counter check",
        "",
        "Output tokens counted by the client (sum of `usage.completion_tokens`; Locust's own statistics "
        "count the same as response lengths) vs the server's `specserve_generation_tokens` counter over "
        "the same run; requests likewise (`specserve_request_success`).",
        "",
        "| policy | users | mix | client tokens | Locust tokens | server tokens | mismatch | "
        "client / Locust / server requests | server start s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        errors = "; ".join(r.errors)[:200] or "-"
        lines.append(
            f"| {r.policy} | {r.users} | {r.mix} | {r.output_tokens} | {r.locust_tokens} | "
            f"{r.server.generation_tokens:.0f} | {_pct(r.token_mismatch)} | "
            f"{r.requests} / {r.locust_requests} / {r.server.requests:.0f} | {r.startup_s:.0f} | {errors} |"
        )
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
