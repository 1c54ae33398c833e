"""The dashboard's speculation panels over one load-test cell, from Ray's scrapes of the engine.

The Grafana dashboard (``k8s/monitoring/dashboard.json``) plots ``rate()`` of the engine's
``specserve:`` counters. A cell has no Prometheus, so :class:`SpeculationTimeline` does that part:
fed every scrape of the cell's :class:`~loadtest.cluster.ReplicaSampler` (Ray's exporter names,
``ray_specserve_*``), it keeps, per proposer (and draft position), how much each counter it needs
grew since the cell's first scrape, summed over replicas. As Prometheus' ``increase()`` does, each
series is followed on its own: a series absent from the first scrape (a replica that appeared)
counts from 0, one that went down restarted (a replica replaced under the same labels) and counts
again from 0, one that vanished keeps what it had grown.

:func:`speculation_rates` turns the time series into the panels over a sliding window: acceptance
rate, acceptance by position, mean accepted length and mean depth per proposer; mean batch size;
tokens saved (accepted tokens/s) and fallbacks/s per proposer, the fallbacks' share of decode
request-steps; generated tokens/s; replicas.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serve_app.observability import metric_names as mn

# Quantities followed (the key's first part), from the exported sample names.
DRAFTS = "drafts"
DRAFT_TOKENS = "draft_tokens"
ACCEPTED = "accepted"
ACCEPTED_AT = "accepted_at"  # per position
FALLBACKS = "fallbacks"
DEPTH_SUM = "depth_sum"
DEPTH_COUNT = "depth_count"
BATCH_SUM = "batch_sum"
BATCH_COUNT = "batch_count"
GENERATED = "generated"

_QUANTITIES: dict[str, str] = {
    mn.NUM_DRAFTS + "_total": DRAFTS,
    mn.NUM_DRAFT_TOKENS + "_total": DRAFT_TOKENS,
    mn.NUM_ACCEPTED_TOKENS + "_total": ACCEPTED,
    mn.NUM_ACCEPTED_TOKENS_PER_POS + "_total": ACCEPTED_AT,
    mn.FALLBACKS + "_total": FALLBACKS,
    mn.SPEC_DEPTH + "_sum": DEPTH_SUM,
    mn.SPEC_DEPTH + "_count": DEPTH_COUNT,
    mn.BATCH_SIZE + "_sum": BATCH_SUM,
    mn.BATCH_SIZE + "_count": BATCH_COUNT,
    mn.GENERATION_TOKENS + "_total": GENERATED,
}
# Gauges kept as they are at each scrape, summed over replicas (queue depth beside the replicas).
RUNNING = "running"
WAITING = "waiting"
_GAUGES: dict[str, str] = {mn.NUM_RUNNING: RUNNING, mn.NUM_WAITING: WAITING}
SEP = "|"  # a key is "quantity|proposer|position" (empty parts where a series has no such label)
MAX_POINTS = 2048  # past this the series is thinned to every other point (about 34 min at 1 s)
WINDOW_S = 5.0

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_labels(text: str) -> dict[str, str]:
    """The labels of a sample's label string (``{a="x",b="y"}``)."""
    return {m.group(1): m.group(2) for m in _LABEL.finditer(text)}


def series_key(name: str, labels: str) -> str | None:
    """The timeline key of one Ray sample (``ray_specserve_*``), or None when no panel needs it."""
    ours = mn.from_ray_name(name)
    quantity = _QUANTITIES.get(ours) if ours is not None else None
    if quantity is None:
        return None
    tags = parse_labels(labels)
    return SEP.join((quantity, tags.get("proposer", ""), tags.get("position", "")))


def split_key(key: str) -> tuple[str, str, str]:
    """(quantity, proposer, position) of a timeline key."""
    quantity, proposer, position = key.split(SEP)
    return quantity, proposer, position


@dataclass
class TimelinePoint:
    """One scrape: its time, the replicas running, every followed quantity's growth so far and the
    gauges' values (requests running and waiting for a KV slot, over all replicas)."""

    t: float  # time.time()
    replicas: int
    totals: dict[str, float]
    gauges: dict[str, float] = field(default_factory=dict)


