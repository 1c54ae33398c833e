"""`specserve bench`: our decoding against `transformers`, side by side, with a bandwidth roofline.

Each *method* is a function ``(prompt ids) -> Run`` (tokens and seconds) that produces exactly
``max_tokens`` greedy tokens, EOS ignored. For every prompt each method runs once to warm up, then
``repeats`` times interleaved (A, B, A, B, ...) so all see the same machine state; tok/s is
``max_tokens / seconds`` (prefill included), medians over repeats. Later proposers add methods.

Roofline: decoding one token reads every decoder weight once. With tied embeddings the tensor is
both the embedding (one row read) and the output head (read in full), and ``weight_bytes`` counts
it once; untied, the embedding table is not read per token, so its bytes are subtracted. The KV
cache read (at most a few MB at these lengths) is reported but not counted. Bandwidth is a
``b.copy_(a)`` of 1 GiB, counted as bytes read + bytes written.
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

from serve_app.config import Settings

GB = 1e9


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


@dataclass(frozen=True)
class Run:
    """One timed generation of one method."""

    token_ids: list[int]
    seconds: float  # whole request, prefill included
    decode_seconds: float | None = None  # after the first token, where the method can tell


@dataclass(frozen=True)
class Method:
    """A way to generate: ``run(prompt ids) -> Run``; ``close()`` frees what it holds."""

    name: str
    run: Callable[[list[int]], Run]
    close: Callable[[], None] = lambda: None


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
    methods: list[str]  # methods[0] is the reference for output identity
    prompts: list[PromptResult]
    bytes_per_token: int  # weights read per decoded token (see the module docstring)
    kv_bytes_per_position: int  # KV cache bytes read per context position per decoded token
    copy_bandwidth: float  # bytes/s, read + write
    machine: dict[str, Any]


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


def baseline(result: BenchResult) -> str | None:
    """The method ratios are taken against: transformers when it ran."""
    return "transformers-plain" if "transformers-plain" in result.methods else None


def summary(result: BenchResult) -> dict[str, Any]:
    """Per-prompt and overall rates, ratios and output identity (all the table shows)."""
    n, ref, base = result.max_tokens, result.methods[0], baseline(result)
    rows = []
    for p in result.prompts:
        rate = {m: tok_per_s(p.runs[m], n) for m in result.methods}
        rows.append({
            "prompt": f"{p.prompt.name} ({'chat' if p.prompt.chat else 'raw'})", "kind": p.prompt.kind,
            "prompt_tokens": p.prompt_tokens, "tok_s": rate,
            "decode_tok_s": {m: decode_tok_per_s(p.runs[m], n) for m in result.methods},
            "ratio": {m: rate[m] / rate[base] for m in result.methods if base and m != base},
            "divergence": {m: first_divergence(p.runs[ref][0].token_ids, p.runs[m][0].token_ids)
                           for m in result.methods[1:]},
        })  # fmt: skip
    overall = {m: statistics.median(r["tok_s"][m] for r in rows) for m in result.methods}
    decode = {m: [r["decode_tok_s"][m] for r in rows if r["decode_tok_s"][m]] for m in result.methods}
    overall_decode = {m: statistics.median(v) if v else None for m, v in decode.items()}
    mean_context = statistics.mean(p.prompt_tokens for p in result.prompts) + n / 2
    roofline = result.copy_bandwidth / result.bytes_per_token
    return {
        "rows": rows, "tok_s": overall, "decode_tok_s": overall_decode,
        "ratio": {m: overall[m] / overall[base] for m in result.methods if base and m != base},
        "identical": {m: sum(r["divergence"][m] is None for r in rows) for m in result.methods[1:]},
        "roofline_tok_s": roofline, "kv_bytes_mean": result.kv_bytes_per_position * mean_context,
        "fraction": {m: overall[m] / roofline for m in result.methods},
    }  # fmt: skip


def to_markdown(result: BenchResult) -> str:
    """A Markdown report (command line, table, roofline) that can be pasted into BENCHMARKS.md."""
    s, n, base = summary(result), result.max_tokens, baseline(result)
    others, has_decode = result.methods[1:], {m for m in result.methods if s["decode_tok_s"][m]}
    ratios = [m for m in result.methods if base and m != base]
    head = ["prompt", "kind", "prompt tokens"] + [f"{m} tok/s" for m in result.methods]
    head += [f"{m} decode tok/s" for m in result.methods if m in has_decode]
    head += [f"{m} / {base}" for m in ratios] + [f"{m} output vs {result.methods[0]}" for m in others]

    def cells(tok: dict, dec: dict, ratio: dict, same: list[str]) -> list[str]:
        out = [f"{tok[m]:.2f}" for m in result.methods] + [f"{dec[m]:.2f}" for m in has_decode]
        return out + [f"{ratio[m]:.2f}x" for m in ratios] + same

    command = shlex.join([Path(result.command[0]).name, *result.command[1:]]) if result.command else ""
    lines = [f"`{command}`", "",
             f"{result.model}, {result.dtype}, batch 1, greedy, {n} new tokens (EOS ignored), "
             f"{result.machine['threads']} threads, median of {result.repeats} after a warm-up; "
             f"tok/s = {n} / request time (prefill included), decode = {n - 1} / time after the first token.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in s["rows"]:
        div = r["divergence"]
        same = ["identical" if div[m] is None else f"differs at {div[m]}" for m in others]
        row = [r["prompt"], r["kind"], str(r["prompt_tokens"])]
        lines.append("| " + " | ".join(row + cells(r["tok_s"], r["decode_tok_s"], r["ratio"], same)) + " |")
    same = [f"{s['identical'][m]}/{len(s['rows'])} identical" for m in others]
    row = ["**overall (median)**", "", "", *cells(s["tok_s"], s["decode_tok_s"], s["ratio"], same)]
    lines += ["| " + " | ".join(row) + " |", ""]
    frac = ", ".join(f"{m} {s['fraction'][m]:.0%}" for m in result.methods)
    frac += "".join(f", {m} decode {s['decode_tok_s'][m] / s['roofline_tok_s']:.0%}" for m in has_decode)
    lines += [
        "Overall: median over prompts of each method's tok/s; the ratio is the ratio of those medians.",
        f"Roofline: {result.bytes_per_token / GB:.3f} GB of weights read per decoded token (output head "
        f"included, embedding table not) at {result.copy_bandwidth / GB:.1f} GB/s copy bandwidth "
        f"(1 GiB `copy_`, read + write counted) = {s['roofline_tok_s']:.1f} tok/s. KV cache read at the "
        f"mean context: {s['kv_bytes_mean'] / 1e6:.1f} MB per token, not counted. Fraction of the roofline: "
        f"{frac}.", ""]  # fmt: skip
    return "\n".join(lines)


def to_json(result: BenchResult) -> dict[str, Any]:
    """Everything: raw timings and tokens of every run, machine info, and the summary."""
    return {**asdict(result), "summary": summary(result)}


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

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {"cpu": cpu.group(1) if cpu else platform.processor(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip


def specserve_plain(engine: Any, n: int) -> Method:
    """Our engine, plain decoding."""
    from serve_app.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run(ids: list[int]) -> Run:
        start = time.perf_counter()
        done = engine.generate([ids], params)[0]
        seconds = time.perf_counter() - start
        ttft = done.time_to_first_token
        return Run(done.token_ids, seconds, None if ttft is None else done.duration - ttft)

    return Method("specserve-plain", run)


def transformers_plain(path: Path, dtype: torch.dtype, device: torch.device, n: int, pad: int) -> Method:
    """`transformers` `generate`, greedy. The checkpoint's generation config is replaced by a clean one
    and no EOS is given, so EOS is neither a stop nor masked (as our ``ignore_eos``): exactly n tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config = GenerationConfig(pad_token_id=pad)
    state = {"model": model}

    def run(ids: list[int]) -> Run:
        x = torch.tensor([ids], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = state["model"].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                          do_sample=False, eos_token_id=None)  # fmt: skip
        tokens = out[0, len(ids) :].tolist()
        return Run(tokens, time.perf_counter() - start)

    return Method("transformers-plain", run, state.clear)


