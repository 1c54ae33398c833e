"""Shared fixtures: tiny models, a tiny tokenizer and tiny engines built in memory, and the real
model packs."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from serve_app.config import default_cache_dir

if TYPE_CHECKING:
    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.model import DecoderModel
    from serve_app.engine.proposers.base import Proposer

TINY_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    '{"name": "specserve", "version": 1, "tags": ["fast", "lossless"]}',
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "for i in range(10):\n    print(i * i)\n",
] * 10


def make_tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few lines, with an EOS token and a ChatML-like template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


def make_tiny_hf_model(
    vocab_size: int, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64
) -> torch.nn.Module:
    """A random float32 transformers decoder small enough for many runs in a test (``hidden``
    256 gives every matrix whole Q4_K super-blocks)."""
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # a larger output scale makes sharper, more varied distributions
        model.lm_head.weight.mul_(8.0)
    return model


def make_noop_layer_model(vocab_size: int, layers: int, noop: int, seed: int = 2) -> torch.nn.Module:
    """``make_tiny_hf_model`` whose layer ``noop`` has zero output projections: skipping it changes
    nothing (what a self-speculation calibration should find first)."""
    model = make_tiny_hf_model(vocab_size, seed=seed, layers=layers)
    with torch.no_grad():
        model.model.layers[noop].self_attn.o_proj.weight.zero_()
        model.model.layers[noop].mlp.down_proj.weight.zero_()
    return model


def make_tiny_engine(
    target_hf: torch.nn.Module | DecoderModel,
    tokenizer: Any,
    *,
    proposers: Iterable[str] | Mapping[str, Mapping[str, object] | Proposer] = (),
    method: str | None = None,
    depth: int = 4,
    max_depth: int = 16,
    slots: int = 8,
    max_seq_len: int = 128,
    max_waiting: int = 256,
    policy: str | None = None,
    draft_hf: torch.nn.Module | None = None,
    self_skip: Sequence[int] | None = None,
    stats: Any = None,
    model_pair: str = "",
    dtype: torch.dtype | None = None,
    **config: Any,
) -> SpecEngine:
    """A ``SpecEngine`` on an in-memory model (a transformers model, or a ``DecoderModel`` already
    built from one), EOS id 0.

    ``proposers``: names, or name -> options (or name -> a ready proposer, used as is: a test
    double, a hand-made draft). ``"draft"`` drafts with ``draft_hf`` (default: the target itself,
    a separate copy); its options are ``DraftModelProposer``'s (``min_confidence``). Every other
    name is built by the registry (``create_proposer``) with its settings options, in the engine's
    own KV cache; ``self_skip`` gives ``"self"`` its ``skip_layers`` (else the default plan).
    ``method``, ``depth``, ``max_depth``, ``slots``, ``max_seq_len``, ``max_waiting``, ``policy``
    (None: the default) and any other ``config`` keyword are the ``EngineConfig``'s.
    """
    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.engine_config import EngineConfig
    from serve_app.engine.model import DecoderModel
    from serve_app.engine.proposers.draft_model import DraftModelProposer
    from serve_app.engine.proposers.registry import ProposerContext, create_proposer

    is_built = isinstance(target_hf, DecoderModel)
    weight_format = config.get("weight_format", "dense")
    model = target_hf if is_built else DecoderModel.from_hf_model(target_hf, dtype, weight_format)
    # Made first: a proposer that drafts inside the target's cache (self-speculation) needs it.
    cache = model.new_cache(slots, max_seq_len)
    wanted = dict(proposers) if isinstance(proposers, Mapping) else {name: {} for name in proposers}
    built: dict[str, Proposer] = {}
    for name, spec in wanted.items():
        if not isinstance(spec, Mapping):
            built[name] = spec
            continue
        options = dict(spec)
        if name == "draft":
            source = draft_hf if draft_hf is not None else target_hf
            if isinstance(source, DecoderModel):
                raise ValueError("a draft needs a transformers model: pass draft_hf")
            draft = DecoderModel.from_hf_model(source, dtype)
            built[name] = DraftModelProposer(draft, model.cfg.vocab_size, slots, max_seq_len, **options)
            continue
        if name == "self" and self_skip is not None:
            options.setdefault("skip_layers", list(self_skip))
        context = ProposerContext(model, tokenizer, slots, max_seq_len, options, target_cache=cache)
        built[name] = create_proposer(name, context)
    if policy is not None:
        config["policy"] = policy
    engine_config = EngineConfig(
        max_slots=slots, max_seq_len=max_seq_len, max_waiting=max_waiting, spec_method=method,
        spec_depth=depth, max_depth=max_depth, **config,
    )  # fmt: skip
    return SpecEngine(model, tokenizer, engine_config, eos_ids=[0], proposers=built, stats=stats,
                      model_pair=model_pair, cache=cache)  # fmt: skip


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (new tokens only, EOS not stopping)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


def pack_path(name: str) -> Path:
    """The converted folder of a model pack, or skip (fail under CI, where `make test` fetched it)."""
    root = Path(os.environ.get("SPECSERVE_STORE__CACHE_DIR") or default_cache_dir())
    path = root / "models" / name
    if not (path / "specserve-pack.json").exists():
        message = f"model pack {name} is not fetched at {path} (run `specserve models fetch {name}`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return pack_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """The default target and draft packs (the slow tests' real pair)."""
    return pack_path("qwen2.5-coder-1.5b-instruct"), pack_path("qwen2.5-coder-0.5b-instruct")
