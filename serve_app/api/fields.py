"""Request fields that need more than a type: completions' prompts, ``n``, penalties, ``logit_bias``.

``protocol`` declares the fields; this module checks and translates them (torch-free):

- ``prompt``: a text, a list of token ids, or a list of several of either (a batch: one choice per
  prompt, times ``n``, ``api.fanout``); a list of one is that one prompt.
- ``n``: 1..``MAX_N`` choices per prompt; a request's choices (prompts x n) at most ``MAX_CHOICES``.
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI, -2..2), ``repetition_penalty`` (vLLM's
  extension, > 0) and ``logit_bias`` (token id as a string -> -100..100) become the engine's
  ``SamplingParams`` fields (``engine.penalties`` applies them).
"""

from __future__ import annotations

from typing import Any

MAX_N = 128  # choices per prompt (OpenAI's bound on n)
MAX_CHOICES = 256  # choices per request: prompts x n

Prompt = str | list[int]


def check_prompt(v: Any) -> Any:
    """A completions ``prompt`` as one prompt (a text or token ids) or a list of several."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
        v = v[0]  # ["text"] or [[ids]]
    if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
        if len(v) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts are supported in one request")
        return [_one_prompt(p) for p in v]
    return _one_prompt(v)


def _one_prompt(v: Any) -> Prompt:
    if isinstance(v, str):
        if not v:
            raise ValueError("must not be empty")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v
    raise ValueError(
        "must be a non-empty string, a list of token ids, or a list of several of either (a batch)"
    )


def prompts(prompt: Prompt | list[Prompt]) -> list[Prompt]:
    """The prompts of a completions request, in order (one for a single prompt)."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def penalties(req: Any) -> dict[str, Any]:
    """The request's penalties and biases as ``SamplingParams`` keywords (ValueError: a bad key)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if (value := getattr(req, name, None)) is not None:
            out[name] = float(value)
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
            bias[int(key)] = float(value)
        out["logit_bias"] = bias
    return out
