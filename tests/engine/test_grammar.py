"""Structured output (``engine.grammar``) on tiny models.

The grammar masks the target's tokens at every position, so a random tiny model writes JSON that
parses and validates; speculation (n-gram, self, draft; depths 1 and 4; greedy and seeded) with a
grammar gives exactly plain decoding's tokens with the same grammar; a draft is cut before the
first token the grammar refuses; requests without a format pay nothing.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from serve_app.engine.grammar import GrammarCompiler, allowed_tokens, constrain, trim_drafts
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.base import Draft
from serve_app.engine.structured import JSON_OPTIONS, StructuredOutput
from tests.conftest import make_tiny_engine, make_tiny_hf_model

PROMPTS = ['{"name": "specserve", "version": 1}', "def add(a, b):", "The quick brown fox"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "version": {"type": "integer", "minimum": 0, "maximum": 99},
        "fast": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["fast", "lossless"]}, "maxItems": 3},
    },
    "required": ["name", "version", "fast", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}, "inner": SCHEMA},
    "required": ["kind", "inner"],
    "additionalProperties": False,
}
FORMATS = [
    StructuredOutput.json_schema(SCHEMA),
    StructuredOutput.json_schema(NESTED),
    StructuredOutput.json_object(),
]
NGRAM = {"max_ngram": 3, "min_ngram": 1}


def params_for(structured: StructuredOutput, seeded: bool, max_tokens: int = 80) -> SamplingParams:
    sampling = {"temperature": 0.9, "seed": 11} if seeded else {"temperature": 0.0}
    return SamplingParams(max_tokens=max_tokens, structured=structured, **sampling)


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    return make_tiny_hf_model(len(tiny_tokenizer), seed=0, layers=4)


@pytest.fixture(scope="module")
def engine(target_hf, tiny_tokenizer):
    proposers = {"ngram": NGRAM, "self": {}, "draft": {}}
    return make_tiny_engine(target_hf, tiny_tokenizer, proposers=proposers, max_depth=8, self_skip=[1],
                            max_seq_len=192)  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


def assert_valid(text: str, structured: StructuredOutput) -> None:
    value = json.loads(text)
    jsonschema.validate(value, structured.schema)
    assert isinstance(value, dict)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_speculation_with_a_grammar_equals_plain_decoding(engine, prompts, seeded) -> None:
    params = [params_for(f, seeded) for f in FORMATS]
    plain = engine.generate(prompts, params, SpecOverride("off"))
    finished = [r for r in plain if r.finish_reason == "stop"]
    assert finished  # the grammar ends the bounded schemas with EOS
    for result, p in zip(plain, params, strict=True):
        if result.finish_reason == "stop":
            assert_valid(result.text, p.structured)
    accepted: dict[str, int] = {}
    for mode in ("ngram", "self", "draft"):
        for depth in (1, 4):
            spec = engine.generate(prompts, params, SpecOverride(mode, depth))
            for s, p in zip(spec, plain, strict=True):
                assert s.token_ids == p.token_ids, (mode, depth)
                assert s.finish_reason == p.finish_reason
                accepted[mode] = accepted.get(mode, 0) + s.spec_stats.accepted
    assert all(accepted.values()), accepted  # every proposer had drafts verified and kept


def test_plain_text_and_structured_requests_share_a_batch(engine, prompts) -> None:
    """A grammar row beside free rows: each gets what it gets alone."""
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    params = [free, params_for(FORMATS[0], seeded=False), free]
    together = engine.generate(prompts, params, SpecOverride("draft", 4))
    for prompt, p, result in zip(prompts, params, together, strict=True):
        (alone,) = engine.generate([prompt], [p], SpecOverride("off"))
        assert result.token_ids == alone.token_ids


def test_rejection_sampling_with_a_draft_distribution_stays_in_the_grammar(
    target_hf, tiny_tokenizer, prompts
):
    """A rejection-sampling row keeps its draft whole (its residual needs q), masked all the same."""
    engine = make_tiny_engine(target_hf, tiny_tokenizer, proposers={"draft": {}}, max_seq_len=192,
                              sampling="rejection")  # fmt: skip
    params = [params_for(f, seeded=True, max_tokens=120) for f in FORMATS]
    for result, p in zip(engine.generate(prompts, params, SpecOverride("draft", 4)), params, strict=True):
        if result.finish_reason == "stop":
            assert_valid(result.text, p.structured)
        else:  # cut by max_tokens: still a prefix the grammar allows
            grammar = engine.grammars.compile(p.structured)
            assert grammar.accepted_prefix(result.token_ids) == len(result.token_ids)


def test_eos_only_where_the_grammar_accepts(engine, tiny_tokenizer) -> None:
    grammar = engine.grammars.compile(StructuredOutput.json_object())
    eos = tiny_tokenizer.convert_tokens_to_ids("<eos>")
    vocab = engine.model.cfg.vocab_size
    assert not allowed_tokens(grammar.bitmasks([]), vocab)[0, eos]  # nothing written yet
    ids = tiny_tokenizer('{"a": 1}', add_special_tokens=False)["input_ids"]
    assert grammar.accepted_prefix([*ids, eos]) == len(ids) + 1
    masks = allowed_tokens(grammar.bitmasks(ids), vocab)  # [len + 1, V]
    assert masks[-1, eos] and masks[-1].sum() == 1  # the object is closed: only EOS
    assert not masks[:-1, eos].any()
    assert grammar.consumed == 0 and grammar.bitmasks([]).equal(grammar.bitmasks([]))  # state put back


def test_drafts_end_at_the_first_token_the_grammar_refuses(engine, tiny_tokenizer) -> None:
    ids = tiny_tokenizer('{"name": "x"', add_special_tokens=False)["input_ids"]
    bad = tiny_tokenizer("def", add_special_tokens=False)["input_ids"][0]
    grammar = engine.grammars.compile(StructuredOutput.json_schema(SCHEMA))
    row = SimpleNamespace(grammar=grammar, output_ids=ids[:1], generator=None)
    free = SimpleNamespace(grammar=None, output_ids=[5], generator=None)
    probs = torch.full((4, engine.model.cfg.vocab_size), 1.0 / engine.model.cfg.vocab_size)
    drafts = [Draft([*ids[1:3], bad, ids[3]], probs), Draft([bad, bad])]
    trimmed = trim_drafts([row, free], drafts)
    assert trimmed[0].tokens == ids[1:3] and tuple(trimmed[0].probs.shape) == (2, probs.shape[1])
    assert trimmed[1] is drafts[1]  # a free row's draft is untouched
    # A rejection-sampling row with a draft distribution keeps its draft (module docstring).
    sampled = SimpleNamespace(grammar=grammar, output_ids=ids[:1], generator=torch.Generator())
    assert trim_drafts([sampled], drafts[:1])[0] is drafts[0]


def test_requests_without_a_format_pay_nothing(engine, prompts) -> None:
    rows = [SimpleNamespace(grammar=None, output_ids=[1], generator=None)] * 2
    logits = torch.randn(2, 3, engine.model.cfg.vocab_size)
    drafts = [Draft([1, 2]), Draft([])]
    assert constrain(logits, rows, [d.tokens for d in drafts]) is logits
    assert trim_drafts(rows, drafts) is drafts


def test_masked_positions_follow_the_draft(engine, tiny_tokenizer) -> None:
    """constrain masks position j after the draft's first j tokens, the others untouched."""
    ids = tiny_tokenizer('{"a": [1, 2]}', add_special_tokens=False)["input_ids"]
    compiler: GrammarCompiler = engine.grammars
    row = SimpleNamespace(
        grammar=compiler.compile(StructuredOutput.json_object()), output_ids=[], generator=None
    )
    vocab = engine.model.cfg.vocab_size
    logits = torch.randn(1, 5, vocab)
    out = constrain(logits, [row], [ids[:3]])
    reference = compiler.compile(StructuredOutput.json_object())
    for j in range(4):
        allowed = allowed_tokens(reference.bitmasks(ids[:j])[-1:], vocab)[0]
        assert torch.equal(out[0, j], logits[0, j].masked_fill(~allowed, float("-inf")))
    assert torch.equal(out[0, 4], logits[0, 4])  # past the draft: never used


