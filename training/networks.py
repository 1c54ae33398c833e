"""The heads as trainable ``torch.nn`` modules: the same arithmetic as their runtimes in
``serve_app.engine.heads`` (a test checks them against each other), with autograd.

The target's embedding and output-head rows are frozen inputs, never parameters: a head file
holds only what was trained (``state_tensors``), and the runtime takes the rest from the target.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.engine.decoder_config import DecoderConfig, rope_tables
from serve_app.engine.heads.eagle_head import EAGLE_PREFIX
from serve_app.engine.heads.medusa_heads import medusa_names


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def unrolled_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """``[T, (step + 1) T]`` bool: which keys of steps 0 .. step a row of ``step`` attends (True).

    Keys are laid out step after step. Query row r of step s sees step 0's rows j <= r - s and,
    for t = 1 .. s, step t's row r - s + t (one row per step: the drafted chain behind it).
    """
    row = torch.arange(length, device=device)[:, None]  # [T, 1]
    col = torch.arange(length, device=device)[None, :]  # [1, T]
    blocks = [col <= row - step] + [col == row - step + t for t in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class EagleNet(nn.Module):
    """fc over [embedding, feature], one Llama block, a final norm (``engine.heads.eagle_head``)."""

    def __init__(self, cfg: DecoderConfig, hf_config: object, intermediate_size: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg, self.hf_config = cfg, hf_config
        self.fc = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():  # start as "the next feature is the previous one" plus a little token
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.weight[:, :h].normal_(0.0, 0.02)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, h, bias=cfg.mlp_bias)
        self.norm = nn.Parameter(torch.ones(h))
        for proj in (self.o_proj, self.down_proj):  # the block starts near the identity
            nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2))
        self.intermediate_size = intermediate_size

    def forward(
        self, tokens: torch.Tensor, features: torch.Tensor, embed: torch.Tensor, steps: int = 1
    ) -> list[torch.Tensor]:
        """tokens ``[B, T]``, features ``[B, T, H]`` (the feature before each token), the target's
        embedding ``[V, H]`` -> predicted features ``[B, T, H]``, one per unrolled step.

        Step 0 is teacher-forced: row r reads the true ``(feature_r, token_{r+1})`` and predicts
        ``feature_{r+1}``, as the head does for the first draft after the target's verified rows.
        Step s > 0 is the head drafting its (s + 1)-th token: row r reads step s - 1's prediction at
        row r - 1 (its guess of ``feature_r``) and sees, besides itself, the true rows up to r - s and
        the rows r - s + 1 .. r - 1 of steps 1 .. s - 1, exactly the cache it has when it drafts
        (e.g. s = 2, r = 9: true rows 0..7, step 1's row 8, its own row 9). Rows r < s have no such
        history and are excluded from the loss by the caller.
        """
        cfg = self.cfg
        bsz, length = tokens.shape
        emb = F.embedding(tokens, embed).to(features.dtype)
        tables = rope_tables(self.hf_config, cfg.head_dim, length)
        cos, sin = (t.to(features.dtype)[None, None] for t in tables)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        preds: list[torch.Tensor] = []
        feature = features
        for step in range(steps):
            if step:  # row r takes the previous step's guess at row r - 1 (row 0: a zero feature)
                feature = torch.cat([torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]], dim=1)
            x = self.fc(torch.cat([emb, feature], dim=-1))
            h = _rms(x, self.input_layernorm, cfg.rms_norm_eps)
            q = self.q_proj(h).view(bsz, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)
            k = self.k_proj(h).view(bsz, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            v = self.v_proj(h).view(bsz, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys.append(k)
            values.append(v)
            attn = F.scaled_dot_product_attention(
                q,
                torch.cat(keys, dim=2),
                torch.cat(values, dim=2),
                attn_mask=unrolled_mask(length, step, q.device),
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )  # [B, heads, T, D]
            x = x + self.o_proj(attn.transpose(1, 2).reshape(bsz, length, -1))
            h = _rms(x, self.post_attention_layernorm, cfg.rms_norm_eps)
            x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
            preds.append(_rms(x, self.norm, cfg.rms_norm_eps))
        return preds

    def _file_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters under the head file's names (the runtime's)."""
        out = {"fc.weight": self.fc.weight, "norm.weight": self.norm}
        out[f"{EAGLE_PREFIX}input_layernorm.weight"] = self.input_layernorm
        out[f"{EAGLE_PREFIX}post_attention_layernorm.weight"] = self.post_attention_layernorm
        for group, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for name in names:
                for part, tensor in getattr(self, name).named_parameters():
                    out[f"{EAGLE_PREFIX}{group}.{name}.{part}"] = tensor
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The head file's tensors."""
        return {k: v.detach().clone() for k, v in self._file_parameters().items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of ``state_tensors`` (resuming a run)."""
        with torch.no_grad():
            for key, parameter in self._file_parameters().items():
                parameter.copy_(tensors[key])


class MedusaNet(nn.Module):
    """``num_heads`` residual blocks over the last feature: head k predicts the token k + 1 ahead
    (``engine.heads.medusa_heads``)."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_heads))
        for block in self.blocks:  # Medusa's start: every head is the target's own head
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features ``[..., H]`` -> each head's hidden ``[..., heads, H]``."""
        return torch.stack([features + F.silu(block(features)) for block in self.blocks], dim=-2)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, block in enumerate(self.blocks):
            weight, bias = medusa_names(k)
            out[weight], out[bias] = block.weight.detach().clone(), block.bias.detach().clone()
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, block in enumerate(self.blocks):
                weight, bias = medusa_names(k)
                block.weight.copy_(tensors[weight])
                block.bias.copy_(tensors[bias])
