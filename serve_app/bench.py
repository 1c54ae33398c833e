"""`specserve bench`: our decoding, plain and speculative, against `transformers`, side by side.

Each *method* is a function ``(prompt ids) -> Run`` (tokens, seconds and, for our speculative
methods, what speculation did) that produces exactly ``max_tokens`` greedy tokens, EOS ignored:

- ``specserve-plain``: our engine, speculation off; the reference for speedups and output identity.
- ``specserve-draft-d{k}``: our engine with the draft model proposing ``k`` tokens per step. All our
  methods share one engine, built as ``specserve serve`` builds it (draft options from settings),
  each request choosing its proposer and depth through its speculation override.
- ``specserve-ngram``: our engine, n-gram prompt lookup at the configured depth.
- ``specserve-self``, ``specserve-self-default``: self-speculation (no draft model) with the
  calibrated and the default skip sets (``serve_app.bench_self_spec``).
- ``specserve-auto``: our engine as the server runs it: requests say "auto", the configured policy
  (goodput by default, cost model profiled at start) picks proposer and depth every step.
- ``transformers-plain``, ``transformers-assisted`` (``assistant_model`` = the draft, same dtype,
  transformers' default assistant schedule), ``transformers-lookup``
  (``prompt_lookup_num_tokens=10``): `generate` with a clean generation config and no EOS.

For every prompt (or, with ``--warmup first``, the first prompt only) each method runs once to warm
up, then ``repeats`` times interleaved (A, B, A, B, ...) so all see the same machine state; tok/s is
``max_tokens / seconds`` (prefill included), medians over repeats. Per prompt kind (and for
code+json, the issue's headline, and overall) a method's tok/s is the median over the kind's prompts
and a speedup is the ratio of those medians. Acceptance is pooled: accepted / drafted summed over
the timed repeats (and the kind's prompts); mean accepted length = (accepted + speculative steps) /
speculative steps. ``--sweep`` and ``--cost-curve`` live in ``serve_app.bench_sweeps``.

Roofline: decoding one token reads every decoder weight once. With tied embeddings the tensor is
both the embedding (one row read) and the output head (read in full), and ``weight_bytes`` counts
it once; untied, the embedding table is not read per token, so its bytes are subtracted. The KV
cache read (at most a few MB at these lengths) is reported but not counted. Bandwidth is a
``b.copy_(a)`` of 1 GiB, counted as bytes read + bytes written. A speculative method can beat the
roofline: it emits several tokens per read of the weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve_app.bench_self_spec import SELF_METHODS, self_spec_method, sweep_mode_depths
from serve_app.bench_sweeps import (
    SWEEP_MODES,
    CostCurve,
    Sweep,
    cost_curve_markdown,
    cost_curve_summary,
    measure_cost_curve,
    measure_sweep,
    sweep_markdown,
    sweep_summary,
)
from serve_app.config import Settings

GB = 1e9
KINDS = ("code", "json", "chat", "prose")
PLAIN, ASSISTED, AUTO = "specserve-plain", "transformers-assisted", "specserve-auto"
TRANSFORMERS = ("transformers-plain", ASSISTED, "transformers-lookup")
LOOKUP_TOKENS = 10  # transformers-lookup's prompt_lookup_num_tokens
SPEEDUP_REFERENCES = (PLAIN, ASSISTED, "transformers-plain")  # ratios in the JSON
MARKDOWN_REFERENCES = (PLAIN, ASSISTED)  # ratios in the Markdown table
HEADLINE_TARGETS = {PLAIN: 2.0, ASSISTED: 1.3}  # draft speculation on code+json, from the issue
SPEC_KEYS = ("drafted", "accepted", "spec_steps")
_DRAFT_METHOD = re.compile(r"specserve-draft-d([1-9][0-9]*)")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: raw completion text, or a user message sent through the chat template."""

    kind: str  # code | json | chat | prose
    name: str
    text: str
    chat: bool  # through the chat template, else a raw completion