@pytest.mark.parametrize("schema", [{"type": "objekt"}, {"type": "string", "pattern": "(unclosed"}])
def test_a_schema_the_grammar_cannot_compile_is_a_value_error(engine, prompts, schema) -> None:
    params = SamplingParams(max_tokens=5, structured=StructuredOutput.json_schema(schema))
    with pytest.raises(ValueError, match="invalid JSON schema"):
        engine.add_request(prompts[0], params)


def test_structured_output_is_data() -> None:
    a = StructuredOutput.json_schema({"b": 1, "a": {"type": "object"}})
    assert a == StructuredOutput.json_schema({"b": 1, "a": {"type": "object"}}) and hash(a)
    assert list(a.schema) == ["b", "a"]  # the schema's order: the order properties are written in
    with pytest.raises(ValueError):
        StructuredOutput.json_schema({"x": float("nan")})
    with pytest.raises(ValueError):
        StructuredOutput("regex")  # type: ignore[arg-type]


def test_a_lark_grammar_wraps_a_schema_in_text(engine, prompts) -> None:
    """What a forced tool call needs: ``<tool_call>`` + a JSON value of a schema + ``</tool_call>``."""
    schema = {**SCHEMA, "x-guidance": JSON_OPTIONS}  # the engine's JSON whitespace inside Lark too
    lark = f'start: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
    params = SamplingParams(max_tokens=100, temperature=0.0, structured=StructuredOutput.lark(lark))
    (plain,) = engine.generate(prompts[:1], [params], SpecOverride("off"))
    assert plain.finish_reason == "stop", plain.text
    assert plain.text.startswith("<tool_call>\n") and plain.text.endswith("\n</tool_call>")
    jsonschema.validate(
        json.loads(plain.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")), SCHEMA
    )
    (spec,) = engine.generate(prompts[:1], [params], SpecOverride("self", 4))
    assert spec.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="invalid grammar"):
        engine.add_request(
            prompts[0], SamplingParams(max_tokens=5, structured=StructuredOutput.lark("start: nothing"))
        )
