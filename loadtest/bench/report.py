"""The reports of ``specserve bench``: a summary (per prompt, per kind, code+json, overall), the
Markdown tables that go into BENCHMARKS.md and the complete JSON record.

tok/s is ``max_tokens / seconds`` (prefill included), medians over repeats. Per prompt kind (and
for code+json, the issue's headline, and overall) a method's tok/s is the median over the kind's
prompts and a speedup is the ratio of those medians. Acceptance is pooled: accepted / drafted
summed over the timed repeats (and the kind's prompts); mean accepted length = (accepted +
speculative steps) / speculative steps. A proposer's cost is its time in ``propose`` per call (one
call a step), against plain decoding's time per token after the first. Outputs are compared with
the reference method's (``specserve-plain`` when it ran). The roofline: ``loadtest.bench.machine``.
"""

from __future__ import annotations

import shlex
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.bench.method_names import ASSISTED, PLAIN, Family, parse_method
from loadtest.bench.results import BenchResult, Run
from loadtest.bench.server_path import server_path_markdown
from loadtest.bench.sweeps import cost_curve_markdown, cost_curve_summary, sweep_markdown, sweep_summary
from loadtest.catalogue import KINDS

GB = 1e9
SPEEDUP_REFERENCES = (PLAIN, ASSISTED, "transformers-plain")  # ratios in the JSON
MARKDOWN_REFERENCES = (PLAIN, ASSISTED)  # ratios in the Markdown table
HEADLINE_TARGETS = {PLAIN: 2.0, ASSISTED: 1.3}  # model-drafted speculation on code+json, from the issue
SPEC_KEYS = ("drafted", "accepted", "spec_steps")
POSITION_KEYS = ("drafted_at", "accepted_at")  # per draft position, summed element by element
DRAFT_KEYS = ("draft_seconds", "draft_calls")  # the proposers' time in propose, and its calls
SHOWN_POSITIONS = 4  # positions in the Markdown table


def tok_per_s(runs: list[Run], n: int) -> float:
    """Median over repeats of n / seconds."""
    return statistics.median(n / r.seconds for r in runs)


def decode_tok_per_s(runs: list[Run], n: int) -> float | None:
    """Median of (n - 1) / decode seconds, or None when the method does not report it."""
    rates = [(n - 1) / r.decode_seconds for r in runs if r.decode_seconds]
    return statistics.median(rates) if rates and n > 1 else None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _sum_lists(lists: list[Any]) -> list[int]:
    """Element-by-element sum of count lists of any lengths."""
    out: list[int] = []
    for counts in lists:
        out += [0] * (len(counts) - len(out))
        for j, c in enumerate(counts):
            out[j] += int(c)
    return out


