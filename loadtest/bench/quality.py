"""`specserve bench --quality`: what a weight format costs in quality, measured on a fixed text.

The text: the first ``--max-tokens`` x 8 tokens (512 by default) of the standard library's
``textwrap.py``, on every machine, never in any training set we control. Each format of the target
(float32 as the reference, bf16, the q8 format and the pack's own GGUF blocks) runs one teacher-forced prefill
over it; reported per format: perplexity, and top-1 agreement with the float32 reference (the
share of positions where both predict the same next token).
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import textwrap
import time
from pathlib import Path

import torch

from loadtest.bench.results import write_table
from serve_app.config import Settings

FORMATS = (
    ("float32", "dense"), ("bfloat16", "dense"), ("bfloat16", "q8"), ("float32", "q8"),
    ("bfloat16", "gguf"), ("float32", "gguf"),
)  # fmt: skip


def text_tokens(tokenizer: object, count: int) -> list[int]:
    ids = tokenizer(inspect.getsource(textwrap), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return list(ids[:count])


@torch.inference_mode()
def logits_of(path: Path, dtype: str, weight_format: str, ids: list[int]) -> torch.Tensor:  # [T, V]
    from serve_app.engine.device import DTYPES
    from serve_app.engine.model import DecoderModel

    model = DecoderModel.from_pretrained(path, DTYPES[dtype], "cpu", weight_format=weight_format)
    cache = model.new_cache(1, len(ids) + 1)
    hidden = model.forward(torch.tensor([ids]), cache, [cache.allocate()])
    return model.logits(hidden)[0].float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return math.exp(float(nll))


def measure_quality(args: argparse.Namespace, settings: Settings) -> int:
    from transformers import AutoTokenizer

    from serve_app.builder import model_store
    from serve_app.engine.block_file import blocks_path
    from serve_app.engine.device import set_threads

    set_threads(settings.runtime.threads)
    path = model_store(settings).resolve(settings.model.target)
    ids = text_tokens(AutoTokenizer.from_pretrained(path), args.max_tokens * 8)
    reference = None
    rows = []
    for dtype, weight_format in FORMATS:
        if weight_format == "gguf" and not blocks_path(path).is_file():
            print(f"[bench] no GGUF blocks in {path} (not a model pack): gguf left out", file=sys.stderr)
            continue
        start = time.perf_counter()
        logits = logits_of(path, dtype, weight_format, ids)
        top1 = logits.argmax(-1)
        reference = top1 if reference is None else reference
        rows.append({"dtype": dtype, "weights": weight_format, "perplexity": perplexity(logits, ids),
                     "top1_agreement": float((top1 == reference).float().mean()),
                     "seconds": time.perf_counter() - start})  # fmt: skip
        print(f"[quality] {rows[-1]}", file=sys.stderr, flush=True)
    lines = [f"Quality of the weight formats: {settings.model.target}, {len(ids)} tokens of textwrap.py, "
             "teacher-forced", "", "| dtype | weights | perplexity | top-1 agreement with float32 |",
             "|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['dtype']} | {r['weights']} | {r['perplexity']:.4f} | {r['top1_agreement']:.3f} |" for r in rows
    ]
    text = "\n".join(lines) + "\n"
    write_table(args.out, "quality", text, rows)
    return 0