def run_bench(args: argparse.Namespace, settings: Settings) -> int:
    """`specserve bench`: run every method on every prompt, print and write the results."""
    from serve_app.engine.engine import DTYPES, EngineConfig, SpecEngine
    from serve_app.engine.store import ModelStore

    prompts = [p for p in PROMPTS if not args.kinds or p.kind in args.kinds]
    if not prompts:
        raise ValueError(f"no prompts of kinds {args.kinds}; known: {sorted({p.kind for p in PROMPTS})}")
    if args.max_tokens < 2 or args.repeats < 1:
        raise ValueError("--max-tokens must be >= 2 and --repeats >= 1")
    if settings.runtime.threads:
        torch.set_num_threads(settings.runtime.threads)
    n, rt, ref = args.max_tokens, settings.runtime, settings.model.target
    path = ModelStore(settings.store.cache_dir).resolve(ref)
    engine = SpecEngine.from_path(path, EngineConfig(max_slots=1, max_seq_len=max(2048, n + 1024)),
                                  rt.dtype, rt.device)  # fmt: skip
    model = engine.model
    print(f"measuring copy bandwidth on {model.device} ...", file=sys.stderr)
    bandwidth = measure_copy_bandwidth(model.device)
    embed = model.embed.numel() * model.embed.element_size()
    cfg = model.cfg
    methods = [specserve_plain(engine, n)]
    if not args.no_transformers:
        pad = engine.tokenizer.pad_token_id
        pad = min(engine.eos_ids, default=0) if pad is None else pad
        methods.append(transformers_plain(path, DTYPES[rt.dtype], model.device, n, pad))
    encoded = {p: engine.encode_prompt(p.text, chat=p.chat) for p in prompts}
    results = [PromptResult(p, len(encoded[p]), {m.name: [] for m in methods}) for p in prompts]
    try:
        for i, res in enumerate(results, 1):
            prompt, ids = res.prompt, encoded[res.prompt]
            for rep in range(args.repeats + 1):
                for m in methods:
                    run = m.run(ids)
                    if len(run.token_ids) != n:
                        raise RuntimeError(f"{m.name} produced {len(run.token_ids)} tokens, not {n}")
                    label = "warm-up" if rep == 0 else f"repeat {rep}/{args.repeats}"
                    print(f"[{i}/{len(prompts)} {prompt.name}] {m.name} {label}: {run.seconds:.2f} s, "
                          f"{n / run.seconds:.2f} tok/s", file=sys.stderr)  # fmt: skip
                    if rep:
                        res.runs[m.name].append(run)
    finally:
        for m in methods:
            m.close()
        gc.collect()
    result = BenchResult(
        command=list(sys.argv), model=ref, dtype=rt.dtype, max_tokens=n, repeats=args.repeats,
        methods=[m.name for m in methods], prompts=results,
        bytes_per_token=model.weight_bytes - (0 if model.lm_head is model.embed else embed),
        kv_bytes_per_position=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize,
        copy_bandwidth=bandwidth, machine={**machine_info(), "device": str(model.device)},
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
