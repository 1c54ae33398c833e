"""A Llama-family checkpoint's shape, read from its Hugging Face config: ``DecoderConfig``, the
rotary tables for its rope settings, and its EOS ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a decoder, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, hf_config: object) -> DecoderConfig:
        model_type = getattr(hf_config, "model_type", "?")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {hf_config.hidden_act!r} (only silu)")
        heads = hf_config.num_attention_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        window = getattr(hf_config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            sliding_window=window,
        )

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + head + h


def rope_tables(hf_config: object, head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``0..length-1``: ``[length, head_dim]`` float32 each.

    Supports every static rope type of ``transformers`` (default, linear, llama3, yarn, ...);
    ``dynamic`` depends on the sequence length at run time and is refused.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x names
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling is not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    rotary_dim = head_dim
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq.float())  # [L, rotary/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [L, rotary]
    return angles.cos() * scaling, angles.sin() * scaling


def read_generation_eos(path: str | Path) -> list[int]:
    """EOS ids from ``generation_config.json`` and ``config.json`` (either may hold a list)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.exists():
            value = json.loads(file.read_text()).get("eos_token_id")
            for i in value if isinstance(value, list) else [value]:
                if isinstance(i, int) and i not in ids:
                    ids.append(i)
    return ids