_LOAD_CONFIG = (
    "import json\nfrom pathlib import Path\n\n\ndef load_config(path: str) -> dict:\n"
    '    """Load a JSON config file, fill in defaults and validate the types."""\n'
)
_PEOPLE = (
    "Extract each person's name, age, city and job as a JSON list of objects: Alice is a 34-year-old "
    "engineer living in Berlin. Bob, 27, works as a nurse in Madrid. Carol, a teacher from Toronto, is 45."
)
PROMPTS: list[Prompt] = [
    Prompt("code", "quicksort", "def quicksort(arr):", False),
    Prompt("code", "load_config", _LOAD_CONFIG, False),
    Prompt("code", "LRU cache", "Write a Python class implementing an LRU cache.", True),
    Prompt("json", "JSON extraction", _PEOPLE, True),
    Prompt("prose", "printing press", "The printing press changed Europe in ways that", False),
    Prompt("chat", "sea poem", "Write a short poem about the sea at night.", True),
]


def method_names(depths: list[int]) -> list[str]:
    """Every method, in report order, for these draft depths."""
    drafts = [f"specserve-draft-d{k}" for k in sorted(set(depths))]
    return [PLAIN, AUTO, *drafts, "specserve-ngram", *SELF_METHODS, *TRANSFORMERS]


def draft_depth(method: str) -> int | None:
    """k of ``specserve-draft-d{k}``, else None."""
    match = _DRAFT_METHOD.fullmatch(method)
    return int(match.group(1)) if match else None


def select_methods(
    requested: list[str] | None, depths: list[int], no_transformers: bool = False
) -> list[str]:
    """The methods to run, in report order: all (for ``depths``) or the requested ones, which may
    name a draft depth of their own (``specserve-draft-d3``); ``no_transformers`` drops theirs."""
    if any(k < 1 for k in depths):
        raise ValueError(f"--depths must be >= 1, got {depths}")
    chosen = method_names(depths)
    if requested:
        known = set(chosen)
        unknown = [m for m in requested if m not in known and draft_depth(m) is None]
        if unknown:
            raise ValueError(f"unknown methods {', '.join(unknown)}; known: {', '.join(chosen)} "
                             "(and specserve-draft-d<k> for any depth k >= 1)")  # fmt: skip
        extra = [k for m in requested if (k := draft_depth(m))]
        chosen = [m for m in method_names([*depths, *extra]) if m in requested]
    if no_transformers:
        chosen = [m for m in chosen if m not in TRANSFORMERS]
    if not chosen:
        raise ValueError("no methods left to run (--no-transformers with only transformers methods?)")
    return chosen


@dataclass(frozen=True)
class Run:
    """One timed generation of one method."""

    token_ids: list[int]
    seconds: float  # whole request, prefill included
    decode_seconds: float | None = None  # after the first token, where the method can tell
    drafted: int | None = None  # speculation (our speculative methods only): draft tokens verified
    accepted: int | None = None  # draft tokens the target kept
    spec_steps: int | None = None  # decode steps that verified a non-empty draft


@dataclass(frozen=True)
class Method:
    """A way to generate: ``run(prompt ids) -> Run``; ``close()`` frees what it holds."""

    name: str
    run: Callable[[list[int]], Run]
    close: Callable[[], None] = lambda: None
    description: str = ""  # one line for the report


@dataclass
class PromptResult:
    """Every timed run of every method on one prompt."""

    prompt: Prompt
    prompt_tokens: int
    runs: dict[str, list[Run]] = field(default_factory=dict)  # method -> timed runs (no warm-up)


@dataclass
class BenchResult:
    """A whole benchmark run: what the report builders (`summary`, `to_markdown`, `to_json`) read."""

    command: list[str]
    model: str
    dtype: str
    max_tokens: int
    repeats: int
    methods: list[str]  # in report order; specserve-plain (else the first) is the identity reference
    prompts: list[PromptResult]
    bytes_per_token: int  # weights read per decoded token (see the module docstring)
    kv_bytes_per_position: int  # KV cache bytes read per context position per decoded token
    copy_bandwidth: float  # bytes/s, read + write
    machine: dict[str, Any]
    draft: str | None = None  # the draft model, when a method or the sweep used it
    method_notes: dict[str, str] = field(default_factory=dict)  # method -> what exactly it runs
    sweep: Sweep | None = None
    cost_curve: CostCurve | None = None


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


def spec_totals(runs: list[Run]) -> dict[str, int] | None:
    """drafted / accepted / spec_steps summed over the runs that carry them; None when none do."""
    runs = [r for r in runs if r.drafted is not None]
    if not runs:
        return None
    return {k: sum(getattr(r, k) or 0 for r in runs) for k in SPEC_KEYS}


