"""Draft-model proposer: a smaller model of the target's family drafts tokens autoregressively.

The draft keeps its own slot KV cache, with the same slot index as the target's. Its cache holds a
prefix of the request's verified sequence; before drafting, it catches up on the tokens it has not
seen (the token the target emitted last step, and any accepted draft it never fed), all rows in one
ragged forward that also yields the first draft token. Each further draft token is one batched
single-token forward. The last draft token is never fed, so after the target accepts ``a`` of
``k`` drafts the draft's valid cache is ``sequence + min(a, k - 1)`` tokens: ``commit`` sets that
length (rollback = not moving the length), and the next catch-up feeds the rest. Given a node
budget (``ProposeRow.nodes``), the runner-up tokens of the drafted positions join the chain as
alternatives (``proposers.alternatives``); they are never fed to the draft, so its cache holds the
chain alone, and ``commit`` counts the accepted chain tokens only.

A greedy request drafts the draft's argmax (q is one-hot). A sampling request drafts from the
draft's own distribution after the request's temperature / top-k / top-p, and records q so that
verification accepts with min(1, p/q): the output stays distributed as the target's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.engine.block_file import blocks_path
from serve_app.engine.model import DecoderModel, DraftOptions
from serve_app.engine.proposers.alternatives import Alternatives, offer_runner_ups
from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.proposers.choice import choose_tokens
from serve_app.engine.proposers.registry import ProposerContext

log = logging.getLogger(__name__)

# Above this fraction of the target's parameters a draft step is too dear to pay for itself.
LARGE_DRAFT_FRACTION = 0.4


class DraftMismatchError(ValueError):
    """The draft cannot propose for this target (different tokenizer or vocabulary)."""


@dataclass
class _SlotState:
    tokens: list[int]  # ids whose K/V are in the draft cache, in order (len == cache length)
    base: int = 0  # verified sequence length when the last proposal was made
    fed_drafts: int = 0  # draft tokens of the last proposal that were fed (cached)


class DraftModelProposer:
    """Drafts with a second ``DecoderModel`` that shares the target's tokenizer."""

    name = "draft"
    branches = True  # the runner-up at each drafted position may join as an alternative

    def __init__(
        self,
        model: DecoderModel,
        target_vocab_size: int,
        max_slots: int,
        max_seq_len: int,
        min_confidence: float = 0.0,
    ) -> None:
        self.model = model
        # Stop a row's draft early when the draft's own top probability falls below this: a token
        # the draft is unsure of is likely rejected, and every drafted token costs a draft step.
        # Any stopping rule that looks only at the draft's own distribution keeps verification exact.
        self.min_confidence = min_confidence
        self.target_vocab_size = target_vocab_size
        self.cache = model.new_cache(max_slots, max_seq_len)
        self._slots: dict[int, _SlotState] = {}

    # ----------------------------------------------------------------------------- lifecycle
    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        """Take the same slot in the draft cache and prefill the prompt."""
        self.cache.allocate(slot)
        self._slots[slot] = _SlotState(tokens=[])
        self._feed([slot], [list(prompt_ids)])

    def release(self, slot: int) -> None:
        if self._slots.pop(slot, None) is not None:
            self.cache.free(slot)

    def commit(self, slot: int, num_accepted: int) -> None:
        """``num_accepted``: of the chain's tokens (a walked tree counts its chain nodes only)."""
        state = self._slots[slot]
        keep = state.base + min(num_accepted, state.fed_drafts)
        del state.tokens[keep:]
        self.cache.set_length(slot, keep)
        state.fed_drafts = 0

    # ----------------------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        if not rows:
            return []
        for row in rows:
            state = self._slots[row.slot]
            if state.tokens != row.token_ids[: len(state.tokens)]:
                raise RuntimeError(f"draft cache of slot {row.slot} is out of step with the request")
            state.base = len(row.token_ids)
        # Catch up (ragged) and draft the first token in one forward.
        catch_up = [row.token_ids[len(self._slots[row.slot].tokens) :] for row in rows]
        logits = self._feed([row.slot for row in rows], catch_up)  # [B, V]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = list(range(len(rows)))
        alternatives = {i: Alternatives(r.nodes, r.min_score) for i, r in enumerate(rows) if r.nodes > 0}
        while True:
            drafted = [len(tokens[i]) for i in active]
            confident = self.min_confidence > 0 or bool(alternatives)
            chosen = choose_tokens([rows[i] for i in active], logits, confident, drafted)
            offer_runner_ups(alternatives, active, rows, logits, chosen, drafted)
            unsure = set()
            for i, choice in zip(active, chosen, strict=True):
                tokens[i].append(choice.token)
                if choice.q is not None:
                    probs[i].append(choice.q)
                if choice.confidence < self.min_confidence:
                    unsure.add(i)
            active = [i for i in active if len(tokens[i]) < rows[i].depth and i not in unsure]
            if not active:
                break
            for i in active:
                self._slots[rows[i].slot].fed_drafts += 1
            logits = self._feed([rows[i].slot for i in active], [[tokens[i][-1]] for i in active])
        return [
            Draft(tokens=t, probs=torch.stack(p) if p else None,
                  tree=alternatives[i].tree(t) if i in alternatives else None)
            for i, (t, p) in enumerate(zip(tokens, probs, strict=True))
        ]  # fmt: skip

    def _feed(self, slots: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Feed each slot its chunk (right-padded batch); return logits after each chunk: [B, V]."""
        width = max(len(c) for c in chunks)
        batch = torch.zeros(len(chunks), width, dtype=torch.long, device=self.model.device)  # [B, T]
        for b, chunk in enumerate(chunks):
            batch[b, : len(chunk)] = torch.tensor(chunk)
        hidden = self.model.forward(batch, self.cache, slots)  # [B, T, hidden]
        last = torch.tensor([len(c) - 1 for c in chunks], device=hidden.device)
        hidden = hidden[torch.arange(len(chunks), device=hidden.device), last]  # [B, hidden]
        for slot, chunk in zip(slots, chunks, strict=True):
            state = self._slots[slot]
            state.tokens.extend(chunk)
            self.cache.set_length(slot, len(state.tokens))
        logits = self.model.logits(hidden)  # [B, V_draft]
        return self._to_target_vocab(logits)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: extra draft ids dropped, missing ones -inf."""
        vocab = self.target_vocab_size
        if logits.shape[-1] == vocab:
            return logits
        if logits.shape[-1] > vocab:
            return logits[:, :vocab]
        pad = logits.new_full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def check_compatible(
    target_tokenizer: object, draft_tokenizer: object, target_name: str, draft_name: str
) -> None:
    """Same token ids for the same strings, or a clear error naming both models."""
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        only_draft = len(set(draft_vocab.items()) - set(target_vocab.items()))
        raise DraftMismatchError(
            f"draft model {draft_name} does not share the tokenizer of target {target_name}: "
            f"{only_target} token entries only in the target's, {only_draft} only in the draft's"
        )


def frequent_token_ids(tokenizer: object, count: int) -> tuple[int, ...]:
    """The ``count`` most frequent tokens by a BPE vocabulary's own ranking, plus special tokens.

    Byte-level BPE assigns ids in merge order, and merges are learnt most-frequent-first, so low
    ids are the frequent tokens; special tokens (EOS, chat markers) are always kept.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return tuple(sorted(set(range(count)) | special))


def draft_format_for(target_format: str, has_blocks: bool) -> str:
    """The draft's weight format when its options say "target": the target's, except that a gguf
    target's draft is ``q4k`` (Q4_K throughout: the pack's Q4_K blocks, its other matrices
    re-quantized, inputs padded to 256s), or q8 where the draft's folder has no blocks.

    A draft's numbers only decide what is proposed, and 4 bits read the fewest bytes. Measured
    against the pack's own mix (Q5_0 / Q8_0 / Q6_K for a Qwen 0.5B) on the bench's prompts: on an
    AVX2-only EPYC a draft token 18.0 ms against 23.9 (Q5_0's fifth bits cost 7 vector operations
    per 32 weights there), depth 4 1.12x plain against 1.05x; on an AVX-512 EPYC 8.1 ms against 9.8 in
    one session (depth 2 and 4 chains 1.04x faster end to end), 10.15 against 12.07 in the next
    (BENCHMARKS.md, twenty-sixth, and twenty-seventh and twenty-eighth sessions), for 0-8 points less
    acceptance; on an Intel Xeon the twelfth session measured the
    two about even."""
    if target_format != "gguf":
        return target_format
    return "q4k" if has_blocks else "q8"


def build_draft_proposer(context: ProposerContext) -> DraftModelProposer:
    """Options: ``model_path`` (a model folder), ``model_name`` / ``target_name`` (for messages),
    ``dtype``, ``weight_format`` ("target": ``draft_format_for``), ``int8`` (int8 weight-only layers where
    the format is dense), ``head_tokens`` (keep only this many of
    the most frequent tokens in the draft's output head; 0 = all), ``min_confidence``."""
    from transformers import AutoTokenizer

    path = Path(str(context.options["model_path"]))
    name = str(context.options.get("model_name", path))
    target = context.target
    dtype = context.options.get("dtype", target.dtype)
    check_compatible(context.tokenizer, AutoTokenizer.from_pretrained(path), str(context.options.get(
        "target_name", "the target")), name)  # fmt: skip
    head_tokens = int(context.options.get("head_tokens", 0) or 0)
    weight_format = str(context.options.get("weight_format", "target"))
    if weight_format == "target":
        weight_format = draft_format_for(target.weight_format, blocks_path(path).is_file())
    options = DraftOptions(
        int8=weight_format == "dense" and bool(context.options.get("int8", False)),
        head_ids=frequent_token_ids(context.tokenizer, head_tokens) if head_tokens else None,
    )
    model = DecoderModel.from_pretrained(
        path, dtype=dtype, device=target.device, draft=options, weight_format=weight_format
    )
    fraction = model.cfg.num_parameters / target.cfg.num_parameters
    if fraction > LARGE_DRAFT_FRACTION:
        log.warning(
            "draft model %s has %.0f%% of the target's parameters; a draft step this dear rarely pays",
            name, 100 * fraction,
        )  # fmt: skip
    min_confidence = float(context.options.get("min_confidence", 0.0) or 0.0)
    return DraftModelProposer(
        model, target.cfg.vocab_size, context.max_slots, context.max_seq_len, min_confidence
    )
