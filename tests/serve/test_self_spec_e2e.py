"""A replica configured without a draft model serves with self-speculation (issue 8), end to end.

The real Ray Serve application (the session's local cluster and HTTP proxy, ``serve_http``) with
``model.draft: null`` and ``speculation.method: self`` on the real SmolLM2-135M pack, driven through
the official ``openai`` client: every "auto" request drafts through the target's own kept layers
(static policy, so the choice does not depend on timings), in float32 so greedy speculative output
must equal plain decoding's token for token, and the response's ``speculation`` block shows that
self drafts happened. The skip set is the one a replica resolves by itself (the calibration stored
with the pack or shipped for it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from ray import serve

from serve_app.app import build_app

APP = "specserve-self-e2e"
MODEL = "smollm2-self"
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the largest of three numbers."}]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def self_client(smollm2_path, serve_http: str) -> Iterator[openai.OpenAI]:
    """The application with no draft model, deployed once for the module (the pack first: no Ray
    when it is missing); yields an ``openai`` client for it."""
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": None},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 2, "max_seq_len": 512},
        # depth 3: more drafted tokens per step than the calibrated depth 1, so the response shows
        # several positions; static: "auto" always uses the configured method.
        "speculation": {"method": "self", "depth": 3, "policy": "static"},
        "server": {"served_model_name": MODEL, "max_tokens_limit": 128},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 8},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=180)
    finally:
        serve.delete(APP)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0, **kwargs}
    return client.chat.completions.create(**params)


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_no_draft_model_replica_self_speculates_losslessly(self_client: openai.OpenAI) -> None:
    spec = chat(self_client, extra_body={"ignore_eos": True})
    plain = chat(self_client, extra_body={"ignore_eos": True, "speculation": {"mode": "off"}})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == MAX_TOKENS
    speculation = spec.model_extra["speculation"]
    assert speculation["proposer"] == "self"
    assert speculation["drafted"] > 0 and speculation["accepted"] > 0
    assert plain.model_extra["speculation"]["drafted"] == 0


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_self_by_name_streamed_and_draft_unavailable(self_client: openai.OpenAI) -> None:
    plain = chat(self_client, extra_body={"speculation": {"mode": "off"}}).choices[0].message.content
    text, speculation = [], None
    stream = chat(self_client, stream=True, extra_body={"speculation": {"mode": "self", "max_depth": 2}})
    for chunk in stream:
        speculation = (chunk.model_extra or {}).get("speculation") or speculation
        text.extend(choice.delta.content or "" for choice in chunk.choices)
    assert "".join(text) == plain
    assert speculation is not None and speculation["proposer"] == "self" and speculation["drafted"] > 0
    with pytest.raises(openai.BadRequestError):  # no draft model on this replica
        chat(self_client, max_tokens=4, extra_body={"speculation": {"mode": "draft"}})
