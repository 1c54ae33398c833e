"""Our decoder runtime against transformers: same weights, same logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from serve_app.engine.decoder_config import DecoderConfig
from serve_app.engine.model import DecoderModel

ARCHS = {
    "llama": (LlamaConfig, {}),
    "llama-biased-tied": (
        LlamaConfig,
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    "llama3-rope": (
        LlamaConfig,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": (Qwen2Config, {}),
    "mistral-window": (MistralConfig, {"sliding_window": 5}),
}


def tiny_hf(arch: str, seed: int = 0) -> torch.nn.Module:
    config_cls, extra = ARCHS[arch]
    kwargs = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)  # fmt: skip
    kwargs.update(extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs)).float().eval()
    with torch.no_grad():  # random biases too, so the bias paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 1e-5 * max(scale, 1.0), (ours - ref).abs().max()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_logits_match_transformers(arch: str) -> None:
    hf = tiny_hf(arch)
    ours = DecoderModel.from_hf_model(hf)
    ids = torch.randint(0, 101, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(2, 64)
    slot = cache.allocate()
    close(ours.logits(ours.forward(ids, cache, [slot])), ref)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_incremental_and_ragged_batch_match_transformers(arch: str) -> None:
    hf = tiny_hf(arch)
    ours = DecoderModel.from_hf_model(hf)
    gen = torch.Generator().manual_seed(2)
    long_ids = torch.randint(0, 101, (1, 15), generator=gen)
    short_ids = torch.randint(0, 101, (1, 6), generator=gen)
    with torch.no_grad():
        ref_long, ref_short = hf(long_ids).logits, hf(short_ids).logits
    cache = ours.new_cache(3, 64)
    a, b = cache.allocate(), cache.allocate()

    # Prefill 4, then chunks of 1, 3 and the rest: each chunk's logits equal the full pass.
    pieces, done = [], 0
    for size in (4, 1, 3, 7):
        h = ours.forward(long_ids[:, done : done + size], cache, [a])
        pieces.append(ours.logits(h))
        done += size
        cache.set_length(a, done)
    close(torch.cat(pieces, dim=1), ref_long)

    # Two rows of different lengths in one forward, right-padded, from different cache lengths.
    ours.forward(short_ids[:, :2], cache, [b])  # row b's cache: its first 2 tokens
    cache.set_length(b, 2)
    cache.set_length(a, 10)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    tokens[0] = long_ids[0, 10:15]
    tokens[1, :4] = short_ids[0, 2:6]
    logits = ours.logits(ours.forward(tokens, cache, [a, b]))
    close(logits[0], ref_long[0, 10:15])
    close(logits[1, :4], ref_short[0, 2:6])


def test_rollback_rewrites_only_what_is_kept() -> None:
    hf = tiny_hf("qwen2")
    ours = DecoderModel.from_hf_model(hf)
    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(1, 32)
    slot = cache.allocate()
    ours.forward(ids[:, :8], cache, [slot])
    cache.set_length(slot, 8)
    # Speculate 4 wrong tokens, keep none: rollback is not moving the length.
    ours.forward(torch.full((1, 4), 7), cache, [slot])
    close(ours.logits(ours.forward(ids[:, 8:], cache, [slot])), ref[:, 8:])


def test_block_mask_tree_equals_separate_branches() -> None:
    """Two branches after a shared prefix, in one forward with a tree mask and explicit positions."""
    hf = tiny_hf("llama")
    ours = DecoderModel.from_hf_model(hf)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 101, (1, 6), generator=gen)
    branch_a = torch.randint(0, 101, (1, 2), generator=gen)
    branch_b = torch.randint(0, 101, (1, 2), generator=gen)
    with torch.no_grad():
        ref_a = hf(torch.cat([prefix, branch_a], 1)).logits[:, 6:]
        ref_b = hf(torch.cat([prefix, branch_b], 1)).logits[:, 6:]
    cache = ours.new_cache(1, 32)
    slot = cache.allocate()
    ours.forward(prefix, cache, [slot])
    cache.set_length(slot, 6)
    tokens = torch.cat([branch_a, branch_b], 1)  # [1, 4]: a0 a1 b0 b1
    positions = torch.tensor([[6, 7, 6, 7]])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)[None]
    logits = ours.logits(ours.forward(tokens, cache, [slot], positions=positions, block_mask=tree))
    close(logits[:, :2], ref_a)
    close(logits[:, 2:], ref_b)


def test_config_rejects_unknown_architecture() -> None:
    class Fake:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        DecoderConfig.from_hf(Fake())


def test_parameter_count_matches_transformers() -> None:
    for arch in ("llama", "qwen2", "llama-biased-tied"):
        hf = tiny_hf(arch)
        ours = DecoderModel.from_hf_model(hf)
        expected = sum(p.numel() for p in hf.parameters())
        biases = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("bias"))
        assert ours.cfg.num_parameters == expected - biases


def test_loads_from_saved_folder_in_bf16(tmp_path) -> None:
    hf = tiny_hf("qwen2")
    hf.save_pretrained(tmp_path)
    ours = DecoderModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(5))
    hf_bf16 = hf.to(torch.bfloat16)
    with torch.no_grad():
        ref = hf_bf16(ids).logits.float()
    cache = ours.new_cache(1, 16)
    got = ours.logits(ours.forward(ids, cache, [cache.allocate()]))
    # bf16 kernels may round differently; both are within bf16 noise of each other.
    assert (got - ref).abs().max().item() < 0.05 * max(ref.abs().max().item(), 1.0)
