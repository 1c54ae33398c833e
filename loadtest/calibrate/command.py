"""`specserve calibrate self-spec --model NAME`: search the self-speculative skip set, store it.

Loads the target as a replica would (settings' dtype, device, threads), runs
``loadtest.calibrate.self_spec`` on the catalogue's calibration prompts (``loadtest.catalogue``)
and writes the result as ``specserve-self-spec.json`` into the model's folder in the store, where
every replica's self-speculative proposer finds it (``proposers.skip_plan``).

With ``--curve C [C ...]`` it measures instead why self-speculation pays or not on this machine
(``loadtest.calibrate.skip_curve``: acceptance, timed draft cost and expected speedup for C layers
skipped, and for the calibrated and default sets), prints a Markdown table and stores nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_app.config import Settings


def add_arguments(
    parser: argparse.ArgumentParser, runtime_flags: Callable[[argparse.ArgumentParser], None]
) -> None:
    """``specserve calibrate``'s subcommands; ``runtime_flags`` adds the model / dtype / ... flags."""
    csub = parser.add_subparsers(dest="proposer", required=True)
    self_spec = csub.add_parser(
        "self-spec", help="search the layers the self-speculative draft skips (a few minutes)"
    )
    runtime_flags(self_spec)
    self_spec.add_argument("--budget-s", type=float, default=240.0, help="time budget of the search")
    self_spec.add_argument("--max-tokens", type=int, default=48, help="reference tokens per prompt")
    self_spec.add_argument("--max-depth", type=int, default=6, help="deepest draft considered")
    self_spec.add_argument("--no-write", action="store_true", help="print the result, store nothing")
    self_spec.add_argument(
        "--curve",
        type=int,
        nargs="+",
        metavar="C",
        help="instead: acceptance/cost/speedup for C layers skipped (stores nothing)",
    )
    self_spec.add_argument("--rank-starts", type=int, default=32, help="starts ranking layers for --curve")


def run_calibrate(args: argparse.Namespace, settings: Settings) -> int:
    import torch
    from transformers import AutoTokenizer

    from loadtest.calibrate.self_spec import calibrate_self_spec
    from loadtest.catalogue import CALIBRATION
    from serve_app.builder import model_store
    from serve_app.engine.device import DTYPES, resolve_device, resolve_dtype, set_threads
    from serve_app.engine.model import DecoderModel
    from serve_app.engine.proposers.skip_plan import save_plan

    if args.proposer != "self-spec":
        raise ValueError(f"nothing to calibrate for {args.proposer!r} (known: self-spec)")
    set_threads(settings.runtime.threads)
    name = settings.model.target
    path = model_store(settings).resolve(name)
    rt = settings.runtime
    dtype = resolve_dtype(rt.dtype, "dense", resolve_device(rt.device))
    model = DecoderModel.from_pretrained(path, DTYPES[dtype], resolve_device(rt.device))
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = []
    for prompt in CALIBRATION:
        if prompt.chat and chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
            prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        else:
            prompts.append(list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"]))

    def log(message: str) -> None:
        print(f"[calibrate] {message}", file=sys.stderr, flush=True)

    log(f"{name} ({model.cfg.num_layers} layers, {dtype}, {torch.get_num_threads()} threads): "
        f"{len(prompts)} prompts x {args.max_tokens} tokens, depth <= {args.max_depth}, "
        f"budget {args.budget_s:.0f} s")  # fmt: skip
    if getattr(args, "curve", None) is not None:
        return run_curve(args, model, prompts, name, path, log)
    result = calibrate_self_spec(model, prompts, args.max_tokens, args.max_depth, args.budget_s, log)
    plan = result.plan(name)
    print(json.dumps({k: v for k, v in plan.to_json().items() if k not in ("history", "ranking")}, indent=1))
    if args.no_write:
        log("not stored (--no-write)")
    else:
        log(f"stored in {save_plan(path, plan)}")
    return 0


def run_curve(
    args: argparse.Namespace, model: Any, prompts: list[list[int]], name: str, path: Path,
    log: Callable[[str], None],
) -> int:  # fmt: skip
    """``--curve``: the skip curve of ``model`` (counts from the arguments, plus the calibrated
    and default sets), printed as Markdown and JSON; nothing is stored."""
    from loadtest.calibrate.self_spec import SelfSpecCalibrator
    from loadtest.calibrate.skip_curve import measure_skip_curve, skip_curve_markdown
    from serve_app.engine.proposers.skip_plan import default_skip, resolve_plan

    layers = model.cfg.num_layers
    plan = resolve_plan(layers, folder=path)
    named = {"default": default_skip(layers)}
    if plan.source != "default":
        named = {plan.source: plan.skip, **named}
    calibrator = SelfSpecCalibrator(model, prompts, args.max_tokens, args.max_depth, log=log)
    curve = measure_skip_curve(calibrator, args.curve, named, args.rank_starts, log)
    log(f"measured in {curve.seconds:.0f} s")
    print(json.dumps(curve.as_dict()))
    print(skip_curve_markdown(curve, f"{name}: acceptance and cost by layers skipped"))
    return 0
