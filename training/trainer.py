"""Training the heads on the target's features (``training.features`` shards).

Both kinds learn from the same stream, so the features are read once per epoch:

- EAGLE (``EagleNet``): the pair ``(feature_r, token_{r+1})`` -> ``feature_{r+1}``; loss =
  smooth L1 to the target's feature + ``cls_weight`` x cross-entropy of the target's own choice
  read off the prediction through the target's (restricted, frozen) output head. With
  ``eagle_steps`` > 1 the head is also trained as it drafts: on its own predicted features fed
  back (``EagleNet.forward``), step s weighted ``0.8^s``; trained on true features only, it
  meets its own (imperfect) predictions first when serving, and acceptance after the first
  drafted token collapses.
- Medusa (``MedusaNet``): ``feature_r`` -> the target's choice ``k + 1`` positions later, for each
  head k; loss = sum over heads of ``0.8^k`` x cross-entropy.

Labels are the target's argmax choices, not the corpus text: a head learns what the target would
emit, which is what verification accepts. A label outside the head's tokens is ignored.
Deterministic for a seed; resumable from the checkpoint written after every shard.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from serve_app.engine.proposers.eagle import KIND as EAGLE
from serve_app.engine.proposers.medusa import KIND as MEDUSA
from training.features import read_shard, shard_rows
from training.networks import EagleNet, MedusaNet

IGNORE = -100
STEP_DECAY = 0.8  # weight of a later step's (or Medusa head's) loss: its tokens are accepted less often


@dataclass(frozen=True)
class TrainSpec:
    kinds: tuple[str, ...] = (EAGLE, MEDUSA)
    epochs: int = 2
    batch_chunks: int = 4
    lr: float = 1e-3
    seed: int = 0
    eagle_intermediate: int = 0  # 0 = a quarter of the target's, in multiples of 256
    medusa_heads: int = 3
    cls_weight: float = 0.1
    eagle_steps: int = 1  # unrolled drafting steps EAGLE trains on (1 = teacher-forced only)
    warmup_steps: int = 20
    bf16: bool = False  # products in bf16 (autocast): ~1.7x faster where the CPU has native bf16


@dataclass
class Metrics:
    """Running sums over a span of batches: loss and top-1 agreement per kind (and Medusa head)."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float, count: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value * count
        self.counts[name] = self.counts.get(name, 0.0) + count

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in sorted(self.sums) if self.counts[k]}


def head_index(head_ids: Sequence[int] | None, vocab: int) -> torch.Tensor:
    """token id -> its row in the restricted head, IGNORE for tokens outside it: ``[vocab]``."""
    index = torch.full((vocab,), IGNORE, dtype=torch.long)
    ids = torch.arange(vocab) if head_ids is None else torch.tensor(sorted(set(head_ids)))
    index[ids] = torch.arange(len(ids))
    return index


