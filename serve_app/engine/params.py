"""Request parameters the engine, the HTTP layer and the wire types share; no torch here.

``SamplingParams`` (OpenAI semantics) and ``SpecOverride`` (a request's own say on speculation)
cross the Ray handle inside ``serve_app.wire.GenerateRequest``, so the ingress builds them without
importing the engine's torch code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serve_app.engine.structured import StructuredOutput
from serve_app.engine.token_logprobs import MAX_LOGPROBS

# Temperatures below this are treated as greedy. Dividing logits by a tiny positive temperature
# overflows float32 to inf and softmax then yields NaN; at such temperatures the distribution is a
# one-hot at the argmax anyway (the same threshold vLLM uses).
GREEDY_TEMPERATURE = 1e-5

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value (either sign)
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty (either sign)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics).

    `top_k == 0` and `top_p == 1.0` switch those filters off. `seed` makes sampling reproducible for
    this request; None draws a fresh random seed. `stop` strings and `stop_token_ids` end the
    request (the stop text is not returned); `ignore_eos` keeps generating past the model's EOS.
    `logprobs` (None = off) returns the target's log-probability of every generated token with the
    `logprobs` most likely alternatives (0..`MAX_LOGPROBS`); `prompt_logprobs` the same for the
    prompt's tokens (``engine.logprobs``).

    Penalties and biases change the target's logits before temperature, top-k and top-p, at every
    position, as vLLM applies them (``engine.penalties``): `logit_bias` (token id -> bias in
    [-100, 100], added first), then `repetition_penalty` (> 0, 1 = off; HF / vLLM: a token seen in
    the prompt or the output has a positive logit divided by it, a negative one multiplied), then
    `frequency_penalty` (times the token's count in the output) and `presence_penalty` (once if it
    occurs in the output) subtracted, both in [-2, 2] (OpenAI). Logprobs stay the raw logits'.

    `structured` (None = free text) holds the output to a grammar (``engine.structured``: a JSON
    object or a JSON schema): ``engine.grammar`` masks the target's tokens at every position.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted; a dict is accepted
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON) but store tuples so the object stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            bad = isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
            if k is not None and bad:
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # also rejects NaN
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        if not (0.0 < (r := self.repetition_penalty) < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """True when a penalty or a bias changes the logits (``engine.penalties``); False costs nothing."""
        return bool(self.logit_bias) or self.counts_tokens

    @property
    def counts_tokens(self) -> bool:
        """True when a penalty depends on the tokens seen so far (not only ``logit_bias``)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class SpecOverride:
    """A request's own say on speculation: ``mode`` is "auto", "off" or a proposer name."""

    mode: str = "auto"
    max_depth: int | None = None
    tree_nodes: int | None = None  # alternatives a draft may add as a token tree; None: the policy's

    def __post_init__(self) -> None:
        if not self.mode:
            raise ValueError("speculation.mode must be 'auto', 'off' or a proposer name")
        if self.max_depth is not None and self.max_depth < 0:
            raise ValueError("speculation.max_depth must be >= 0")
        if self.tree_nodes is not None and self.tree_nodes < 0:
            raise ValueError("speculation.tree_nodes must be >= 0")
