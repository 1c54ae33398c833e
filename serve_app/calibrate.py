"""`specserve calibrate self-spec --model NAME`: search the self-speculative skip set, store it.

Loads the target as a replica would (settings' dtype, device, threads), runs
``serve_app.engine.calibration`` on its calibration prompts and writes the result as
``specserve-self-spec.json`` into the model's folder in the store, where every replica's
self-speculative proposer finds it (``proposers.skip_plan``).

With ``--curve C [C ...]`` it measures instead why self-speculation pays or not on this machine
(``serve_app.engine.skip_curve``: acceptance, timed draft cost and expected speedup for C layers
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


def run_calibrate(args: argparse.Namespace, settings: Settings) -> int:
    import torch
    from transformers import AutoTokenizer

    from serve_app.engine.calibration import CALIBRATION_PROMPTS, calibrate_self_spec
    from serve_app.engine.engine import DTYPES, resolve_device
    from serve_app.engine.model import DecoderModel
    from serve_app.engine.proposers.skip_plan import save_plan
    from serve_app.engine.store import ModelStore

    if args.proposer != "self-spec":
        raise ValueError(f"nothing to calibrate for {args.proposer!r} (known: self-spec)")
    if settings.runtime.threads:
        torch.set_num_threads(settings.runtime.threads)
    name = settings.model.target
    path = ModelStore(settings.store.cache_dir).resolve(name)
    rt = settings.runtime
    model = DecoderModel.from_pretrained(path, DTYPES[rt.dtype], resolve_device(rt.device))
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = []
    for text, as_chat in CALIBRATION_PROMPTS:
        if as_chat and chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
            prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        else:
            prompts.append(list(tokenizer(text, add_special_tokens=True)["input_ids"]))

    def log(message: str) -> None:
        print(f"[calibrate] {message}", file=sys.stderr, flush=True)

    log(f"{name} ({model.cfg.num_layers} layers, {rt.dtype}, {torch.get_num_threads()} threads): "
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
    from serve_app.engine.calibration import SelfSpecCalibrator
    from serve_app.engine.proposers.skip_plan import default_skip, resolve_plan
    from serve_app.engine.skip_curve import measure_skip_curve, skip_curve_markdown

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