def spec_rates(totals: dict[str, int]) -> dict[str, float]:
    """The totals plus acceptance rate and mean accepted length (tokens per speculative step)."""
    drafted, accepted, steps = (totals[k] for k in SPEC_KEYS)
    return {**totals, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0}  # fmt: skip


def reference(methods: list[str]) -> str:
    """The method outputs are compared against: our plain decoding when it ran."""
    return PLAIN if PLAIN in methods else methods[0]


def _speedups(rate: dict[str, float], refs: list[str]) -> dict[str, dict[str, float]]:
    return {ref: {m: rate[m] / rate[ref] for m in rate} for ref in refs}


def _group(name: str, rows: list[dict], methods: list[str], refs: list[str]) -> dict[str, Any]:
    """Aggregate prompt rows: median tok/s, ratios of the medians, pooled acceptance, identity count."""
    rate = {m: statistics.median(r["tok_s"][m] for r in rows) for m in methods}
    speculative = [m for m in methods if any(m in r["spec_totals"] for r in rows)]
    totals = {m: {k: sum(r["spec_totals"][m][k] for r in rows if m in r["spec_totals"]) for k in SPEC_KEYS}
              for m in speculative}  # fmt: skip
    others = [m for m in methods if m != reference(methods)]
    return {"group": name, "prompts": len(rows), "tok_s": rate, "speedup": _speedups(rate, refs),
            "spec": {m: spec_rates(t) for m, t in totals.items()},
            "identical": {m: sum(r["divergence"][m] is None for r in rows) for m in others}}  # fmt: skip


def _headline(groups: list[dict], methods: list[str]) -> dict[str, Any] | None:
    """The best draft depth on the code+json prompts (or whichever of the two ran), against targets."""
    by_name = {g["group"]: g for g in groups}
    group = next((by_name[k] for k in ("code+json", "code", "json") if k in by_name), None)
    drafts = [m for m in methods if draft_depth(m)]
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
    return {
        "reference": ref, "speedup_references": refs, "rows": rows, "groups": groups,
        "tok_s": overall["tok_s"], "decode_tok_s": overall_decode, "speedup": overall["speedup"],
        "headline": _headline(groups, methods),
        "roofline_tok_s": roofline, "kv_bytes_mean": result.kv_bytes_per_position * mean_context,
        "fraction": {m: overall["tok_s"][m] / roofline for m in methods},
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
    if others:
        rows = [[r["prompt"], r["kind"], *("identical" if r["divergence"][m] is None
                                          else f"differs at {r['divergence'][m]}" for m in others)]
                for r in s["rows"]]  # fmt: skip
        rows += [[_label(g), "", *(f"{g['identical'][m]}/{g['prompts']} identical" for m in others)]
                 for g in s["groups"]]  # fmt: skip
        lines += [f"### Output vs {ref}", "",
                  "First timed run of each. In bf16 a divergence is allowed where the target's two best "
                  "logits are within numerical noise (different batch shapes round differently).", "",
                  *_table(["prompt", "kind", *others], rows), ""]  # fmt: skip
    if h := s["headline"]:
        against = ", ".join(f"{x:.2f}x {r} (target >= {h['targets'][r]}x)" for r, x in h["speedup"].items())
        lines += [f"Headline ({h['group']} prompts, best draft depth): `{h['method']}` {against}.", ""]
    frac = ", ".join(f"{m} {s['fraction'][m]:.0%}" for m in methods)
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
    return "\n".join(lines)


def to_json(result: BenchResult) -> dict[str, Any]:
    """Everything: raw timings, tokens and speculation counts of every run, machine info, summaries."""
    data = {**asdict(result), "summary": summary(result)}
    if result.sweep is not None:
        data["sweep_summary"] = sweep_summary(result.sweep)
    if result.cost_curve is not None:
        data["cost_curve_summary"] = cost_curve_summary(result.cost_curve)
    return data


# ------------------------------------------------------------------------------------ measuring
def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Median bytes/s of ``b.copy_(a)`` for an ``nbytes`` tensor, counting read + write (2 x nbytes)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 1):  # the first one faults the pages in
        start = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[1:])


