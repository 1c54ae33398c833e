"""`specserve train-heads --model NAME`: train EAGLE and Medusa heads on the target, store them.

1. the corpus (``training.corpus``: the standard library's and installed packages' sources and
   docs) -> the served target's features and choices, written as shards (``training.features``);
   and the target's own greedy answers to questions about documented functions, recorded with
   their features as they are generated (``training.answers``);
2. the heads learn from the shards (``training.trainer``), evaluated on held-out files;
3. each head is written beside the target in the store (``heads/<kind>.safetensors`` + manifest),
   where the ``eagle`` and ``medusa`` proposers find it.

Every stage resumes: shards present are kept, training restarts from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from serve_app.config import Settings
from serve_app.engine.proposers.registry import proposer_specs

KINDS = tuple(s.name for s in proposer_specs() if s.trained)  # the heads this command trains


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="heads to train")
    parser.add_argument("--tokens", type=int, default=200_000, help="training tokens (target features)")
    parser.add_argument("--held-out-tokens", type=int, default=16_384, help="evaluation tokens (other files)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per training sequence")
    parser.add_argument("--chunks-per-shard", type=int, default=32, help="sequences per feature shard")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--intermediate", type=int, default=0, help="EAGLE MLP width (0: a quarter of the target's)"
    )
    parser.add_argument("--medusa-heads", type=int, default=3)
    parser.add_argument(
        "--head-tokens", type=int, default=32768, help="tokens the heads propose (most frequent)"
    )
    parser.add_argument("--work-dir", type=Path, help="features and checkpoints (default: in the store)")
    parser.add_argument("--out", type=Path, help="write the heads here instead of beside the target")
    parser.add_argument(
        "--extract-format",
        choices=["served", "dense"],
        default="served",
        help="the target's format for the features: as served (default), or dense bf16 (faster here)",
    )
    parser.add_argument("--corpus-root", action="append", default=[], help="read these folders instead")
    parser.add_argument(
        "--answers",
        type=int,
        default=1024,
        help="questions the target answers greedily to train on its own answers (0: the corpus only)",
    )
    parser.add_argument("--answer-tokens", type=int, default=256, help="the longest answer, in tokens")
    parser.add_argument("--answer-batch", type=int, default=16, help="questions answered at once")
    parser.add_argument(
        "--eagle-steps", type=int, default=3, help="drafting steps EAGLE trains on (on its own predictions)"
    )
    parser.add_argument(
        "--eagle-ce-weight",
        type=float,
        default=1.0,
        help="EAGLE: weight of the token loss beside the feature's",
    )


def run_train_heads(args: argparse.Namespace, settings: Settings) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from serve_app.builder import model_store
    from serve_app.engine.block_file import resolve_weight_format
    from serve_app.engine.decoder_config import read_generation_eos
    from serve_app.engine.device import DTYPES, resolve_device, resolve_dtype, set_threads
    from serve_app.engine.heads.eagle_head import dense_output_head
    from serve_app.engine.heads.head_file import HeadManifest, save_head, target_fingerprint
    from serve_app.engine.model import DecoderModel
    from serve_app.engine.proposers.draft_model import frequent_token_ids
    from serve_app.engine.proposers.eagle import KIND as EAGLE
    from serve_app.engine.weights import onednn_bf16_supported
    from training.answers import GROUP, answer_shards
    from training.corpus import CorpusSpec, token_chunks
    from training.features import extract_shards, shard_rows
    from training.trainer import HeadTrainer, TrainSpec, head_index, train

    set_threads(settings.runtime.threads)
    name = settings.model.target
    store = model_store(settings)
    path = Path(store.resolve(name))
    rt = settings.runtime
    device = resolve_device(rt.device)
    weight_format = resolve_weight_format(rt.weight_format, path, str(device))  # as a replica serves it
    if args.extract_format == "dense":
        weight_format = "dense"
    dtype = resolve_dtype(rt.dtype if args.extract_format == "served" else "bfloat16", weight_format, device)
    model = DecoderModel.from_pretrained(path, DTYPES[dtype], device, weight_format=weight_format)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = model.cfg.vocab_size
    head_ids = frequent_token_ids(tokenizer, args.head_tokens) if 0 < args.head_tokens < vocab else None
    work = (
        args.work_dir
        or Path(settings.store.cache_dir) / "heads-work" / f"{Path(path).name}-s{args.seed}-c{args.chunk}"
    )
    roots = tuple(args.corpus_root)

    def log(message: str) -> None:
        print(f"[train-heads] {message}", file=sys.stderr, flush=True)

    log(f"{name} ({weight_format}, {dtype}, {torch.get_num_threads()} threads) -> {', '.join(args.kinds)}; "
        f"work folder {work}")  # fmt: skip
    started = time.perf_counter()
    shards: dict[str, list[Path]] = {}
    for split, tokens, held_out in (("train", args.tokens, False), ("held-out", args.held_out_tokens, True)):
        per = min(args.chunks_per_shard, math.ceil(tokens / args.chunk))  # chunks per shard
        count = max(1, math.ceil(tokens / (per * args.chunk)))
        corpus = CorpusSpec(seed=args.seed, chunk_tokens=args.chunk, held_out=held_out, roots=roots)
        with tqdm(
            total=count * per * args.chunk, unit="tok", desc=f"features ({split})", file=sys.stderr
        ) as bar:
            shards[split] = extract_shards(model, token_chunks(tokenizer, corpus), work / split, count, per,
                                           progress=bar.update)  # fmt: skip
        if not shards[split]:
            raise SystemExit(f"the corpus gave no {split} chunks of {args.chunk} tokens")
    if args.answers > 0:
        eos_ids = {*read_generation_eos(path), tokenizer.eos_token_id} - {None}
        groups = (("train", math.ceil(args.answers / GROUP), False), ("held-out", 1, True))
        for split, count, held_out in groups:
            corpus = CorpusSpec(seed=args.seed, chunk_tokens=args.chunk, held_out=held_out, roots=roots)
            folder = work / f"answers-{split}-{weight_format}-n{args.answer_tokens}"
            with tqdm(unit="tok", desc=f"answers ({split})", file=sys.stderr) as bar:
                found = answer_shards(model, tokenizer, corpus, eos_ids, folder, count, args.answer_tokens,
                                      args.answer_batch, progress=bar.update)  # fmt: skip
            shards[f"answers-{split}"] = found
            shards[split] += found
    extract_seconds = time.perf_counter() - started
    output_head = dense_output_head(model, path)
    rows = output_head if head_ids is None else output_head.index_select(0, torch.tensor(head_ids))
    spec = TrainSpec(tuple(args.kinds), args.epochs, args.batch, args.lr, args.seed, args.intermediate,
                     args.medusa_heads, cls_weight=args.eagle_ce_weight, eagle_steps=args.eagle_steps,
                     bf16=onednn_bf16_supported())  # fmt: skip
    trainer = HeadTrainer(spec, model.cfg, model.hf_config, model.embed, rows, head_index(head_ids, vocab))
    del model  # the shards hold what training needs (the embedding and head rows stay referenced)
    steps = spec.epochs * sum(math.ceil(shard_rows(p) / args.batch) for p in shards["train"])
    started = time.perf_counter()
    with tqdm(total=steps, unit="step", desc="training", file=sys.stderr) as bar:

        def progress(step: int, metrics: dict[str, float]) -> None:
            bar.n = step
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if "top1" in k}, refresh=True)

        train(trainer, shards["train"], work / "checkpoint.pt", progress)
    train_seconds = time.perf_counter() - started
    held_out = trainer.evaluate(shards["held-out"])
    held_out_answers = trainer.evaluate(shards["answers-held-out"]) if args.answers > 0 else {}
    fingerprint = target_fingerprint(path)
    training = {
        "corpus": "standard library and site-packages sources and docs" if not roots else list(roots),
        "answers": args.answers, "answer_tokens": args.answer_tokens, "eagle_steps": args.eagle_steps,
        "seed": args.seed, "tokens": sum(shard_rows(p) for p in shards["train"]) * args.chunk,
        "chunk_tokens": args.chunk,
        "epochs": args.epochs, "features_from": weight_format, "bf16_training": spec.bf16,
        "extract_seconds": round(extract_seconds, 1),
        "train_seconds": round(train_seconds, 1), "held_out": held_out,
        "held_out_answers": held_out_answers, "threads": torch.get_num_threads(),
    }  # fmt: skip
    written = {}
    for kind, net in trainer.nets.items():
        config = {
            "head_tokens": args.head_tokens if head_ids is not None else 0,
            "hidden_size": trainer.embed.shape[1],
        }
        config |= (
            {"intermediate_size": net.intermediate_size}
            if kind == EAGLE
            else {"num_heads": args.medusa_heads}
        )
        manifest = HeadManifest(kind, config, name, fingerprint, training=training)
        written[kind] = str(save_head(path, manifest, net.state_tensors(), args.out))
    print(json.dumps({"heads": written, **training}, indent=1))
    return 0