def add_totals(totals: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of several runs or prompts added up (counts, and per-position counts by position)."""
    return {**{k: sum(t[k] for t in totals) for k in SPEC_KEYS},
            **{k: sum(t.get(k) or 0 for t in totals) for k in DRAFT_KEYS},
            **{k: _sum_lists([t.get(k, []) for t in totals]) for k in POSITION_KEYS}}  # fmt: skip


def spec_totals(runs: list[Run]) -> dict[str, Any] | None:
    """drafted / accepted / spec_steps (and per draft position) summed over the runs that carry
    them; None when none do."""
    runs = [r for r in runs if r.drafted is not None]
    if not runs:
        return None
    keys = (*SPEC_KEYS, *DRAFT_KEYS)
    return add_totals([{k: getattr(r, k) or 0 for k in keys} | {k: getattr(r, k) for k in POSITION_KEYS}
                       for r in runs])  # fmt: skip


def spec_rates(totals: dict[str, Any]) -> dict[str, Any]:
    """The totals plus acceptance rate, mean accepted length (tokens per speculative step) and the
    acceptance at each draft position (of the drafts verified there: conditional on reaching it)."""
    drafted, accepted, steps = (totals[k] for k in SPEC_KEYS)
    drafted_at, accepted_at = totals.get("drafted_at", []), totals.get("accepted_at", [])
    accepted_at = [*accepted_at, *[0] * (len(drafted_at) - len(accepted_at))]  # none kept that deep
    at = [a / d if d else None for d, a in zip(drafted_at, accepted_at, strict=True)]
    calls, seconds = totals.get("draft_calls") or 0, totals.get("draft_seconds", 0.0)
    return {**totals, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
            "acceptance_at": at,
            "draft_ms_per_call": 1e3 * seconds / calls if calls else None}  # fmt: skip


def reference(methods: list[str]) -> str:
    """The method outputs are compared against: our plain decoding when it ran."""
    return PLAIN if PLAIN in methods else methods[0]


def _speedups(rate: dict[str, float], refs: list[str]) -> dict[str, dict[str, float]]:
    return {ref: {m: rate[m] / rate[ref] for m in rate} for ref in refs}


def _group(name: str, rows: list[dict], methods: list[str], refs: list[str]) -> dict[str, Any]:
    """Aggregate prompt rows: median tok/s, ratios of the medians, pooled acceptance, identity count."""
    rate = {m: statistics.median(r["tok_s"][m] for r in rows) for m in methods}
    speculative = [m for m in methods if any(m in r["spec_totals"] for r in rows)]
    totals = {m: add_totals([r["spec_totals"][m] for r in rows if m in r["spec_totals"]])
              for m in speculative}  # fmt: skip
    others = [m for m in methods if m != reference(methods)]
    plain = [1e3 / r["decode_tok_s"][PLAIN] for r in rows if r["decode_tok_s"].get(PLAIN)]
    return {"group": name, "prompts": len(rows), "tok_s": rate, "speedup": _speedups(rate, refs),
            "plain_ms_per_token": statistics.median(plain) if plain else None,
            "spec": {m: spec_rates(t) for m, t in totals.items()},
            "identical": {m: sum(r["divergence"][m] is None for r in rows) for m in others}}  # fmt: skip


def _headline(groups: list[dict], methods: list[str]) -> dict[str, Any] | None:
    """The best model-drafted method (draft depth) on the code+json prompts (or whichever of the
    two ran), against the targets."""
    by_name = {g["group"]: g for g in groups}
    group = next((by_name[k] for k in ("code+json", "code", "json") if k in by_name), None)
    drafts = [m for m in methods if (p := parse_method(m)) and p.family is Family.MODEL]
    refs = [ref for ref in HEADLINE_TARGETS if ref in methods]
    if group is None or not drafts or not refs:
        return None
    best = max(drafts, key=lambda m: group["tok_s"][m])
    return {"group": group["group"], "method": best, "targets": dict(HEADLINE_TARGETS),
            "speedup": {ref: group["speedup"][ref][best] for ref in refs}}  # fmt: skip


def summary(result: BenchResult) -> dict[str, Any]:
    """Per-prompt rows; per-kind, code+json and overall groups; headline; roofline (all the report shows)."""
    n, methods, ref = result.max_tokens, result.methods, reference(result.methods)
    refs = [r for r in SPEEDUP_REFERENCES if r in methods]
    rows = []
    for p in result.prompts:
        rate = {m: tok_per_s(p.runs[m], n) for m in methods}
        totals = {m: t for m in methods if (t := spec_totals(p.runs[m])) is not None}
        rows.append({
            "prompt": f"{p.prompt.name} ({'chat' if p.prompt.chat else 'raw'})", "kind": p.prompt.kind,
            "prompt_tokens": p.prompt_tokens, "tok_s": rate,
            "decode_tok_s": {m: decode_tok_per_s(p.runs[m], n) for m in methods},
            "speedup": _speedups(rate, refs), "spec_totals": totals,
            "spec": {m: spec_rates(t) for m, t in totals.items()},
            "divergence": {m: first_divergence(p.runs[ref][0].token_ids, p.runs[m][0].token_ids)
                           for m in methods if m != ref},
        })  # fmt: skip
    groups = [_group(k, [r for r in rows if r["kind"] == k], methods, refs)
              for k in KINDS if any(r["kind"] == k for r in rows)]  # fmt: skip
    if {"code", "json"} <= {r["kind"] for r in rows}:
        groups.append(_group("code+json", [r for r in rows if r["kind"] in ("code", "json")], methods, refs))
    overall = _group("overall", rows, methods, refs)
    groups.append(overall)
    decode = {m: [r["decode_tok_s"][m] for r in rows if r["decode_tok_s"][m]] for m in methods}
    overall_decode = {m: statistics.median(v) if v else None for m, v in decode.items()}
    mean_context = statistics.mean(p.prompt_tokens for p in result.prompts) + n / 2
    roofline = result.copy_bandwidth / result.bytes_per_token
    own = {m: result.copy_bandwidth / result.method_bytes.get(m, result.bytes_per_token) for m in methods}
    return {
        "reference": ref, "speedup_references": refs, "rows": rows, "groups": groups,
        "tok_s": overall["tok_s"], "decode_tok_s": overall_decode, "speedup": overall["speedup"],
        "headline": _headline(groups, methods),
        "roofline_tok_s": roofline, "kv_bytes_mean": result.kv_bytes_per_position * mean_context,
        "fraction": {m: overall["tok_s"][m] / own[m] for m in methods},
    }  # fmt: skip


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _label(group: dict) -> str:
    count = group["prompts"]
    return f"**{group['group']}** ({count} prompt{'s' if count > 1 else ''})"


def to_markdown(result: BenchResult) -> str:
    """A Markdown report (command line, tables, roofline) that can be pasted into BENCHMARKS.md."""
    s, n, methods = summary(result), result.max_tokens, result.methods
    ref = s["reference"]
    shown = [r for r in MARKDOWN_REFERENCES if r in methods]
    speculative = [m for m in methods if any(m in r["spec"] for r in s["rows"])]
    others = [m for m in methods if m != ref]
    command = shlex.join([Path(result.command[0]).name, *result.command[1:]]) if result.command else ""
    models = result.model + (f" target, {result.draft} draft" if result.draft else "")
    lines = [f"`{command}`", "",
             f"{models}, {result.dtype}, batch 1, greedy, {n} new tokens (EOS ignored), "
             f"{result.machine['threads']} threads, median of {result.repeats} after a warm-up; "
             f"tok/s = {n} / request time (prefill included).", ""]  # fmt: skip
    lines += [f"- `{m}`: {result.method_notes[m]}" for m in methods if result.method_notes.get(m)]

    def speed(tok: dict, up: dict) -> list[str]:
        return [f"{tok[m]:.2f}" + "".join(f" / {up[r][m]:.2f}x" for r in shown) for m in methods]

    rows = [
        [r["prompt"], r["kind"], str(r["prompt_tokens"]), *speed(r["tok_s"], r["speedup"])] for r in s["rows"]
    ]
    rows += [[_label(g), "", "", *speed(g["tok_s"], g["speedup"])] for g in s["groups"]]
    legend = " / ".join(["tok/s", *(f"speedup vs {r}" for r in shown)])
    lines += ["", "### Throughput", "", f"Each cell: {legend}.", "",
              *_table(["prompt", "kind", "prompt tokens", *methods], rows), "",
              "Kind rows: median over the kind's prompts of each method's tok/s; speedups are ratios of "
              "those medians.", ""]  # fmt: skip
    if speculative:

        def spec(stats: dict) -> list[str]:
            return ["-" if m not in stats else "no drafts" if not stats[m]["spec_steps"] else
                    f"{stats[m]['acceptance_rate']:.0%} / {stats[m]['mean_accepted_length']:.2f}"
                    for m in speculative]  # fmt: skip

        rows = [[r["prompt"], r["kind"], *spec(r["spec"])] for r in s["rows"]]
        rows += [[_label(g), "", *spec(g["spec"])] for g in s["groups"]]
        lines += ["### Speculation", "",
                  "Each cell: acceptance rate (accepted / drafted) / mean accepted length ((accepted + "
                  "speculative steps) / speculative steps: tokens per verifying forward), pooled over the "
                  "timed repeats and, in kind rows, over the kind's prompts.", "",
                  *_table(["prompt", "kind", *speculative], rows), ""]  # fmt: skip

        def by_position(stats: dict) -> list[str]:
            return ["-" if m not in stats or not stats[m]["spec_steps"] else " / ".join(
                "-" if r is None else f"{r:.0%}" for r in stats[m]["acceptance_at"][:SHOWN_POSITIONS])
                for m in speculative]  # fmt: skip

        rows = [[_label(g), *by_position(g["spec"])] for g in s["groups"]]
        lines += ["### Acceptance by draft position", "",
                  f"Each cell: of the drafts verified at position 1, 2, ... {SHOWN_POSITIONS}, the share the "
                  "target kept (conditional: a position is verified only after the ones before it were "
                  "kept), pooled over the kind's prompts and the timed repeats.", "",
                  *_table(["kind", *speculative], rows), ""]  # fmt: skip
        lines += _draft_cost_table(s["groups"], speculative)
    if others:
        rows = [[r["prompt"], r["kind"], *("identical" if r["divergence"][m] is None
                                          else f"differs at {r['divergence'][m]}" for m in others)]
                for r in s["rows"]]  # fmt: skip
        rows += [[_label(g), "", *(f"{g['identical'][m]}/{g['prompts']} identical" for m in others)]
                 for g in s["groups"]]  # fmt: skip
        lines += [f"### Output vs {ref}", "",
                  "First timed run of each. Our methods must be identical to plain decoding (speculation "
                  "is exact); `transformers` methods are another implementation and may part.", "",
                  *_table(["prompt", "kind", *others], rows), ""]  # fmt: skip
    if h := s["headline"]:
        against = ", ".join(f"{x:.2f}x {r} (target >= {h['targets'][r]}x)" for r, x in h["speedup"].items())
        lines += [f"Headline ({h['group']} prompts, best draft depth): `{h['method']}` {against}.", ""]
    frac = ", ".join(f"{m} {s['fraction'][m]:.0%}" for m in methods)
    own = {m: b for m, b in result.method_bytes.items() if m in methods and b != result.bytes_per_token}
    if own:  # methods on quantized weights read fewer bytes: each is measured against its own
        listed = ", ".join(f"{m} {b / GB:.3f} GB" for m, b in own.items())
        frac += f" (against their own weights where they differ: {listed} per token)"
    lines += [
        f"Roofline: {result.bytes_per_token / GB:.3f} GB of weights read per decoded token (output head "
        f"included, embedding table not) at {result.copy_bandwidth / GB:.1f} GB/s copy bandwidth "
        f"(1 GiB `copy_`, read + write counted) = {s['roofline_tok_s']:.1f} tok/s. KV cache read at the "
        f"mean context: {s['kv_bytes_mean'] / 1e6:.1f} MB per token, not counted. Overall tok/s as a "
        f"fraction of the roofline (speculation can pass 100%): {frac}.", ""]  # fmt: skip
    if result.sweep is not None:
        lines.append(sweep_markdown(result.sweep))
    if result.cost_curve is not None:
        lines.append(cost_curve_markdown(result.cost_curve))
    if result.server_path is not None:
        lines.append(server_path_markdown(result.server_path, result.max_tokens, result.repeats))
    return "\n".join(lines)


def _draft_cost_table(groups: list[dict], speculative: list[str]) -> list[str]:
    """Per kind: each speculative method's ms in ``propose`` per call, and that over plain decoding's
    ms per token (the draft / target cost ratio of a step); none without plain decoding's times."""
    if not any(g["plain_ms_per_token"] for g in groups):
        return []

    def cells(group: dict) -> list[str]:
        unit, out = group["plain_ms_per_token"], []
        for m in speculative:
            ms = group["spec"].get(m, {}).get("draft_ms_per_call")
            out.append("-" if ms is None or not unit else f"{ms:.2f} ms / {ms / unit:.3f}")
        return out

    rows = [[_label(g), f"{g['plain_ms_per_token']:.2f}" if g["plain_ms_per_token"] else "-", *cells(g)]
            for g in groups]  # fmt: skip
    return ["### Draft cost", "",
            f"Each cell: the proposers' time in `propose` per call (one a step: a catch-up and every "
            f"drafted token; a draft model's prefill at admission not included) / that over {PLAIN}'s "
            "time per token after the first (median over the kind's prompts).", "",
            *_table(["kind", f"{PLAIN} ms / token", *speculative], rows), ""]  # fmt: skip


def to_json(result: BenchResult) -> dict[str, Any]:
    """Everything: raw timings, tokens and speculation counts of every run, machine info, summaries."""
    data = {**asdict(result), "summary": summary(result)}
    if result.sweep is not None:
        data["sweep_summary"] = sweep_summary(result.sweep)
    if result.cost_curve is not None:
        data["cost_curve_summary"] = cost_curve_summary(result.cost_curve)
    return data
