"""The target's own answers as training data (self-distillation).

A head drafts what the target writes when it answers, so the most useful features are those of
the target's own answers, not of human-written files. Questions are made from the standard
library's (and installed packages') documented functions: write it, explain it, describe it as
JSON, test it, tell a beginner about it (the bench's kinds: code, chat, JSON, prose). The target
answers them greedily, many at once (continuous batching over the cache's slots), and every
position's feature and choice is recorded as it is computed: no second pass.

A group of ``GROUP`` questions becomes one shard: its conversations (prompt + answer) are packed
end to end and cut into chunks of the training length. Groups are fixed slices of the question
stream, so a run that stops resumes at the first missing shard. Packing lets a chunk's later
conversation attend to an earlier one during training; the features themselves were computed per
conversation, as they are when served.
"""

from __future__ import annotations

import ast
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from serve_app.engine.model import DecoderModel
from training.corpus import CorpusSpec, corpus_files
from training.features import shard_path, shard_rows

GROUP = 64  # questions per shard
TEMPLATES = (
    "Write a Python function `{sig}` that {summary}",
    "Explain what `{name}` from Python's `{module}` module does, with a short example.",
    'Describe the function `{sig}` as a JSON object with the keys "name", "parameters" and '
    '"summary". Reply with JSON only.',
    "Write pytest unit tests for a function `{sig}` that {summary}",
    "In a short paragraph for a beginner, explain this idea: {summary}",
)
MAX_SUMMARY = 240


@dataclass(frozen=True)
class Conversation:
    """One answered question: ``tokens [N]`` (prompt then answer), ``features [N, H]`` (the target's
    hidden state after each token), ``choices [N]`` (its argmax after each token)."""

    tokens: torch.Tensor
    features: torch.Tensor
    choices: torch.Tensor


def _summary(doc: str) -> str | None:
    first = " ".join(doc.strip().split("\n\n")[0].split())
    if not 12 <= len(first) <= MAX_SUMMARY or not first[0].isalpha():
        return None
    first = first.split(". ")[0].rstrip(".")
    return first[0].lower() + first[1:] + "."


def questions(spec: CorpusSpec) -> Iterator[str]:
    """Questions about the documented public functions of the corpus's ``.py`` files, one template
    each (chosen by the seed), in the corpus's order. Deterministic for a spec."""
    rng = random.Random(spec.seed + 2)
    for path in corpus_files(spec):
        if path.suffix != ".py":
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node, method in _functions(tree):
            if node.name.startswith("_"):
                continue
            summary = _summary(ast.get_docstring(node) or "")
            if summary is None:
                continue
            args = [a.arg for a in node.args.args][1 if method else 0 :]  # a receiver is no parameter
            sig = f"{node.name}({', '.join(args)})"
            yield rng.choice(TEMPLATES).format(sig=sig, name=node.name, module=path.stem, summary=summary)


def _functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Module-level functions and the methods of module-level classes (True: takes a receiver, i.e.
    not a staticmethod), in source order."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, False
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [d.id for d in item.decorator_list if isinstance(d, ast.Name)]
                    yield item, "staticmethod" not in names


def chat_prompt(tokenizer: object, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]


@torch.inference_mode()
def answer(
    model: DecoderModel,
    prompts: Sequence[list[int]],
    eos_ids: Iterable[int],
    max_new: int,
    batch: int = 16,
) -> list[Conversation]:
    """Greedy answers to ``prompts`` (token ids), ``batch`` at a time: a finished answer's slot takes
    the next prompt. Returns the conversations in the prompts' order."""
    eos = set(eos_ids)
    longest = max(len(p) for p in prompts)
    cache = model.new_cache(min(batch, len(prompts)), longest + max_new + 1)
    pending = iter(enumerate(prompts))
    rows: dict[int, tuple[int, list[int], list[torch.Tensor], list[int]]] = {}  # slot -> its record
    done: dict[int, Conversation] = {}

    def finish(slot: int) -> None:
        index, tokens, features, choices = rows.pop(slot)
        done[index] = Conversation(torch.tensor(tokens), torch.cat(features), torch.tensor(choices))
        cache.free(slot)

    while True:
        while cache.num_free and (item := next(pending, None)) is not None:
            index, prompt = item
            slot = cache.allocate()
            hidden = model.forward(torch.tensor([prompt], device=model.device), cache, [slot])[0]  # [L, H]
            cache.set_length(slot, len(prompt))
            rows[slot] = (index, list(prompt), [hidden.cpu()], model.logits(hidden).argmax(-1).tolist())
            if rows[slot][3][-1] in eos or max_new <= 1:
                finish(slot)
        if not rows:
            break
        slots = list(rows)
        last = torch.tensor([[rows[s][3][-1]] for s in slots], device=model.device)  # [B, 1]
        hidden = model.forward(last, cache, slots)[:, 0]  # [B, H]
        chosen = model.logits(hidden).argmax(-1).tolist()
        for b, slot in enumerate(slots):
            _, tokens, features, choices = rows[slot]
            tokens.append(int(last[b, 0]))
            features.append(hidden[b : b + 1].cpu())
            choices.append(chosen[b])
            cache.set_length(slot, len(tokens))
            answered = len(tokens) - len(prompts[rows[slot][0]]) + 1  # the answer so far, its last choice too
            if chosen[b] in eos or answered >= max_new:
                finish(slot)
    return [done[i] for i in range(len(prompts))]


def pack(conversations: Sequence[Conversation], chunk: int) -> dict[str, torch.Tensor]:
    """Conversations end to end, cut into ``[S, chunk]`` (the tail shorter than a chunk is dropped)."""
    tokens = torch.cat([c.tokens for c in conversations])
    features = torch.cat([c.features for c in conversations])
    choices = torch.cat([c.choices for c in conversations])
    count = tokens.shape[0] // chunk
    n = count * chunk
    return {
        "tokens": tokens[:n].view(count, chunk).to(torch.int32),
        "features": features[:n].view(count, chunk, -1).to(torch.bfloat16).contiguous(),
        "choices": choices[:n].view(count, chunk).to(torch.int32),
    }


def answer_shards(
    model: DecoderModel,
    tokenizer: object,
    spec: CorpusSpec,
    eos_ids: Iterable[int],
    folder: Path,
    num_shards: int,
    max_new: int = 256,
    batch: int = 16,
    max_prompt: int = 192,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write the missing shards ``0 .. num_shards-1`` of answered questions (``GROUP`` per shard);
    ``progress(tokens)`` after each shard. Returns the shards, in order."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    prompts = (p for p in (chat_prompt(tokenizer, q) for q in questions(spec)) if len(p) <= max_prompt)
    paths = []
    for index in range(num_shards):
        group = list(islice(prompts, GROUP))
        if len(group) < GROUP:
            break  # the questions ran out
        path = shard_path(folder, index)
        if not path.is_file():
            data = pack(answer(model, group, eos_ids, max_new, batch), spec.chunk_tokens)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            save_file(data, str(tmp))
            os.replace(tmp, path)
        paths.append(path)
        if progress:
            progress(shard_rows(path) * spec.chunk_tokens)
    return paths
