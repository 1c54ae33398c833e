"""`specserve bench`'s `transformers` methods: `generate`, greedy, on the same models as ours.

- ``transformers-plain``: `generate` with a clean generation config and no EOS;
- ``transformers-assisted``: ``assistant_model`` = the draft (the model of the first proposer that
  drafts with one, ``method_names.assistant_role``), same dtype, transformers' default assistant
  schedule;
- ``transformers-lookup``: ``prompt_lookup_num_tokens=10``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.bench.method_names import ASSISTED
from loadtest.bench.results import Method, Run

LOOKUP_TOKENS = 10  # transformers-lookup's prompt_lookup_num_tokens


def _assistant_schedule(config: Any) -> str:
    """transformers' assistant settings as `generate` will fill them in (its defaults unless set)."""
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    defaults = getattr(config, "_get_default_generation_params", dict)()
    values = {k: v if (v := getattr(config, k, None)) is not None else defaults.get(k) for k in keys}
    return ", ".join(f"{k}={v}" for k, v in values.items())


def transformers_methods(names: list[str], path: Path, draft_path: Path | None, dtype: torch.dtype,
                         device: torch.device, n: int, pad: int) -> list[Method]:  # fmt: skip
    """`transformers` `generate`, greedy, sharing one target model: plain, with the draft as
    ``assistant_model`` (loaded only when asked for), with ``prompt_lookup_num_tokens``. Each model's
    generation config is replaced by a clean one and no EOS is given, so EOS is neither a stop nor
    masked (as our ``ignore_eos``): exactly n tokens (the caller checks)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import is_sklearn_available

    def load(p: Path) -> Any:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype).to(device).eval()
        model.generation_config = GenerationConfig(pad_token_id=pad)
        return model

    state = {"model": load(path)}
    notes = {
        "transformers-plain": "`generate`, greedy",
        "transformers-lookup": f"`generate(prompt_lookup_num_tokens={LOOKUP_TOKENS})`",
    }
    if ASSISTED in names:
        if draft_path is None:
            raise ValueError(f"{ASSISTED} needs a draft model")
        state["assistant"] = load(draft_path)
        adapts = "installed" if is_sklearn_available() else "not installed"
        schedule = _assistant_schedule(state["assistant"].generation_config)
        notes[ASSISTED] = (
            f"`generate(assistant_model=<the draft, {str(dtype).removeprefix('torch.')}>)`, transformers' "
            f"default assistant schedule ({schedule}; the threshold adapts only with scikit-learn: {adapts})"
        )
    options: dict[str, Callable[[], dict[str, Any]]] = {
        "transformers-plain": dict,
        ASSISTED: lambda: {"assistant_model": state["assistant"]},
        "transformers-lookup": lambda: {"prompt_lookup_num_tokens": LOOKUP_TOKENS},
    }

    def method(name: str) -> Method:
        def run(ids: list[int]) -> Run:
            x = torch.tensor([ids], device=device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = state["model"].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                              do_sample=False, eos_token_id=None,
                                              **options[name]())  # fmt: skip
            tokens = out[0, len(ids) :].tolist()
            return Run(tokens, time.perf_counter() - start)

        return Method(name, run, state.clear, notes[name])

    return [method(m) for m in names]