def machine_info() -> dict[str, Any]:
    """CPU model, torch threads, library versions and the date, for the JSON record."""
    import transformers
    from transformers.utils import is_sklearn_available

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {"cpu": cpu.group(1) if cpu else platform.processor(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "sklearn": is_sklearn_available(),  # transformers adapts its assistant's threshold with it
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip


def specserve_method(engine: Any, n: int, name: str, mode: str = "off", depth: int | None = None,
                     description: str = "") -> Method:  # fmt: skip
    """Our engine, one request at a time, with this speculation override (mode "off" = plain)."""
    from serve_app.engine.request import SpecOverride
    from serve_app.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    speculation = SpecOverride(mode, max_depth=depth)

    def run(ids: list[int]) -> Run:
        start = time.perf_counter()
        done = engine.generate([ids], params, [speculation])[0]
        seconds = time.perf_counter() - start
        ttft, stats = done.time_to_first_token, done.spec_stats
        counts = (stats.drafted, stats.accepted, stats.spec_steps) if mode != "off" and stats else (None,) * 3
        return Run(done.token_ids, seconds, None if ttft is None else done.duration - ttft, *counts)

    return Method(name, run, description=description)


def _assistant_schedule(config: Any) -> str:
    """transformers' assistant settings as `generate` will fill them in (its defaults unless set)."""
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    defaults = getattr(config, "_get_default_generation_params", dict)()
    values = {k: v if (v := getattr(config, k, None)) is not None else defaults.get(k) for k in keys}
    return ", ".join(f"{k}={v}" for k, v in values.items())


def transformers_methods(names: list[str], path: Path, draft_path: Path | None, dtype: torch.dtype,
                         device: torch.device, n: int, pad: int) -> list[Method]:  # fmt: skip
    """`transformers` `generate`, greedy, sharing one target model: plain, with the draft as
    ``assistant_model`` (loaded only when asked for), with ``prompt_lookup_num_tokens``. Each model's
    generation config is replaced by a clean one and no EOS is given, so EOS is neither a stop nor
    masked (as our ``ignore_eos``): exactly n tokens (the caller checks)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import is_sklearn_available

    def load(p: Path) -> Any:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype).to(device).eval()
        model.generation_config = GenerationConfig(pad_token_id=pad)
        return model

    state = {"model": load(path)}
    notes = {
        "transformers-plain": "`generate`, greedy",
        "transformers-lookup": f"`generate(prompt_lookup_num_tokens={LOOKUP_TOKENS})`",
    }
    if ASSISTED in names:
        if draft_path is None:
            raise ValueError(f"{ASSISTED} needs a draft model")
        state["assistant"] = load(draft_path)
        adapts = "installed" if is_sklearn_available() else "not installed"
        schedule = _assistant_schedule(state["assistant"].generation_config)
        notes[ASSISTED] = (
            f"`generate(assistant_model=<the draft, {str(dtype).removeprefix('torch.')}>)`, transformers' "
            f"default assistant schedule ({schedule}; the threshold adapts only with scikit-learn: {adapts})"
        )
    options: dict[str, Callable[[], dict[str, Any]]] = {
        "transformers-plain": dict,
        ASSISTED: lambda: {"assistant_model": state["assistant"]},
        "transformers-lookup": lambda: {"prompt_lookup_num_tokens": LOOKUP_TOKENS},
    }

    def method(name: str) -> Method:
        def run(ids: list[int]) -> Run:
            x = torch.tensor([ids], device=device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = state["model"].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                              do_sample=False, eos_token_id=None,
                                              **options[name]())  # fmt: skip
            tokens = out[0, len(ids) :].tolist()
            return Run(tokens, time.perf_counter() - start)

        return Method(name, run, state.clear, notes[name])

    return [method(m) for m in names]


def build_engine(settings: Settings, draft: bool, max_slots: int, depth: int, n: int) -> Any:
    """One engine for all our methods, configured as the server configures it (``engine_config``),
    with the draft proposer loaded when ``draft`` (whatever ``speculation.method`` says), room for
    ``depth`` draft tokens per step and for requests of ``n`` new tokens. No request uses "auto":
    each names its proposer and depth."""
    from dataclasses import replace

    from serve_app.cli import engine_config
    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.store import ModelStore

    spec = settings.speculation.model_copy(update={"method": "draft" if draft else "off"})
    config = engine_config(settings.model_copy(update={"speculation": spec}), max_slots=max_slots)
    config = replace(config, spec_method=None, spec_depth=depth, max_depth=max(config.max_depth, depth),
                     max_seq_len=max(2048, n + 1024), policy="static")  # fmt: skip
    path = ModelStore(settings.store.cache_dir).resolve(settings.model.target)
    return SpecEngine.from_path(path, config, settings.runtime.dtype, settings.runtime.device)


def our_methods(names: list[str], engine: Any, settings: Settings, n: int) -> list[Method]:
    """Our methods among ``names``, on the shared engine."""
    spec = settings.speculation
    head = f"{spec.draft_head_tokens}-token head" if spec.draft_head_tokens else "full head"
    draft = (f"draft {settings.model.draft} ({'int8' if spec.draft_int8 else settings.runtime.dtype} layers, "
             f"{head}, min confidence {spec.draft_min_confidence})")  # fmt: skip
    methods = []
    for name in names:
        if name == AUTO:
            methods.append(auto_method(engine, settings, n))
        elif name == PLAIN:
            methods.append(specserve_method(engine, n, name, "off", description="our engine, plain decoding"))
        elif k := draft_depth(name):
            methods.append(specserve_method(engine, n, name, "draft", k, f"our engine, {draft}, depth {k}"))
        elif name == "specserve-ngram":
            note = (
                f"our engine, n-gram prompt lookup (n {spec.ngram_max}..{spec.ngram_min}), depth {spec.depth}"
            )
            methods.append(specserve_method(engine, n, name, "ngram", spec.depth, note))
        elif name in SELF_METHODS:
            from serve_app.engine.store import ModelStore

            folder = ModelStore(settings.store.cache_dir).resolve(settings.model.target)
            methods.append(self_spec_method(engine, name, folder, spec.depth, n))
    return methods


def auto_method(engine: Any, settings: Settings, n: int) -> Method:
    """Requests that leave speculation to the server ("auto"): the configured policy (goodput by
    default) with its cost model profiled on these models, as a replica starts. A second engine
    over the same weights and proposers (its own KV cache, in which a self proposer drafts), used
    one request at a time."""
    from dataclasses import replace

    from serve_app.engine.engine import SpecEngine

    spec = settings.speculation
    method = next(m for m in ("draft", "self", "ngram") if m in engine.proposers)  # as a replica's
    config = replace(
        engine.config, spec_method=method, policy=spec.policy, policy_params=dict(spec.policy_params)
    )
    proposers, cache = dict(engine.proposers), None
    if "self" in proposers:  # self-speculation drafts in its engine's cache: give it the new one's
        from serve_app.engine.proposers.self_spec import SelfSpecProposer

        cache = engine.model.new_cache(config.max_slots, config.max_seq_len)
        proposers["self"] = SelfSpecProposer(engine.model, cache, proposers["self"].skip)
    auto = SpecEngine(engine.model, engine.tokenizer, config, engine.eos_ids, proposers, cache=cache)
    if spec.profile_cost_model:
        auto.profile_cost_model()
    note = f'our engine, speculation "auto": policy {spec.policy} over {", ".join(auto.proposers)}'
    return specserve_method(auto, n, AUTO, "auto", None, note)


def run_bench(args: argparse.Namespace, settings: Settings) -> int:
    """`specserve bench`: run every method on every prompt (then the sweep and the cost curve, if
    asked for), print and write the results."""
    from serve_app.engine.engine import DTYPES
    from serve_app.engine.store import ModelStore

    prompts = [p for p in PROMPTS if not args.kinds or p.kind in args.kinds]
    if not prompts:
        raise ValueError(f"no prompts of kinds {args.kinds}; known: {sorted({p.kind for p in PROMPTS})}")
    if args.max_tokens < 2 or args.repeats < 1:
        raise ValueError("--max-tokens must be >= 2 and --repeats >= 1")
    names = select_methods(args.methods, args.depths, args.no_transformers)
    concurrencies = sorted(set(args.sweep or []))
    if any(c < 1 for c in concurrencies):
        raise ValueError(f"--sweep concurrencies must be >= 1, got {args.sweep}")
    if ASSISTED in names and not settings.model.draft:
        raise ValueError(f"{ASSISTED} needs a draft model (model.draft / --draft)")
    depths = [k for m in names if (k := draft_depth(m))]
    sweep_modes = list(getattr(args, "sweep_modes", None) or SWEEP_MODES)
    # The sweep and the cost curve report the draft too, so they load it whatever the methods are.
    sweep_draft = bool(concurrencies) and "draft" in sweep_modes
    needs_draft = (
        bool(depths) or sweep_draft or args.cost_curve or (AUTO in names and bool(settings.model.draft))
    )
    if bool(concurrencies) and "self" in sweep_modes:  # the self proposer drafts in the engine's cache
        settings = settings.model_copy(
            update={"speculation": settings.speculation.model_copy(update={"self_spec": True})}
        )
    if settings.runtime.threads:
        torch.set_num_threads(settings.runtime.threads)
    n, rt, ref, spec = args.max_tokens, settings.runtime, settings.model.target, settings.speculation
    engine = build_engine(settings, needs_draft, max([1, *concurrencies]), max([spec.depth, *depths]), n)
    model = engine.model
    print(f"measuring copy bandwidth on {model.device} ...", file=sys.stderr)
    bandwidth = measure_copy_bandwidth(model.device)
    embed = model.embed.numel() * model.embed.element_size()
    cfg = model.cfg
    methods = our_methods(names, engine, settings, n)
    if theirs := [m for m in names if m in TRANSFORMERS]:
        store = ModelStore(settings.store.cache_dir)
        draft_path = (
            store.resolve(settings.model.draft) if ASSISTED in theirs and settings.model.draft else None
        )
        pad = engine.tokenizer.pad_token_id
        pad = min(engine.eos_ids, default=0) if pad is None else pad
        methods += transformers_methods(theirs, store.resolve(ref), draft_path, DTYPES[rt.dtype],
                                        model.device, n, pad)  # fmt: skip
    encoded = {p: engine.encode_prompt(p.text, chat=p.chat) for p in prompts}
    results = [PromptResult(p, len(encoded[p]), {m.name: [] for m in methods}) for p in prompts]
    try:
        for i, res in enumerate(results, 1):
            prompt, ids = res.prompt, encoded[res.prompt]
            first_rep = 0 if args.warmup == "each" or i == 1 else 1
            for rep in range(first_rep, args.repeats + 1):
                for m in methods:
                    run = m.run(ids)
                    if len(run.token_ids) != n:
                        raise RuntimeError(f"{m.name} produced {len(run.token_ids)} tokens, not {n}")
                    label = "warm-up" if rep == 0 else f"repeat {rep}/{args.repeats}"
                    accepted = "" if not run.drafted else f", accepted {run.accepted}/{run.drafted}"
                    print(f"[{i}/{len(prompts)} {prompt.name}] {m.name} {label}: {run.seconds:.2f} s, "
                          f"{n / run.seconds:.2f} tok/s{accepted}", file=sys.stderr)  # fmt: skip
                    if rep:
                        res.runs[m.name].append(run)
    finally:
        for m in methods:
            m.close()
        gc.collect()
    sweep = None
    if concurrencies:
        folder = ModelStore(settings.store.cache_dir).resolve(ref)
        depths_of = sweep_mode_depths(engine, sweep_modes, folder, spec.self_spec_skip)
        sweep = measure_sweep(engine, [encoded[p] for p in prompts], concurrencies, n, spec.depth,
                              args.repeats, sweep_modes, mode_depths=depths_of)  # fmt: skip
    cost_curve = None
    if args.cost_curve:
        cost_curve = measure_cost_curve(model, engine.proposers["draft"].model, repeats=max(5, args.repeats))
    result = BenchResult(
        command=list(sys.argv), model=ref, dtype=rt.dtype, max_tokens=n, repeats=args.repeats,
        methods=[m.name for m in methods], prompts=results,
        bytes_per_token=model.weight_bytes - (0 if model.lm_head is model.embed else embed),
        kv_bytes_per_position=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize,
        copy_bandwidth=bandwidth, machine={**machine_info(), "device": str(model.device)},
        draft=settings.model.draft if needs_draft or ASSISTED in names else None,
        method_notes={m.name: m.description for m in methods}, sweep=sweep, cost_curve=cost_curve,
    )  # fmt: skip
    markdown = to_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(ref).name)
    stem = f"bench-{name}-{rt.dtype}-{time.strftime('%Y%m%d-%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps(to_json(result), indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)
    return 0
