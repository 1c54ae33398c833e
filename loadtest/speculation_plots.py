"""The report's speculation panels over time: one PNG per cell, the Grafana dashboard's panels.

Each cell's :class:`~loadtest.timeline.SpeculationTimeline` (the engine's own counters, scraped
every second from Ray's exporter) becomes, over a sliding window, the dashboard's speculation
panels (``k8s/monitoring/dashboard.json``): acceptance rate and mean accepted length by proposer,
acceptance by draft position, depth chosen beside batch size, tokens saved (accepted tokens/s)
beside generated tokens/s, fallbacks to plain decoding, and replicas with the requests running and
waiting for a KV slot (the queue); x is seconds since the cell's
first scrape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.analysis import CellResult
from loadtest.timeline import WINDOW_S, SpeculationRates, SpeculationTimeline, speculation_rates

CellKey = tuple[str, int, str]  # (policy, users, mix), as the report's records


def plot_file(policy: str, users: int, mix: str) -> str:
    """The PNG's file name of one cell."""
    return f"speculation_{mix}_{policy}_u{users}.png"


def _values(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]  # a gap where a ratio is undefined


def _lines(ax: Any, t: list[float], table: Mapping[Any, Sequence[float | None]], label: str) -> None:
    for key, values in table.items():
        name = key if isinstance(key, str) else " pos ".join(str(part) for part in key)
        ax.plot(t, _values(values), label=label.format(name))


def plot_cell(rates: SpeculationRates, title: str, path: Path, window_s: float = WINDOW_S) -> None:
    """Write the panels of one cell's rates to ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20.0, 8.0), sharex=True, squeeze=False)
    panels = axes.flatten()
    t = rates.t
    _lines(panels[0], t, rates.acceptance, "{}")
    panels[0].set_title("acceptance rate by proposer")
    panels[0].set_ylim(-0.02, 1.02)
    _lines(panels[1], t, rates.acceptance_by_position, "{}")
    panels[1].set_title("acceptance by draft position")
    panels[1].set_ylim(-0.02, 1.02)
    _lines(panels[2], t, rates.mean_accepted_length, "{}")
    panels[2].set_title("mean accepted length (tokens per draft)")
    _lines(panels[3], t, rates.mean_depth, "{}")
    panels[3].set_title("mean depth chosen")
    panels[4].plot(t, _values(rates.mean_batch_size), label="all")
    panels[4].set_title("mean batch size (requests per step)")
    panels[5].plot(t, rates.generated_tokens_per_s, label="generated", color="black")
    _lines(panels[5], t, rates.tokens_saved_per_s, "saved ({})")
    panels[5].set_title("tokens/s: generated, saved (accepted)")
    _lines(panels[6], t, rates.fallbacks_per_s, "{}")
    panels[6].set_title("fallbacks to plain (request-steps/s; share dashed)")
    share = panels[6].twinx()  # the dashboard's right axis: fallbacks / all decode request-steps
    share.plot(t, _values(rates.fallback_share), color="grey", linestyle="--")
    share.set_ylim(-0.02, 1.02)
    share.set_ylabel("share of request-steps")
    panels[7].step(t, rates.replicas, where="post", label="replicas", color="black")
    panels[7].set_title("replicas; requests running and waiting (dashed)")
    requests_axis = panels[7].twinx()  # requests: a different scale from the replica count
    requests_axis.plot(t, rates.running, linestyle="--", color="tab:green", label="running")
    requests_axis.plot(t, rates.waiting, linestyle="--", color="tab:red", label="waiting")
    requests_axis.set_ylabel("requests")
    requests_axis.legend(fontsize="small", loc="upper right")
    for i, ax in enumerate(panels):
        ax.grid(True, alpha=0.3)
        if i >= 4:
            ax.set_xlabel("seconds since the cell's start")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(f"{title}: speculation over time ({window_s:g} s windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def speculation_section(
    mix: str,
    rows: Sequence[CellResult],
    timelines: Mapping[CellKey, SpeculationTimeline],
    folder: Path,
) -> list[str]:
    """Write the PNG of every cell of ``mix`` that has two scrapes or more; the report's lines linking
    them (none when no cell has)."""
    names = []
    order = list(dict.fromkeys(r.policy for r in rows))  # the matrix's policy order, as the tables
    for r in sorted(rows, key=lambda r: (r.users, order.index(r.policy))):
        timeline = timelines.get((r.policy, r.users, mix))
        rates = speculation_rates(timeline) if timeline is not None else SpeculationRates()
        if rates.empty():
            continue
        name = plot_file(r.policy, r.users, mix)
        plot_cell(rates, f"{r.policy}, {r.users} user(s), mix {mix}", folder / name)
        names.append((r, name))
    if not names:
        return []
    out = [
        f"### Speculation over time (`{mix}`)",
        "",
        "These panels come from the server's own Prometheus counters (the engine's `specserve:` "
        "metrics, scraped every second from Ray's exporter), as the Grafana dashboard's do, over "
        f"{WINDOW_S:g} s sliding windows.",
        "",
    ]
    for r, name in names:
        out += [f"{r.policy}, {r.users} user(s):", "", f"![{name}]({name})", ""]
    return out
