"""Which grammar library masks the target's tokens: llguidance, outlines-core and xgrammar measured
side by side on the served tokenizers (BENCHMARKS.md, "Structured output: choosing the grammar
library").

Per library and tokenizer: the one-off tokenizer set-up, each schema's compile time (a fresh
compile, no cache), the time to compute one position's token mask (the bitmask the engine applies
to a verified position's logits) and to advance by one token, along a valid instance of the schema;
and correctness: the valid instance is allowed token by token with EOS allowed at its end, an
invalid instance is refused somewhere, and random walks through the mask end in JSON that validates
(``jsonschema``). Libraries that are not importable are skipped, so the others can be installed
outside the project's venv for the measurement::

    pip download --no-deps -d /tmp/gl llguidance outlines-core xgrammar apache-tvm-ffi
    pip install --no-deps --target /tmp/glib /tmp/gl/*.whl
    PYTHONPATH=/tmp/glib .venv/bin/python -m loadtest.bench.grammar_libs

Timing is noisy on these machines: medians over repeats, all libraries in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STORE = Path.home() / ".cache/specserve/models"
SEPARATORS = (", ", ": ")  # what the engine generates: json.dumps' defaults, no newlines

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
_ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["open", "paid", "shipped"]},
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "customer": _PERSON,
    },
    "required": ["id", "status", "items", "customer"],
    "additionalProperties": False,
}
_KINDS = [
    {"type": "string", "maxLength": 16},
    {"type": "integer"},
    {"type": "boolean"},
    {"enum": ["a", "b", "c"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 3},
]
_WIDE = {  # thirty optional fields of every kind
    "type": "object",
    "properties": {f"field_{i}": _KINDS[i % 5] for i in range(30)},
    "required": ["field_0", "field_1"],
    "additionalProperties": False,
}
# name -> (schema, a valid instance, an invalid one)
SCHEMAS: dict[str, tuple[dict, Any, Any]] = {
    "person": (_PERSON, {"name": "Ada", "age": 36, "member": True}, {"name": "Ada", "age": 36}),
    "order": (
        _ORDER,
        {
            "id": 7,
            "status": "paid",
            "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}],
            "customer": {"name": "Bo", "age": 51, "member": False},
        },
        {"id": 7, "status": "lost", "items": [], "customer": {"name": "Bo", "age": 51, "member": False}},
    ),
    "wide": (_WIDE, {"field_0": "x", "field_1": 3, "field_3": "b", "field_4": [1.5, 2]}, {"field_0": "x"}),
    "json_object": ({"type": "object"}, {"a": [1, {"b": None}], "c": "d"}, [1, 2]),
}


class Library:
    """One grammar library behind the operations the engine needs."""

    name = ""

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        self.vocab, self.eos = vocab, eos
        self.words = (vocab + 31) // 32

    def compile(self, schema: dict) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None: ...  # [words] int32
    def consume(self, matcher: Any, token: int) -> bool: ...
    def rollback(self, matcher: Any, n: int) -> None: ...
    def reset(self, matcher: Any) -> None: ...


class Llguidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        super().__init__(tokenizer, vocab, eos)
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def compile(self, schema: dict) -> Any:
        options = {
            "whitespace_flexible": False,
            "item_separator": SEPARATORS[0],
            "key_separator": SEPARATORS[1],
        }
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        matcher = self.lib.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback(n)

    def reset(self, matcher: Any) -> None:
        matcher.reset()


class Xgrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        super().__init__(tokenizer, vocab, eos)
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict) -> Any:
        grammar = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )
        return self.lib.GrammarMatcher(grammar)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask.view(1, -1), 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback(n)

    def reset(self, matcher: Any) -> None:
        matcher.reset()


class OutlinesCore(Library):
    name = "outlines-core"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        super().__init__(tokenizer, vocab, eos)
        import outlines_core

        from serve_app.engine.logprobs import TokenPieces

        self.lib = outlines_core
        pieces, special = TokenPieces(tokenizer), set(tokenizer.all_special_ids)
        words: dict[bytes, list[int]] = {}
        for token in range(len(tokenizer)):
            if token != eos and token not in special:
                words.setdefault(pieces.piece(token)[1], []).append(token)
        self.vocabulary = outlines_core.Vocabulary(eos, words)

    def compile(self, schema: dict) -> Any:
        regex = self.lib.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
        return self.lib.Guide(self.lib.Index(regex, self.vocabulary))

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def consume(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback_state(n)

    def reset(self, matcher: Any) -> None:
        matcher.reset()


LIBRARIES: list[type[Library]] = [Llguidance, OutlinesCore, Xgrammar]


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ids a bitmask allows (the unpacking the engine does before masking logits)."""
    bits = (bitmask.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab].nonzero().flatten()


def follows(lib: Library, matcher: Any, tokens: list[int]) -> tuple[bool, list[float], list[float]]:
    """Whether ``tokens`` + EOS is allowed position by position; mask and consume times (seconds)."""
    lib.reset(matcher)
    bitmask = torch.zeros(lib.words, dtype=torch.int32)
    masks, consumes = [], []
    for token in [*tokens, lib.eos]:
        start = time.perf_counter()
        lib.fill(matcher, bitmask)
        masks.append(time.perf_counter() - start)
        if not allowed(bitmask, token):
            return False, masks, consumes
        if token == lib.eos:
            break
        start = time.perf_counter()
        ok = lib.consume(matcher, token)
        consumes.append(time.perf_counter() - start)
        if not ok:
            return False, masks, consumes
    return True, masks, consumes


