"""One pre-norm transformer block of a Llama-family decoder, and the ops it is made of.

``DecoderLayer`` holds a block's norms, its fused products (q/k/v in one matrix, gate/up in
another: two matrix-vector products per block instead of five) and their row plans; its call runs
RMSNorm, the attention half (rotary embedding, KV cache write, grouped-query attention) and the
SwiGLU MLP, the Python form of what ``kernels/decoder_layers.cpp`` runs in one call
(``engine.native_layers``). ``engine.model`` stacks these blocks into a decoder.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from serve_app.engine.attention import VALUE_CHUNK, CachedAttention, grouped_attention, native_kernels
from serve_app.engine.decoder_config import DecoderConfig
from serve_app.engine.invariance import RowPlan
from serve_app.engine.kv_cache import CacheBatch, KVCache
from serve_app.engine.packing import LayerPacker
from serve_app.engine.weights import Weight, linear, prepack


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., hidden]`` scaled by ``weight`` (transformers' numbers)."""
    if (native := native_kernels(x)) is not None and weight.dtype == torch.float32:  # one call, not eight ops
        return native.rms_norm(x, weight, eps)
    # As transformers computes it: statistics in float32, scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` at the positions ``cos`` / ``sin`` were taken at."""
    # x: [B, H, T, D]; cos, sin: [B, 1, T, D]. Rotates pairs (i, i + D/2).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Up to this many new tokens per row (decode, verification) attention runs as two small matmuls
# with the query heads of a KV group folded together; above it (prefill), through SDPA. CPU's
# flash kernel costs ~0.4 ms per call even for one query, i.e. ~11 ms per step on a 28-layer model.
SMALL_QUERY = 64
PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's matrix products
ATTENTION = "attention"  # the plan of a layer's folded query rows (attention.grouped_attention)


class DecoderLayer:
    """One pre-norm transformer block; plain tensors, no nn.Module call overhead."""

    def __init__(
        self, cfg: DecoderConfig, weights: dict[str, torch.Tensor], pack: LayerPacker | None = None
    ) -> None:
        pack = pack or (lambda names: prepack(torch.cat([weights[n] for n in names])))
        self.cfg = cfg
        self.attn_norm = weights["input_layernorm.weight"]
        self.mlp_norm = weights["post_attention_layernorm.weight"]
        self.qkv = pack([f"self_attn.{n}_proj.weight" for n in "qkv"])
        self.qkv_bias = (
            torch.cat([weights[f"self_attn.{n}_proj.bias"] for n in "qkv"]) if cfg.qkv_bias else None
        )
        self.o = pack(["self_attn.o_proj.weight"])
        self.o_bias = weights.get("self_attn.o_proj.bias") if cfg.o_bias else None
        self.gate_up = pack(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
        self.gate_up_bias = (
            torch.cat([weights["mlp.gate_proj.bias"], weights["mlp.up_proj.bias"]]) if cfg.mlp_bias else None
        )
        self.down = pack(["mlp.down_proj.weight"])
        self.down_bias = weights.get("mlp.down_proj.bias") if cfg.mlp_bias else None
        # Row plans per product (engine.invariance), set by engine.exactness.make_exact.
        self.plans: dict[str, RowPlan | None] = dict.fromkeys((*PRODUCTS, ATTENTION))
        self.key_block = 1  # attention's keys padded to a multiple of this (engine.exactness)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def tensors(self) -> Iterator[Weight]:
        for t in (self.attn_norm, self.mlp_norm, self.qkv, self.qkv_bias, self.o, self.o_bias,
                  self.gate_up, self.gate_up_bias, self.down, self.down_bias):  # fmt: skip
            if t is not None:
                yield t

    def __call__(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        index: int,
        cache: KVCache,
        batch: CacheBatch,
        cos: torch.Tensor,  # [B, 1, T, D]
        sin: torch.Tensor,
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = attend; None = all of the S rows
        causal: bool,
        one_call: CachedAttention | None = None,  # the step's one-call attention, where it runs
    ) -> torch.Tensor:
        cfg = self.cfg
        bsz, steps, _ = x.shape
        h = rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        plans = self.plans
        qkv = linear(h, self.qkv, self.qkv_bias, plans["qkv"])  # [B, T, (H + 2 H_kv) D]
        if one_call is not None:  # rotation, cache write and attention: the numbers of the ops below
            attn = one_call(qkv, cache, index, batch, cfg.num_heads, self.scale)  # [B, T, H D]
            return self._mlp(x + linear(attn, self.o, self.o_bias, plans["o"]))
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(bsz, steps, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(bsz, steps, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = v.view(bsz, steps, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        cache.write(index, batch, k, v)
        if steps <= SMALL_QUERY:
            # the keys' padding (a multiple of key_block) read from the cache itself, no copy
            padded = min(-(-batch.upto // self.key_block) * self.key_block, cache.max_seq_len)
            # values up to whole chunks of attention.VALUE_CHUNK rows (no copy for one row)
            whole = min(-(-padded // VALUE_CHUNK) * VALUE_CHUNK, cache.max_seq_len)
            keys, values = cache.read(index, batch, padded, whole)  # [B, H_kv, S', D], [B, H_kv, S'', D]
            attn = grouped_attention(q, keys, values, mask, self.scale, plans[ATTENTION], self.key_block,
                                      batch.upto)  # fmt: skip
        else:
            keys, values = cache.read(index, batch)  # [B, H_kv, S, D]
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )  # fmt: skip
        attn = attn.transpose(1, 2).reshape(bsz, steps, self.q_size)  # [B, T, H D]
        return self._mlp(x + linear(attn, self.o, self.o_bias, plans["o"]))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The block's second half: ``x + down(silu(gate) * up)`` of the normed ``x`` ``[B, T, hidden]``."""
        plans = self.plans
        h = rms_norm(x, self.mlp_norm, self.cfg.rms_norm_eps)
        gate, up = linear(h, self.gate_up, self.gate_up_bias, plans["gate_up"]).chunk(2, dim=-1)  # [B, T, I]
        return x + linear(F.silu(gate) * up, self.down, self.down_bias, plans["down"])
