"""Speculation with a grammar (BENCHMARKS.md, "Structured output: choosing the grammar library"):
JSON-schema prompts on a real pack, plain decoding vs each proposer, with ``response_format`` and
without it (the same prompts as free text); per cell tokens/s, acceptance and tokens per target
forward, and a check that speculative output equals plain decoding's, token for token.

    .venv/bin/python -m loadtest.bench.grammar_spec --model smollm2-135m-instruct

One request at a time, greedy; cells interleaved prompt by prompt so machine drift hits them alike;
ratios against plain decoding of the same prompts in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from loadtest.bench.grammar_libs import SCHEMAS
from policies import FIXED_POLICY
from serve_app.builder import build_engine
from serve_app.config import build_settings
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.registry import proposer_specs
from serve_app.engine.structured import StructuredOutput

# Plain decoding, then every proposer that drafts without a model of its own or trained heads.
MODES = ["off", *(spec.name for spec in proposer_specs() if spec.model_role is None and not spec.trained)]
NO_DRAFT_MODELS = {spec.model_role: None for spec in proposer_specs() if spec.model_role}  # none loaded
ASKS = {
    "person": "Invent a person and describe them as JSON with their name, age and whether they are a member.",
    "order": "Write a JSON order: an id, a status, two or three items (sku and quantity) and the customer.",
    "wide": "Fill in a JSON record with field_0 (a word), field_1 (a number) and any other fields you like.",
    "json_object": "Describe the planet Mars as a JSON object with a few facts.",
}


def run(engine: Any, prompt: list[int], params: SamplingParams, mode: str, depth: int) -> dict[str, Any]:
    start = time.perf_counter()
    (result,) = engine.generate([prompt], [params], SpecOverride(mode, depth if mode != "off" else None))
    seconds = time.perf_counter() - start
    stats = result.spec_stats
    return {"tokens": result.token_ids, "seconds": seconds, "steps": stats.steps,
            "drafted": stats.drafted, "accepted": stats.accepted, "text": result.text}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    settings = build_settings(
        {"model": {"target": args.model, **NO_DRAFT_MODELS}, "runtime": {"dtype": args.dtype},
         "speculation": {"method": "off", "extra_proposers": [m for m in args.modes if m != "off"]}},
    )  # fmt: skip
    engine = build_engine(settings, max_slots=1, max_depth=args.depth, policy=FIXED_POLICY)
    cells: dict[tuple[str, bool], list[dict]] = {}
    warm = engine.encode_prompt(ASKS["person"], chat=True)  # first calls: tokenizer for the grammar, caches
    for structured in (StructuredOutput.json_object(), None):
        for mode in args.modes:
            run(
                engine,
                warm,
                SamplingParams(max_tokens=16, temperature=0.0, structured=structured),
                mode,
                args.depth,
            )
    for name, ask in ASKS.items():
        prompt = engine.encode_prompt(ask, chat=True)
        for grammar in (True, False):
            structured = StructuredOutput.json_schema(SCHEMAS[name][0]) if grammar else None
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=structured)
            for _ in range(args.repeats):
                for mode in args.modes:
                    cells.setdefault((mode, grammar), []).append(
                        run(engine, prompt, params, mode, args.depth)
                    )
            plain = cells[("off", grammar)][-1]["tokens"]
            for mode in args.modes:
                assert cells[(mode, grammar)][-1]["tokens"] == plain, (name, mode, grammar)
            if grammar:
                print(f"{name}: {cells[('off', True)][-1]['text']!r}")
    print("| grammar | mode | tok/s | vs plain | acceptance | tokens per forward |")
    print("|---|---|---|---|---|---|")
    for grammar in (True, False):
        base = None
        for mode in args.modes:
            runs = cells[(mode, grammar)]
            rate = sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)
            per = statistics.median(len(r["tokens"]) / r["seconds"] for r in runs)
            base = base or per
            drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
            forwards = sum(r["steps"] for r in runs)
            print(
                f"| {'json_schema' if grammar else 'free text'} | {mode} | {rate:.1f} | {per / base:.2f}x | "
                f"{accepted / drafted if drafted else 0:.2f} ({accepted}/{drafted}) | "
                f"{sum(len(r['tokens']) for r in runs) / forwards:.2f} |"
            )
    print(json.dumps({"model": args.model, "depth": args.depth, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
