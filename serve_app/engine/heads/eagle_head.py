"""The EAGLE head at inference: one decoder layer over (the target's feature, the next token).

The head predicts the target's next feature (its final, normed hidden state) from the previous
feature and the token that followed it, then reads tokens off the prediction with the target's own
output head (restricted to the most frequent tokens, as the draft model's is):

    x_t  = fc([embed(token_t), feature_{t-1}])            # [B, T, 2H] -> [B, T, H]
    g_t  = norm(x_t + layer(x_t))                          # one Llama block, its own KV slots
    logits_t = head(g_t)                                   # g_t ~ feature_t: predicts token_{t+1}

Row ``r`` of the head's cache holds the pair ``(feature_r, token_{r+1})``; rotary positions are the
rows (attention sees only differences). Drafting feeds the head's own prediction back as the next
feature. The layer is a ``DecoderModel`` of one layer (its forward takes ``embeds``), so the
head runs on the same kernels, KV cache and formats as every other model here.

Tensor names (``HeadManifest.config`` gives the sizes): ``fc.weight`` ``[H, 2H]``, ``norm.weight``,
and the block's Hugging Face names under ``layer.`` (``layer.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from serve_app.engine.kv_cache import KVCache
from serve_app.engine.model import DecoderModel, DraftOptions
from serve_app.engine.q8_weight import Q8Weight
from serve_app.engine.weights import Weight, linear, prepack, weight_nbytes

EAGLE_PREFIX = "layer."


def dense_output_head(target: DecoderModel, target_path: str | Path | None) -> torch.Tensor:
    """The target's output head as a dense ``[vocab, hidden]`` tensor: the embedding where tied,
    else ``lm_head.weight`` read from the folder's safetensors (a quantized target keeps none)."""
    if target.cfg.tie_word_embeddings:
        return target.embed
    if isinstance(target.lm_head, torch.Tensor) and not target.lm_head.is_mkldnn:
        return target.lm_head
    if target_path is None:
        raise ValueError("the target's output head is quantized; its folder is needed for a dense copy")
    from safetensors import safe_open

    for file in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if "lm_head.weight" in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return f.get_tensor("lm_head.weight").to(target.dtype)
    raise FileNotFoundError(f"no lm_head.weight in {target_path}")


class EagleHead:
    """fc + a one-layer ``DecoderModel``; ``forward`` / ``logits`` like a model's, plus features."""

    def __init__(
        self,
        target: DecoderModel,
        tensors: Mapping[str, torch.Tensor],
        intermediate_size: int,
        head_ids: Sequence[int] | None,
        output_head: torch.Tensor,
        weight_format: str = "q8",
    ) -> None:
        """``output_head``: the target's dense head ``[vocab, hidden]`` (``dense_output_head``);
        ``weight_format``: "dense" (the target's dtype) or "q8" (the layer and head rows in Q8)."""
        if weight_format not in ("dense", "q8"):
            raise ValueError(f"an EAGLE head's weight_format is dense or q8, not {weight_format!r}")
        dtype = target.dtype
        cfg = replace(
            target.cfg, num_layers=1, intermediate_size=intermediate_size, tie_word_embeddings=False
        )
        weights = {f"model.layers.0.{k[len(EAGLE_PREFIX):]}": v.to(dtype)
                   for k, v in tensors.items() if k.startswith(EAGLE_PREFIX)}  # fmt: skip
        weights["model.embed_tokens.weight"] = target.embed
        weights["model.norm.weight"] = tensors["norm.weight"].to(dtype)
        weights["lm_head.weight"] = output_head
        draft = DraftOptions(head_ids=tuple(head_ids) if head_ids is not None else None)
        self.model = DecoderModel(cfg, target.hf_config, weights, draft, weight_format)
        fc = tensors["fc.weight"].to(dtype)
        self.fc: Weight = Q8Weight.quantize(fc) if weight_format == "q8" else prepack(fc)
        self.cfg = cfg
        self.device = target.device
        self.dtype = dtype

    def new_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        return self.model.new_cache(num_slots, max_seq_len)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] the token of each pair
        cache: KVCache,
        slots: Sequence[int],
        positions: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
        features: torch.Tensor | None = None,  # [B, T, H] the feature before each token; None = zeros
    ) -> torch.Tensor:
        """Predicted features ``[B, T, hidden]`` (K/V written at each row's cache length + t)."""
        embedded = F.embedding(tokens, self.model.embed)  # [B, T, H]
        if features is None:  # the profiler's draft step: same cost, any numbers
            features = torch.zeros_like(embedded)
        x = linear(torch.cat([embedded, features.to(embedded.dtype)], dim=-1), self.fc)  # [B, T, H]
        return self.model.forward(tokens, cache, slots, positions, block_mask, embeds=x)

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., vocab]`` float32, -inf outside the head's tokens."""
        return self.model.logits(hidden)

    @property
    def weight_bytes(self) -> int:
        """Bytes one draft step reads (the embedding row lookups aside)."""
        model = self.model
        return (
            weight_nbytes(self.fc)
            + weight_nbytes(model.lm_head)
            + sum(weight_nbytes(t) for t in model.layers[0].tensors())
        )
