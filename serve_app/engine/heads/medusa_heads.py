"""Medusa heads at inference: residual blocks over the target's last feature, each reading one
token further ahead off the target's own output head (Cai et al. 2024).

Given feature_t, the target's head predicts token_{t+1}; head k (k = 0..K-1) predicts token_{t+2+k}:

    h_k      = feature_t + silu(W_k feature_t + b_k)       # [B, K, H]
    logits_k = head(h_k)                                   # [B, K, vocab]

So the feature of the position that chose the last emitted token drafts K tokens at once, with no
forward of any model: K small products and one output head over K rows. The feature comes from the
forward that verified the last step (no extra target pass). Tensor names: ``medusa_names(k)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from serve_app.engine.model import DecoderModel
from serve_app.engine.q8_weight import Q8Weight
from serve_app.engine.weights import Weight, linear, prepack, weight_nbytes


def medusa_names(k: int) -> tuple[str, str]:
    """(weight, bias) names of head ``k`` in a head file."""
    return f"medusa.{k}.weight", f"medusa.{k}.bias"


class MedusaHeads:
    """K residual blocks fused into one product, and the restricted output head."""

    def __init__(
        self,
        target: DecoderModel,
        tensors: Mapping[str, torch.Tensor],
        num_heads: int,
        head_ids: Sequence[int] | None,
        output_head: torch.Tensor,
        weight_format: str = "q8",
    ) -> None:
        if weight_format not in ("dense", "q8"):
            raise ValueError(f"Medusa heads' weight_format is dense or q8, not {weight_format!r}")
        dtype = target.dtype
        pack = Q8Weight.quantize if weight_format == "q8" else prepack
        blocks = torch.cat([tensors[medusa_names(k)[0]] for k in range(num_heads)]).to(dtype)  # [K H, H]
        self.blocks: Weight = pack(blocks)
        self.bias = torch.cat([tensors[medusa_names(k)[1]] for k in range(num_heads)]).to(dtype)  # [K H]
        self.head_ids = None if head_ids is None else torch.tensor(sorted(set(head_ids)))
        rows = output_head if self.head_ids is None else output_head.index_select(0, self.head_ids)
        self.head: Weight = pack(rows.to(dtype).contiguous())
        self.num_heads = num_heads
        self.vocab_size = target.cfg.vocab_size
        self.dtype = dtype

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features ``[B, H]`` -> ``[B, K, vocab]`` float32 (-inf outside the head's tokens)."""
        batch, hidden = features.shape
        x = features.to(self.dtype)
        grown = F.silu(linear(x, self.blocks, self.bias)).view(batch, self.num_heads, hidden)
        logits = linear(x[:, None, :] + grown, self.head).float()  # [B, K, N]
        if self.head_ids is None:
            return logits
        full = logits.new_full((batch, self.num_heads, self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_ids, logits)

    @property
    def weight_bytes(self) -> int:
        return weight_nbytes(self.blocks) + weight_nbytes(self.head)
