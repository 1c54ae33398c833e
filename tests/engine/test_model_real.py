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


def test_greedy_bf16_diverges_only_at_near_ties(smollm2_path, tokenizer) -> None:
    """bf16 kernels round differently from transformers'; any divergence must be a near-tie."""
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).eval()
    engine = SpecEngine.from_path(smollm2_path, EngineConfig(max_slots=1, max_seq_len=256), "bfloat16", "cpu")
    for text in PROMPTS:
        prompt = engine.encode_prompt(text)
        ours = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        ref_ids = ref[0, len(prompt) :].tolist()
        if ours.token_ids == ref_ids:
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours.token_ids, ref_ids, strict=True)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref_ids[:first]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        # bf16 carries 8 bits of mantissa: logits around 20 are only resolved to ~0.1.
        noise = 2**-7 * max(top2[0].abs().item(), 1.0) * 4
        assert (top2[0] - top2[1]).item() <= noise, (text, first, top2)
