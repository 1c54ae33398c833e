"""Decoder runtime for Llama-family checkpoints (Llama, Qwen2, Mistral; SmolLM2 is Llama).

A compact implementation in the spirit of gpt-fast / nano-vllm: RMSNorm, rotary embeddings with
the checkpoint's rope settings, grouped-query attention through ``scaled_dot_product_attention``,
SwiGLU MLP, tied or untied output head. The configuration comes from the folder's ``config.json``
through ``transformers``; weights come from its safetensors files, with q/k/v and gate/up fused
into one matrix each so a decode step makes two matrix-vector products per block instead of five.

One forward takes token ids ``[B, T]`` for rows that each own a KV slot. Row ``b`` has
``cache.lengths[slot_b]`` tokens cached; its ``T`` new tokens sit at positions ``length + t``
(or at explicit ``positions`` for trees) and attend to everything cached plus the new tokens that
``block_mask[b, t, :]`` allows (causal by default). Rows shorter than ``T`` are right-padded by
the caller; padding writes K/V beyond the row's true length, which is garbage by the cache's
definition, and no real token attends to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from serve_app.engine.attention import CachedAttention
from serve_app.engine.block_file import BLOCKS_FILE, blocks_path, read_blocks
from serve_app.engine.decoder_config import DecoderConfig, rope_tables
from serve_app.engine.decoder_layer import SMALL_QUERY, DecoderLayer, rms_norm
from serve_app.engine.invariance import RowPlan
from serve_app.engine.kv_cache import CacheBatch, KVCache
from serve_app.engine.native_layers import build_native_layers
from serve_app.engine.packing import model_packer
from serve_app.engine.q8_weight import Q8Weight
from serve_app.engine.quantized import PaddedInputs, QuantizedWeight
from serve_app.engine.weights import (
    WEIGHT_FORMATS,
    Weight,
    linear,
    prepack,
    weight_nbytes,
)


@dataclass(frozen=True)
class DraftOptions:
    """Ways to make a model cheaper as a proposer (never used for a target).

    ``int8``: layer matrices as int8 weight-only (half the bytes). ``head_ids``: the output head
    keeps only these rows (e.g. the most frequent tokens, as FR-Spec does); logits of all other
    tokens are -inf, so the model never proposes them and q is 0 there.
    """

    int8: bool = False
    head_ids: tuple[int, ...] | None = None


class DecoderModel:
    """A Llama-family decoder with its weights; the KV cache lives outside (``new_cache``)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        hf_config: object,
        weights: Mapping[str, torch.Tensor],
        draft: DraftOptions | None = None,
        weight_format: str = "dense",
        blocks: Mapping[str, QuantizedWeight] | None = None,
    ) -> None:
        """``blocks``: the GGUF's quantized matrices by name (``block_file.read_blocks``), which the
        ``gguf`` weight format uses where it has them (any other matrix: re-quantized to Q8)."""
        draft = draft or DraftOptions()
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        pack = model_packer(weight_format, draft.int8, blocks or {})
        self.weight_format = weight_format
        self.cfg = cfg
        self.hf_config = hf_config
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        head = weights.get("lm_head.weight")
        head = self.embed if cfg.tie_word_embeddings or head is None else head
        self.head_ids: torch.Tensor | None = None  # [N] the vocabulary rows the head keeps
        if draft.head_ids is not None:
            self.head_ids = torch.tensor(sorted(set(draft.head_ids)), device=head.device)
            head = head.index_select(0, self.head_ids)
        # A tied, unrestricted head shares the embedding table, which must stay plain for lookups
        # (a quantized head is a copy: the table stays for the lookups).
        head_name = "model.embed_tokens.weight" if head is self.embed else "lm_head.weight"
        if weight_format == "dense":
            self.lm_head = head if head is self.embed else prepack(head)
        elif self.head_ids is not None:  # a draft's restricted head: no GGUF block matches its rows
            self.lm_head = PaddedInputs.quantize(head) if weight_format == "q4k" else Q8Weight.quantize(head)
        else:
            self.lm_head = pack([head_name], [head])
        self.layers = []
        for i in range(cfg.num_layers):
            prefix, layer_weights = f"model.layers.{i}.", _sub(weights, f"model.layers.{i}.")

            def pack_layer(names: Sequence[str], prefix: str = prefix, own: dict = layer_weights) -> Weight:
                return pack([prefix + n for n in names], [own.get(n) for n in names])

            self.layers.append(DecoderLayer(cfg, layer_weights, pack_layer))
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.head_plan: RowPlan | None = None  # the output head's rows (engine.exactness sets it)
        self._cos, self._sin = (t.to(self.device) for t in rope_tables(hf_config, cfg.head_dim, 0))
        self._rope_len = 0
        # Decode and verify steps run the layers in one native call where every product is in our
        # kernels (engine.native_layers: the same numbers); False keeps the Python layers (A/B, tests).
        self.native_steps = True
        self._native: object | None = None  # built at the first step that can use it
        self._native_built = False

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        draft: DraftOptions | None = None,
        weight_format: str = "dense",
    ) -> DecoderModel:
        """Load a Hugging Face folder (config.json + *.safetensors)."""
        from safetensors import safe_open
        from transformers import AutoConfig

        path = Path(path)
        hf_config = AutoConfig.from_pretrained(path)
        cfg = DecoderConfig.from_hf(hf_config)
        files = sorted(f for f in path.glob("*.safetensors") if f.name != BLOCKS_FILE)
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        # q4k takes the GGUF's Q4_K blocks where a pack has them and quantizes everything else
        wants_blocks = weight_format == "gguf" or (weight_format == "q4k" and blocks_path(path).is_file())
        blocks = read_blocks(path) if wants_blocks else {}
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    # a layer matrix the GGUF blocks hold: its dense copy is never used (the
                    # embedding serves lookups; the head decides tied vs untied and may be restricted)
                    if weight_format == "gguf" and name in blocks and name.startswith("model.layers."):
                        continue
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        return cls(cfg, hf_config, weights, draft, weight_format, blocks)

    @classmethod
    def from_hf_model(
        cls,
        hf_model: torch.nn.Module,
        dtype: torch.dtype | None = None,
        weight_format: str = "dense",
        blocks: Mapping[str, QuantizedWeight] | None = None,
    ) -> DecoderModel:
        """Build from an in-memory ``transformers`` model (tests): same weights, our runtime."""
        state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        config = hf_model.config
        return cls(DecoderConfig.from_hf(config), config, state, weight_format=weight_format, blocks=blocks)

    def new_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        """A slot cache sized for this model."""
        cfg = self.cfg
        return KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                       self.dtype, self.device)  # fmt: skip

    def tensors(self) -> Iterator[Weight]:
        yield self.embed
        yield self.norm
        if self.lm_head is not self.embed:
            yield self.lm_head
        for layer in self.layers:
            yield from layer.tensors()

    @property
    def weight_bytes(self) -> int:
        return sum(weight_nbytes(t) for t in self.tensors())

    # ----------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] token ids, rows right-padded to T
        cache: KVCache,
        slots: Sequence[int],
        positions: torch.Tensor | None = None,  # [B, T]; default lengths[slot_b] + t
        block_mask: torch.Tensor | None = None,  # [B, T, T] bool: new token t may see new token u
        layers: Sequence[int] | None = None,  # subset of layers to run (self-speculation)
        embeds: torch.Tensor | None = None,  # [B, T, hidden] the first layer's input instead of the
        # tokens' embeddings (an EAGLE head: its input is made from a feature and a token)
    ) -> torch.Tensor:
        """Run the decoder, writing K/V for every new token; return normed hidden ``[B, T, hidden]``.

        The cache lengths are NOT advanced: the caller decides how many of the T tokens to keep
        (all for prefill and plain decoding, the accepted prefix for verification).
        """
        steps = tokens.shape[1]
        batch = cache.batch(list(slots), steps, tokens.device)
        if positions is None:
            positions = torch.tensor(batch.starts, device=tokens.device)[:, None] + torch.arange(
                steps, device=tokens.device
            )
        cos, sin = self._rope(positions)
        mask, causal = self._attention_mask(batch, positions, block_mask)
        x = F.embedding(tokens, self.embed) if embeds is None else embeds
        one_call = CachedAttention.for_step(x, cos, sin, mask) if steps <= SMALL_QUERY else None
        which = range(self.cfg.num_layers) if layers is None else layers
        if one_call is not None and (native := self._native_layers(one_call)) is not None:
            x = native.run(x, list(which), cache.k, cache.v, one_call.cos, one_call.sin, one_call.visible,
                           batch.upto, batch.slots, batch.starts)  # fmt: skip
        else:
            for i in which:
                x = self.layers[i](x, i, cache, batch, cos, sin, mask, causal, one_call)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def _native_layers(self, one_call: CachedAttention) -> object | None:
        """The layers as one native object where every product is in our kernels (built once)."""
        if not self.native_steps:
            return None
        if not self._native_built:
            self._native = build_native_layers(self.layers, one_call.kernels)
            self._native_built = True
        return self._native

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: ``[..., hidden] -> [..., vocab]`` float32 (-inf outside a restricted head)."""
        logits = linear(hidden, self.lm_head, plan=self.head_plan).float()
        if self.head_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_ids, logits)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if needed > self._rope_len:
            length = max(needed, 2 * self._rope_len, 1024)
            cos, sin = rope_tables(self.hf_config, self.cfg.head_dim, length)
            self._cos, self._sin, self._rope_len = cos.to(self.device), sin.to(self.device), length
        cos = self._cos[positions].to(self.dtype).unsqueeze(1)  # [B, 1, T, D]
        sin = self._sin[positions].to(self.dtype).unsqueeze(1)
        return cos, sin

    def _attention_mask(
        self, batch: CacheBatch, positions: torch.Tensor, block_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, bool]:
        """``[B, 1, T, S]`` bool mask (True = attend), or None with a flag for the fast paths."""
        steps, upto = batch.steps, batch.upto
        window = self.cfg.sliding_window
        single = batch.positions is None
        if single and block_mask is None and (window is None or upto <= window):
            if steps == 1:
                return None, False  # one token sees the whole cache
            if batch.starts[0] == 0 and steps > SMALL_QUERY:
                return None, True  # a fresh prefill is plain causal attention (SDPA path)
        device = positions.device
        starts = torch.tensor(batch.starts, device=device)[:, None, None]  # [B, 1, 1]
        key = torch.arange(upto, device=device)[None, None, :]  # [1, 1, S]
        new_index = key - starts  # [B, 1, S]: index of a key among the new tokens (< 0: cached)
        query = torch.arange(steps, device=device)[None, :, None]  # [1, T, 1]
        if block_mask is None:
            in_block = (new_index >= 0) & (new_index <= query)  # causal among the new tokens
        else:
            clamped = new_index.clamp(0, steps - 1).expand(block_mask.shape[0], steps, upto)
            in_block = (new_index >= 0) & (new_index < steps) & block_mask.gather(2, clamped)
        mask = (new_index < 0) | in_block  # [B, T, S]
        if window is not None:
            # Sliding window over cache rows (rows are positions outside trees): a query at row
            # start + t sees keys at rows > start + t - window.
            mask &= key > starts + query - window
        return mask.unsqueeze(1), False


def _sub(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