def _ce(
    hidden: torch.Tensor, head_rows: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, float, int]:
    """Cross-entropy through the frozen head rows; also (top-1 hits, labelled rows)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ head_rows.T  # [N, rows]
    labels = labels.reshape(-1)
    valid = labels != IGNORE
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    hits = float((logits.argmax(dim=-1)[valid] == labels[valid]).sum())
    return loss, hits, int(valid.sum())


class HeadTrainer:
    """Holds the nets, their optimizers and the frozen target pieces; one ``step`` per batch."""

    def __init__(
        self,
        spec: TrainSpec,
        cfg: object,
        hf_config: object,
        embed: torch.Tensor,
        head_rows: torch.Tensor,
        label_index: torch.Tensor,
    ) -> None:
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.embed = embed.float() if embed.dtype != torch.float32 else embed  # frozen [V, H]
        self.head_rows = head_rows.float()  # frozen [N, H]
        self.label_index = label_index  # [V] -> row or IGNORE
        self.nets: dict[str, torch.nn.Module] = {}
        if EAGLE in spec.kinds:
            inter = spec.eagle_intermediate or max(256, cfg.intermediate_size // 4 // 256 * 256)  # type: ignore[attr-defined]
            self.nets[EAGLE] = EagleNet(cfg, hf_config, inter)  # type: ignore[arg-type]
        if MEDUSA in spec.kinds:
            self.nets[MEDUSA] = MedusaNet(cfg.hidden_size, spec.medusa_heads)  # type: ignore[attr-defined]
        self.optimizers = {k: torch.optim.AdamW(n.parameters(), lr=spec.lr, weight_decay=0.0)
                           for k, n in self.nets.items()}  # fmt: skip
        self.step_count = 0

    def losses(
        self, tokens: torch.Tensor, features: torch.Tensor, choices: torch.Tensor, metrics: Metrics
    ) -> dict[str, torch.Tensor]:
        """Each kind's loss on one batch (tokens / choices ``[B, L]``, features ``[B, L, H]``)."""
        labels = self.label_index[choices.long()]  # [B, L]
        out = {}
        if EAGLE in self.nets:
            net, steps = self.nets[EAGLE], self.spec.eagle_steps
            preds = net(tokens[:, 1:].long(), features[:, :-1], self.embed, steps)  # steps x [B, L-1, H]
            total = features.new_zeros(())
            for step, pred in enumerate(preds):  # pred [B, L-1, H]; rows < step have no history
                reg = F.smooth_l1_loss(pred[:, step:], features[:, 1 + step :])
                ce, hits, count = _ce(pred[:, step:], self.head_rows, labels[:, 1 + step :])
                total = total + STEP_DECAY**step * (reg + self.spec.cls_weight * ce)
                metrics.add(f"{EAGLE}.reg.{step}", reg.item())
                metrics.add(f"{EAGLE}.top1.{step}", hits / max(count, 1), count)
            out[EAGLE] = total
            metrics.add(f"{EAGLE}.loss", total.item())
        if MEDUSA in self.nets:
            hidden = self.nets[MEDUSA](features)  # [B, L, K, H]
            total = hidden.new_zeros(())
            for k in range(hidden.shape[2]):
                ce, hits, count = _ce(hidden[:, : -(k + 1), k], self.head_rows, labels[:, k + 1 :])
                total = total + STEP_DECAY**k * ce
                metrics.add(f"{MEDUSA}.top1.{k}", hits / max(count, 1), count)
            out[MEDUSA] = total
            metrics.add(f"{MEDUSA}.loss", total.item())
        return out

    def step(self, batch: dict[str, torch.Tensor], total_steps: int, metrics: Metrics) -> None:
        lr = self._lr(total_steps)
        for optimizer in self.optimizers.values():
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            losses = self.losses(batch["tokens"], batch["features"].float(), batch["choices"], metrics)
        sum(losses.values()).backward()
        for kind, optimizer in self.optimizers.items():
            torch.nn.utils.clip_grad_norm_(self.nets[kind].parameters(), 1.0)
            optimizer.step()
        self.step_count += 1

    @torch.no_grad()
    def evaluate(self, shards: Sequence[Path]) -> dict[str, float]:
        metrics = Metrics()
        for path in shards:
            data = read_shard(path)
            for start in range(0, data["tokens"].shape[0], self.spec.batch_chunks):
                part = {k: v[start : start + self.spec.batch_chunks] for k, v in data.items()}
                with self._autocast():
                    self.losses(part["tokens"], part["features"].float(), part["choices"], metrics)
        return metrics.means()

    def _autocast(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.spec.bf16)

    def _lr(self, total_steps: int) -> float:
        """Linear warm-up, then cosine down to a tenth."""
        s, warm = self.step_count, self.spec.warmup_steps
        if s < warm:
            return self.spec.lr * (s + 1) / warm
        progress = min(1.0, (s - warm) / max(1, total_steps - warm))
        return self.spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Path, position: tuple[int, int], shards: Sequence[Path] = ()) -> None:
        state = {
            "spec": asdict(self.spec),
            "shards": [str(p) for p in shards],
            "position": position,
            "step": self.step_count,
            "nets": {k: n.state_dict() for k, n in self.nets.items()},
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "rng": torch.get_rng_state(),
        }
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path: Path, shards: Sequence[Path] = ()) -> tuple[int, int] | None:
        """Resume where ``path`` left off: (epoch, next shard); None when it is absent, or was written
        for another spec or other shards."""
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=False)
        if state["spec"] != asdict(self.spec) or state.get("shards", []) != [str(p) for p in shards]:
            return None
        for k, net in self.nets.items():
            net.load_state_dict(state["nets"][k])
            self.optimizers[k].load_state_dict(state["optimizers"][k])
        self.step_count = state["step"]
        torch.set_rng_state(state["rng"])
        return tuple(state["position"])  # type: ignore[return-value]


def train(
    trainer: HeadTrainer,
    shards: Sequence[Path],
    checkpoint: Path,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Epochs over ``shards`` (order shuffled per epoch by the seed); resumes from ``checkpoint``.
    ``progress(steps done, running metrics)`` after every batch. Returns the last epoch's metrics."""
    spec = trainer.spec
    total_steps = spec.epochs * sum(math.ceil(shard_rows(p) / spec.batch_chunks) for p in shards)
    start = trainer.load_checkpoint(checkpoint, shards) or (0, 0)
    metrics = Metrics()
    for epoch in range(start[0], spec.epochs):
        order = list(range(len(shards)))
        random.Random(spec.seed + epoch).shuffle(order)
        metrics = Metrics()
        first = start[1] if epoch == start[0] else 0
        for position in range(first, len(order)):
            data = read_shard(shards[order[position]])
            for begin in range(0, data["tokens"].shape[0], spec.batch_chunks):
                trainer.step(
                    {k: v[begin : begin + spec.batch_chunks] for k, v in data.items()}, total_steps, metrics
                )
                if progress:
                    progress(trainer.step_count, metrics.means())
            trainer.save_checkpoint(
                checkpoint, (epoch, position + 1) if position + 1 < len(order) else (epoch + 1, 0), shards
            )
    return metrics.means()
