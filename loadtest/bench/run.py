"""`specserve bench`: our decoding, plain and speculative, against `transformers`, side by side.

Each *method* is a function ``(prompt ids) -> Run`` (tokens, seconds and, for our speculative
methods, what speculation did) that produces exactly ``max_tokens`` greedy tokens, EOS ignored.
The methods derive from the proposer registry (``loadtest.bench.method_names``): plain decoding,
the server's "auto", each proposer (a model-based one at each of ``--depths``), and `transformers`'
plain, assisted and lookup `generate`. Ours share one engine (``loadtest.bench.engine``, built as
``specserve serve`` builds it; ``loadtest.bench.methods``); theirs are in
``loadtest.bench.transformers_methods``. The prompts are the catalogue's ``BENCH`` set
(``loadtest.catalogue``).

For every prompt (or, with ``--warmup first``, the first prompt only) each method runs once to warm
up, then ``repeats`` times interleaved (A, B, A, B, ...) so all see the same machine state. The
report (medians, speedups, acceptance, output identity: ``loadtest.bench.report``; the roofline:
``loadtest.bench.machine``) is printed as Markdown and written with the raw JSON record.
``--sweep`` and ``--cost-curve`` live in ``loadtest.bench.sweeps``, ``--policies`` in
``loadtest.bench.policies``.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.bench.engine import bench_engine, drop_unfit_defaults, require_model, target_folder
from loadtest.bench.llama_cpp import llama_cpp_method
from loadtest.bench.llama_server import NAME as SERVER_NAME
from loadtest.bench.llama_server import peer_sweep
from loadtest.bench.machine import (
    bytes_per_token,
    kv_bytes_per_position,
    machine_info,
    measure_copy_bandwidth,
)
from loadtest.bench.method_names import (
    ASSISTED,
    LLAMA_CPP,
    TRANSFORMERS,
    Family,
    assistant_role,
    draft_depth,
    engine_proposers,
    model_proposers,
    parse_method,
    select_methods,
)
from loadtest.bench.methods import auto_engine, our_methods
from loadtest.bench.report import to_json, to_markdown
from loadtest.bench.results import BenchResult, Method, PromptResult
from loadtest.bench.self_spec import sweep_depths
from loadtest.bench.server_path import MODES as SERVER_MODES
from loadtest.bench.server_path import measure_server_path
from loadtest.bench.sweeps import SWEEP_AUTO, SWEEP_PLAIN, measure_cost_curve, measure_sweep, sweep_modes
from loadtest.bench.transformers_methods import transformers_methods
from loadtest.catalogue import BENCH, Prompt, of_kinds
from serve_app.builder import model_store
from serve_app.config import Settings


def time_methods(methods: Sequence[Method], prompts: Sequence[Prompt], encoded: Mapping[Prompt, list[int]],
                 n: int, repeats: int, warmup: str = "each") -> list[PromptResult]:  # fmt: skip
    """Every method on every prompt: a warm-up run (before each prompt, or with ``warmup`` "first"
    before the first only), then ``repeats`` timed runs interleaved; each must give ``n`` tokens.
    The methods are closed afterwards."""
    results = [PromptResult(p, len(encoded[p]), {m.name: [] for m in methods}) for p in prompts]
    try:
        for i, res in enumerate(results, 1):
            prompt, ids = res.prompt, encoded[res.prompt]
            first_rep = 0 if warmup == "each" or i == 1 else 1
            for rep in range(first_rep, repeats + 1):
                for m in methods:
                    run = m.run(ids)
                    if len(run.token_ids) != n:
                        raise RuntimeError(f"{m.name} produced {len(run.token_ids)} tokens, not {n}")
                    label = "warm-up" if rep == 0 else f"repeat {rep}/{repeats}"
                    accepted = "" if not run.drafted else f", accepted {run.accepted}/{run.drafted}"
                    print(f"[{i}/{len(prompts)} {prompt.name}] {m.name} {label}: {run.seconds:.2f} s, "
                          f"{n / run.seconds:.2f} tok/s{accepted}", file=sys.stderr)  # fmt: skip
                    if rep:
                        res.runs[m.name].append(run)
    finally:
        for m in methods:
            m.close()
        gc.collect()
    return results


def write_report(result: BenchResult, out: str) -> None:
    """Print the Markdown report; write it and the JSON record into ``out``."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(result.model).name)
    stem = f"bench-{name}-{result.dtype}-{time.strftime('%Y%m%d-%H%M%S')}"
    record = folder / f"{stem}.json"
    record.write_text(json.dumps(asdict(result), indent=1))  # the runs first: a report that fails keeps them
    markdown = to_markdown(result)
    record.write_text(json.dumps(to_json(result), indent=1))
    (folder / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {folder / stem}.json and .md", file=sys.stderr)


def run_bench(args: argparse.Namespace, settings: Settings) -> int:
    """`specserve bench`: run every method on every prompt (then the sweep and the cost curve, if
    asked for), print and write the results."""
    from serve_app.engine.device import DTYPES, resolve_dtype

    prompts = of_kinds(BENCH, args.kinds)
    if args.max_tokens < 2 or args.repeats < 1:
        raise ValueError("--max-tokens must be >= 2 and --repeats >= 1")
    names = select_methods(args.methods, args.depths, args.no_transformers)
    if not args.methods:  # the defaults: leave out what the configured models cannot run
        names = drop_unfit_defaults(names, settings, ASSISTED)
    concurrencies = sorted(set(args.sweep or []))
    if any(c < 1 for c in concurrencies):
        raise ValueError(f"--sweep concurrencies must be >= 1, got {args.sweep}")
    role = assistant_role()
    if ASSISTED in names:
        if role is None:
            raise ValueError(f"{ASSISTED} needs a proposer that drafts with a model")
        require_model(settings, role, ASSISTED)
    depths = [k for m in names if (k := draft_depth(m))]
    modes = list(getattr(args, "sweep_modes", None) or sweep_modes())
    # The sweep and the cost curve report their proposers too, so they load them whatever the methods are.
    needed = engine_proposers(names)
    needed += [m for m in modes if m not in (SWEEP_PLAIN, SWEEP_AUTO)] if concurrencies else []
    needed += model_proposers()[:1] if args.cost_curve else []
    parsed = [p for p in map(parse_method, names) if p is not None]
    auto = any(p.family is Family.AUTO for p in parsed) or bool(concurrencies and SWEEP_AUTO in modes)
    optional = settings.speculation.loaded_proposers() if auto else []  # as a replica loads
    n, rt, ref, spec = args.max_tokens, settings.runtime, settings.model.target, settings.speculation
    shape = {
        "optional": optional,
        "max_slots": max([1, *concurrencies]),
        "depth": max([spec.depth, *depths]),
        "n": n,
    }
    engines: dict[str, Any] = {}

    def engine_for(weight_format: str | None) -> Any:
        """The engine on the target in ``weight_format`` (None: the settings'), built once (``+q8``)."""
        weight_format = weight_format or rt.weight_format
        if weight_format not in engines:
            runtime = settings.runtime.model_copy(update={"weight_format": weight_format})
            other = settings.model_copy(update={"runtime": runtime})
            engines[weight_format] = bench_engine(other, needed, **shape)
        return engines[weight_format]

    # The base engine (prompts, sweeps, the roofline) is in the format of the first of our methods,
    # so that a run of only `+gguf` methods never loads the dense weights.
    ours = [p for p in parsed if p.family not in (Family.TRANSFORMERS, Family.PEER)]
    engine = engine_for(ours[0].weight_format if ours else None)
    model = engine.model
    print(f"measuring copy bandwidth on {model.device} ...", file=sys.stderr)
    bandwidth = measure_copy_bandwidth(model.device)

    methods = our_methods(names, engine_for, settings, n)
    if theirs := [m for m in names if m in TRANSFORMERS]:
        store = model_store(settings)
        assistant = store.resolve(getattr(settings.model, role)) if ASSISTED in theirs and role else None
        pad = engine.tokenizer.pad_token_id
        pad = min(engine.eos_ids, default=0) if pad is None else pad
        dtype = DTYPES[resolve_dtype(rt.dtype, "dense", model.device)]
        methods += transformers_methods(theirs, store.resolve(ref), assistant, dtype,
                                        model.device, n, pad)  # fmt: skip
    if LLAMA_CPP in names:
        import torch

        threads = rt.threads or torch.get_num_threads()
        peer = llama_cpp_method(model_store(settings), ref, n, threads, engine.config.max_seq_len)
        methods += [peer] if peer is not None else []
    encoded = {p: engine.encode_prompt(p.text, chat=p.chat) for p in prompts}
    results = time_methods(methods, prompts, encoded, n, args.repeats, args.warmup)
    sweep = None
    if concurrencies:
        depths_of = sweep_depths(engine, modes, target_folder(settings), settings)
        policy = auto_engine(engine, settings) if SWEEP_AUTO in modes else None
        sweep = measure_sweep(engine, [encoded[p] for p in prompts], concurrencies, n, spec.depth,
                              args.repeats, modes, mode_depths=depths_of, auto_engine=policy)  # fmt: skip
        if LLAMA_CPP in names:  # the peer of the sweep: llama.cpp's server, as many slots
            import torch

            threads = rt.threads or torch.get_num_threads()
            sweep.peer = peer_sweep(model_store(settings), ref, [encoded[p] for p in prompts], concurrencies,
                                    n, args.repeats, threads)  # fmt: skip
            sweep.peer_name = SERVER_NAME
    server_rows = None
    if args.server_path:
        by_name = {m.name: m for m in methods}
        missing = [name for name in SERVER_MODES.values() if name not in by_name]
        if missing:
            raise ValueError(f"--server-path needs the methods {', '.join(missing)}")
        mode_methods = {mode: by_name[name] for mode, name in SERVER_MODES.items()}
        server_rows = measure_server_path(mode_methods, settings, prompts, encoded, n, args.repeats,
                                          Path(args.out), engine.tokenizer.decode)  # fmt: skip
    drafter = next((engine.proposers[p] for p in model_proposers() if p in engine.proposers), None)
    cost_curve = None
    if args.cost_curve:
        draft_model = None if drafter is None else drafter.model
        cost_curve = measure_cost_curve(model, draft_model, repeats=max(5, args.repeats))
    result = BenchResult(
        command=list(sys.argv), model=ref, dtype=str(model.dtype).removeprefix("torch."), max_tokens=n,
        repeats=args.repeats,
        methods=[m.name for m in methods], prompts=results, bytes_per_token=bytes_per_token(model),
        kv_bytes_per_position=kv_bytes_per_position(model), copy_bandwidth=bandwidth,
        machine={**machine_info(), "device": str(model.device)},
        draft=getattr(settings.model, role) if role and (drafter or ASSISTED in names) else None,
        method_notes={m.name: m.description for m in methods}, sweep=sweep, cost_curve=cost_curve,
        server_path=server_rows,
        method_bytes={p.name: bytes_per_token(engine_for(p.weight_format).model) for p in ours},
    )  # fmt: skip
    write_report(result, args.out)
    return 0