@dataclass
class SpeculationTimeline:
    """Counter growth since a cell's first scrape, per proposer, one point per scrape (bounded)."""

    max_points: int = MAX_POINTS
    points: list[TimelinePoint] = field(default_factory=list)
    _last: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    _totals: dict[str, float] = field(default_factory=dict, repr=False)

    def observe(self, t: float, scrape: Mapping[tuple[str, str], float], replicas: int) -> None:
        """Add one scrape (``LocalCluster.scrape()``'s samples) taken at ``t`` with ``replicas`` running."""
        first = not self.points
        gauges = dict.fromkeys(_GAUGES.values(), 0.0)
        for series, value in scrape.items():
            gauge = _GAUGES.get(mn.from_ray_name(series[0]) or "")
            if gauge is not None:
                gauges[gauge] += value
                continue
            key = series_key(*series)
            if key is None:
                continue
            last = self._last.get(series)
            self._last[series] = value
            if first:  # the baseline: growth counts from here
                self._totals.setdefault(key, 0.0)
                continue
            # A new series counts from 0; one that went down restarted and counts from 0 again.
            grown = value if last is None or value < last else value - last
            self._totals[key] = self._totals.get(key, 0.0) + grown
        self.points.append(TimelinePoint(t, replicas, dict(self._totals), gauges))
        if len(self.points) > self.max_points:
            # Thin rather than drop the oldest: the plot keeps the whole cell, at half the resolution.
            self.points = self.points[:-1:2] + self.points[-1:]

    def to_dict(self) -> dict[str, Any]:
        """The points as JSON (``timeline.json`` in a cell's folder)."""
        return {"points": [[p.t, p.replicas, p.totals, p.gauges] for p in self.points]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculationTimeline:
        """The timeline :meth:`to_dict` wrote (only its points: it cannot observe further)."""
        points = [
            TimelinePoint(float(t), int(n), dict(totals), dict(rest[0]) if rest else {})
            for t, n, totals, *rest in data.get("points", [])
        ]
        return cls(points=points)


@dataclass
class SpeculationRates:
    """The dashboard's speculation panels over a cell; every list is aligned with ``t``.

    A ratio is None where its denominator did not grow in the window (nothing to divide)."""

    t: list[float] = field(default_factory=list)  # seconds since the cell's first scrape (window ends)
    acceptance: dict[str, list[float | None]] = field(default_factory=dict)  # by proposer
    acceptance_by_position: dict[tuple[str, int], list[float | None]] = field(default_factory=dict)
    mean_accepted_length: dict[str, list[float | None]] = field(default_factory=dict)
    mean_depth: dict[str, list[float | None]] = field(default_factory=dict)
    mean_batch_size: list[float | None] = field(default_factory=list)
    tokens_saved_per_s: dict[str, list[float]] = field(default_factory=dict)  # accepted tokens/s
    fallbacks_per_s: dict[str, list[float]] = field(default_factory=dict)
    fallback_share: list[float | None] = field(default_factory=list)  # of all decode request-steps
    generated_tokens_per_s: list[float] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    running: list[float] = field(default_factory=list)  # requests holding a KV slot, all replicas
    waiting: list[float] = field(default_factory=list)  # requests waiting for one (the queue)

    def empty(self) -> bool:
        """True when there is no window to show (fewer than two scrapes)."""
        return not self.t


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _grew(
    now: TimelinePoint, then: TimelinePoint, quantity: str, proposer: str = "", position: str = ""
) -> float:
    key = SEP.join((quantity, proposer, position))
    return now.totals.get(key, 0.0) - then.totals.get(key, 0.0)


def speculation_rates(timeline: SpeculationTimeline, window_s: float = WINDOW_S) -> SpeculationRates:
    """The panels over a sliding window: each point against the first point at most ``window_s``
    before it (the one just before when scrapes are further apart), as ``rate()`` over ``window_s``."""
    points = timeline.points
    rates = SpeculationRates()
    if len(points) < 2:
        return rates
    keys = [split_key(k) for k in sorted({key for p in points for key in p.totals})]
    proposers = sorted({proposer for _, proposer, _ in keys if proposer})
    positions = sorted({(proposer, int(pos)) for q, proposer, pos in keys if q == ACCEPTED_AT})
    times = [p.t for p in points]
    for i in range(1, len(points)):
        now, then = points[i], points[min(bisect.bisect_left(times, times[i] - window_s), i - 1)]
        dt = now.t - then.t
        if dt <= 0:
            continue
        # Engine-wide series (tokens, batch size) carry no proposer: a sum over every proposer and none.
        everyone = ("", *proposers)
        rates.t.append(now.t - times[0])
        rates.replicas.append(now.replicas)
        rates.running.append(now.gauges.get(RUNNING, 0.0))
        rates.waiting.append(now.gauges.get(WAITING, 0.0))
        rates.generated_tokens_per_s.append(sum(_grew(now, then, GENERATED, p) for p in everyone) / dt)
        batch = [sum(_grew(now, then, q, p) for p in everyone) for q in (BATCH_SUM, BATCH_COUNT)]
        rates.mean_batch_size.append(_ratio(*batch))
        steps = [sum(_grew(now, then, q, p) for p in proposers) for q in (FALLBACKS, DRAFTS)]
        rates.fallback_share.append(_ratio(steps[0], steps[0] + steps[1]))
        for proposer in proposers:
            drafts, accepted = _grew(now, then, DRAFTS, proposer), _grew(now, then, ACCEPTED, proposer)
            drafted = _grew(now, then, DRAFT_TOKENS, proposer)
            depth = _ratio(_grew(now, then, DEPTH_SUM, proposer), _grew(now, then, DEPTH_COUNT, proposer))
            _append(rates.acceptance, proposer, _ratio(accepted, drafted))
            _append(rates.mean_accepted_length, proposer, _ratio(accepted + drafts, drafts))
            _append(rates.mean_depth, proposer, depth)
            _append(rates.tokens_saved_per_s, proposer, accepted / dt)
            _append(rates.fallbacks_per_s, proposer, _grew(now, then, FALLBACKS, proposer) / dt)
        for proposer, position in positions:
            kept = _grew(now, then, ACCEPTED_AT, proposer, str(position))
            _append(
                rates.acceptance_by_position,
                (proposer, position),
                _ratio(kept, _grew(now, then, DRAFTS, proposer)),
            )
    _drop_empty(rates)
    return rates


def _append(table: dict[Any, list[Any]], key: Any, value: Any) -> None:
    table.setdefault(key, []).append(value)


def _drop_empty(rates: SpeculationRates) -> None:
    """Drop lines that never show anything: a ratio never defined (plain decoding's ``none`` has no
    acceptance), a rate always 0 (a proposer that never fell back)."""
    for ratios in (
        rates.acceptance,
        rates.acceptance_by_position,
        rates.mean_accepted_length,
        rates.mean_depth,
    ):
        for key in [k for k, values in ratios.items() if all(v is None for v in values)]:
            del ratios[key]
    for per_s in (rates.tokens_saved_per_s, rates.fallbacks_per_s):
        for key in [k for k, values in per_s.items() if not any(values)]:
            del per_s[key]