def random_walks(
    lib: Library, matcher: Any, schema: dict, tokenizer: Any, walks: int, limit: int, seed: int
) -> tuple[int, int]:
    """Walks that pick random allowed tokens (short ones first: low ids are single characters in a
    byte-level BPE) and end as soon as EOS is allowed: (finished, valid per jsonschema)."""
    import jsonschema

    rng, finished, valid = random.Random(seed), 0, 0
    special = {lib.eos, *tokenizer.all_special_ids}  # ending is EOS's job alone
    bitmask = torch.zeros(lib.words, dtype=torch.int32)
    for _ in range(walks):
        out: list[int] = []
        lib.reset(matcher)
        for _ in range(limit):
            lib.fill(matcher, bitmask)
            ids = [t for t in allowed_ids(bitmask, lib.vocab).tolist() if t not in special]
            if allowed(bitmask, lib.eos) and (not ids or rng.random() < 0.5 or len(out) > limit // 2):
                finished += 1
                text = tokenizer.decode(out)
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as e:
                    print(f"    {lib.name}: invalid walk output {text!r}: {e}")
                break
            if not ids:
                break
            short = [t for t in ids if t < 1000]
            token = rng.choice(short if short and rng.random() < 0.9 else ids)
            out.append(token)
            if not lib.consume(matcher, token):
                break
    return finished, valid


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: str, names: list[str], repeats: int, walks: int) -> list[dict]:
    from transformers import AutoConfig, AutoTokenizer

    folder = STORE / model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    eos = tokenizer.eos_token_id
    rows = []
    for cls in LIBRARIES:
        if cls.name not in names:
            continue
        try:
            start = time.perf_counter()
            lib = cls(tokenizer, vocab, eos)
            setup = time.perf_counter() - start
        except ImportError as e:
            print(f"{cls.name}: not importable ({e}); skipped")
            continue
        for schema_name, (schema, good, bad) in SCHEMAS.items():
            start = time.perf_counter()
            matcher = lib.compile(schema)
            compile_s = time.perf_counter() - start
            if compile_s < 2:  # a slow one is timed once
                compile_s = timed(lambda lib=lib, schema=schema: lib.compile(schema), repeats)
            good_ids = tokenizer(json.dumps(good), add_special_tokens=False)["input_ids"]
            bad_ids = tokenizer(json.dumps(bad), add_special_tokens=False)["input_ids"]
            masks, consumes, ok = [], [], True
            for _ in range(repeats):
                passed, m, c = follows(lib, matcher, good_ids)
                ok, masks, consumes = ok and passed, masks + m, consumes + c
            refused = not follows(lib, matcher, bad_ids)[0]
            # Speculation's pattern: masks along a 4-token draft, then back to where it started.
            lib.reset(matcher)
            bitmask = torch.zeros(lib.words, dtype=torch.int32)
            draft = good_ids[:4]

            def spec(
                lib: Library = lib,
                matcher: Any = matcher,
                bitmask: torch.Tensor = bitmask,
                draft: list[int] = draft,
            ) -> None:
                for token in draft:
                    lib.fill(matcher, bitmask)
                    lib.consume(matcher, token)
                lib.fill(matcher, bitmask)
                lib.rollback(matcher, len(draft))

            spec_s = timed(spec, repeats * 5)
            done, valid = random_walks(lib, matcher, schema, tokenizer, walks, 300, seed=len(rows))
            row = {
                "model": model, "library": cls.name, "schema": schema_name, "setup_s": setup,
                "compile_ms": compile_s * 1e3, "mask_us": statistics.median(masks) * 1e6,
                "mask_p90_us": statistics.quantiles(masks, n=10)[-1] * 1e6,
                "consume_us": statistics.median(consumes) * 1e6 if consumes else 0.0,
                "spec4_us": spec_s * 1e6, "valid_accepted": ok, "invalid_refused": refused,
                "walks": walks, "walks_finished": done, "walks_valid": valid,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row))
    return rows


def table(rows: list[dict]) -> str:
    """The rows as BENCHMARKS.md's markdown table."""
    head = ("| model | library | schema | set-up s | compile ms | mask us (p50 / p90) | consume us | "
            "4-draft masks + rollback us | valid ok | invalid refused | walks valid/ended/all |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['library']} | {r['schema']} | {r['setup_s']:.2f} | {r['compile_ms']:.1f} | "
            f"{r['mask_us']:.0f} / {r['mask_p90_us']:.0f} | {r['consume_us']:.0f} | {r['spec4_us']:.0f} | "
            f"{'yes' if r['valid_accepted'] else 'NO'} | {'yes' if r['invalid_refused'] else 'NO'} | "
            f"{r['walks_valid']}/{r['walks_finished']}/{r['walks']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"]
    )
    parser.add_argument("--libraries", nargs="+", default=[c.name for c in LIBRARIES])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--walks", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for model in args.models for row in measure(model, args.libraries, args.repeats, args.walks)]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
