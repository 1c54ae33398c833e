"""Real weights (SmolLM2-135M from its model pack): our runtime against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "The three primary colours are",
    '{"city": "Paris", "country":',
]


@pytest.fixture(scope="module")
def hf_fp32(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_logits_match_transformers_fp32(smollm2_path, hf_fp32, tokenizer) -> None:
    ours = DecoderModel.from_pretrained(smollm2_path, dtype=torch.float32)
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"] + tokenizer(PROMPTS[1])["input_ids"]])
    with torch.no_grad():
        ref = hf_fp32(ids).logits
    cache = ours.new_cache(1, 128)
    slot = cache.allocate()
    # Prefill all but 3 tokens, then decode them one by one.
    split = ids.shape[1] - 3
    pieces = [ours.logits(ours.forward(ids[:, :split], cache, [slot]))]
    cache.set_length(slot, split)
    for t in range(split, ids.shape[1]):
        pieces.append(ours.logits(ours.forward(ids[:, t : t + 1], cache, [slot])))
        cache.set_length(slot, t + 1)
    got = torch.cat(pieces, dim=1)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 1e-4 * scale


def test_greedy_generation_matches_transformers_fp32(smollm2_path, hf_fp32, tokenizer) -> None:
    engine = SpecEngine.from_path(smollm2_path, EngineConfig(max_slots=4, max_seq_len=256), "float32", "cpu")
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)  # one batch: batching must not change anything
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            ref = hf_fp32.generate(
                torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )
        assert result.token_ids == ref[0, len(prompt) :].tolist()
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_bf16_logits_match_transformers_bf16_within_its_precision(smollm2_path, hf_fp32, tokenizer) -> None:
    """Against transformers in bf16 (another implementation, other roundings) the promise is
    closeness of the logits, not equal tokens; both stay within bf16's precision of the float32
    reference. (Equality is what speculation promises against our own plain decoding:
    test_exact_real.)"""
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).eval()
    ours = DecoderModel.from_pretrained(smollm2_path, dtype=torch.bfloat16)
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"] + tokenizer(PROMPTS[2])["input_ids"]])
    with torch.no_grad():
        ref = hf_fp32(ids).logits
        theirs = hf(ids).logits.float()
    cache = ours.new_cache(1, 128)
    got = ours.logits(ours.forward(ids, cache, [cache.allocate()]))
    scale = ref.abs().max().item()
    theirs_error = (theirs - ref).abs().max().item()
    assert (got - ref).abs().max().item() < max(2 * theirs_error, 0.05 * scale)
