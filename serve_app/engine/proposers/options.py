"""The options of the built-in proposers (``speculation.proposers.<name>.*`` in the settings).

Pydantic models without torch, so that the settings can validate them in the HTTP process. Each
proposer's factory receives its options dumped into ``ProposerContext.options``.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoOptions(_Options):
    """A proposer without options."""


class DraftModelOptions(_Options):
    weight_format: Literal["target", "dense", "q8", "gguf", "q4k"] = Field(
        "target",
        description="The draft's matrices: as the target's (runtime.weight_format; for a gguf target on "
        "an AVX2-only host, q4k: measured faster there), or a format of its own (q4k: every matrix in "
        "4 bits, the cheapest draft step; needs the pack's GGUF blocks).",
    )
    int8: bool = Field(
        True, description="With dense draft weights: layers as int8 (half the bytes per draft step)."
    )
    head_tokens: int = Field(
        32768,
        ge=0,
        description="Keep only this many most frequent tokens in the draft's output head (0 = all).",
    )
    # 0.7 measured on the Qwen pair (BENCHMARKS.md, eighteenth session): a depth-8 draft that stops
    # at its first unsure token beat a fixed depth 4 by 1.15x on code and JSON and stayed at plain's
    # speed on prose and chat, where a fixed depth 4 lost 25%; "auto" gained 1-9% on every prompt.
    min_confidence: float = Field(
        0.7,
        ge=0.0,
        le=1.0,
        description="A greedy draft stops early once its top token's probability falls below this "
        "(the unsure token is still proposed); 0 = always draft the planned depth.",
    )


class NgramOptions(_Options):
    max_ngram: int = Field(4, ge=1, le=16, description="Longest suffix the lookup matches.")
    min_ngram: int = Field(2, ge=1, le=16, description="Shortest suffix the lookup matches.")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) is greater than max_ngram ({self.max_ngram})")
        return self


class SelfSpecOptions(_Options):
    skip_layers: list[int] | None = Field(
        None,
        description="Layers the self-speculative draft skips; null = the calibration stored with the model "
        "(`specserve calibrate self-spec`), else the shipped one, else a default.",
    )
    min_confidence: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="A greedy draft stops early once its top token's probability falls below this.",
    )


class HeadOptions(_Options):
    """A draft head trained on the target (EAGLE, Medusa): ``specserve train-heads``."""

    path: str | None = Field(
        None,
        description="The head file; null = the one stored with the target (heads/<proposer>.safetensors "
        "in its model folder).",
    )
    weight_format: Literal["target", "dense", "q8"] = Field(
        "target",
        description="The head's matrices: q8 for a quantized target, its dtype for a dense one "
        "(target), or as named.",
    )
    head_tokens: int = Field(
        0, ge=0, description="Tokens the head can propose (the most frequent); 0 = as it was trained."
    )
    # Measured on the 1.5B target's heads at depth 3 (BENCHMARKS.md, twenty-third session), geometric
    # mean over the bench prompts vs plain: EAGLE 0.71x at 0, ~1.0x at 0.3-0.6; Medusa 0.73x at 0,
    # 0.87x at 0.3, 1.04x at 0.6. A head drops its unsure token rather than drafting it (see propose).
    min_confidence: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="A draft stops before a token whose top probability falls below this.",
    )
