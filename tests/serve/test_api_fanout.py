"""``n`` choices and completions' prompt batches through the HTTP layer (``api.fanout``), over a fake
engine that answers each engine request with its own prompt, seed and id: indexes in OpenAI's
order, derived seeds, usage, streamed chunks per choice, and the error path (a refused or failing
choice fails the request and no other choice is left running); penalties and logit_bias reaching
the engine's sampling parameters."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient

from serve_app.api import create_app
from serve_app.api.fanout import derived_seed, merge_speculation
from serve_app.api.protocol import SpeculationInfo
from serve_app.config import ServerSettings
from serve_app.wire import GenerateChunk, GenerateError, GenerateRequest
from tests.serve.fake_engine import CHAT, COMPLETION, SPEC, FakeEngine, assert_error, sse


class ChoiceEngine(FakeEngine):
    """Answers "<prompt>/<seed>" in two chunks; a prompt named in ``refuse`` is refused (400), one
    named in ``hang`` never finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: set[str] = set()
        self.hang: set[str] = set()

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        handed_final, prompt = False, str(request.prompt or "chat")
        try:
            if prompt in self.refuse:
                handed_final = True
                error = GenerateError(f"prompt {prompt} is too long", param="prompt")
                yield GenerateChunk(request.request_id, finished=True, error=error)
                return
            rid, n_in = request.request_id, len(prompt)
            yield GenerateChunk(rid, f"{prompt}/", [1], prompt_tokens=n_in, completion_tokens=1)
            await asyncio.sleep(0.01)
            if prompt in self.hang:
                await asyncio.Event().wait()
            handed_final = True
            yield GenerateChunk(rid, str(request.sampling.seed), [2, 3], True, "length", n_in, 3, SPEC)
        finally:
            self.closed.append(request.request_id)
            if not handed_final:
                self.aborted.append(request.request_id)


@pytest.fixture
def engine() -> ChoiceEngine:
    return ChoiceEngine()


@pytest.fixture
def http(engine: ChoiceEngine) -> TestClient:
    return TestClient(create_app(engine, ServerSettings()), raise_server_exceptions=False)


def test_chat_n_choices_with_derived_seeds(http: TestClient, engine: ChoiceEngine) -> None:
    body = http.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 10}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["chat/10", "chat/11", "chat/12"]
    assert [r.request_id for r in engine.requests] == [f"{body['id']}-{i}" for i in range(3)]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}  # prompt once
    assert body["speculation"]["drafted"] == 3 * SPEC["drafted"]
    assert sorted(engine.closed) == sorted(r.request_id for r in engine.requests) and engine.aborted == []
    unseeded = http.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()
    assert [c["message"]["content"] for c in unseeded["choices"]] == ["chat/None"] * 2  # each draws its own


def test_completion_prompt_batch_is_prompt_major(http: TestClient, engine: ChoiceEngine) -> None:
    req = {**COMPLETION, "prompt": ["ab", [7, 8, 9]], "n": 2, "seed": 5, "echo": True}
    body = http.post("/v1/completions", json=req).json()
    texts = [c["text"] for c in body["choices"]]
    # echo: the prompt's text first (token ids decoded by the replica), then the choice
    assert texts == ["abab/5", "abab/6", "\x07\x08\x09[7, 8, 9]/5", "\x07\x08\x09[7, 8, 9]/6"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [r.prompt for r in engine.requests] == ["ab", "ab", [7, 8, 9], [7, 8, 9]]
    assert body["usage"]["prompt_tokens"] == len("ab") + len("[7, 8, 9]")  # each prompt once
    assert body["usage"]["completion_tokens"] == 12
    one = http.post("/v1/completions", json={**COMPLETION, "prompt": [[7, 8, 9]]}).json()
    assert len(one["choices"]) == 1 and engine.requests[-1].prompt == [7, 8, 9]  # a batch of one


@pytest.mark.parametrize("path", ["chat", "completions"])
def test_streamed_chunks_carry_their_choice_index(http: TestClient, engine: ChoiceEngine, path: str) -> None:
    base, url = (CHAT, "/v1/chat/completions") if path == "chat" else (COMPLETION, "/v1/completions")
    req = {**base, "n": 2, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    *events, usage, done = sse(http.post(url, json=req))
    assert done == "[DONE]" and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["speculation"]["drafted"] == 2 * SPEC["drafted"]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for event in events:
        (choice,) = event["choices"]
        piece = choice["delta"].get("content") if path == "chat" else choice["text"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
            assert event["speculation"] == SPEC  # the choice's own block
    prompt = "chat" if path == "chat" else COMPLETION["prompt"]
    assert texts == {0: f"{prompt}/1", 1: f"{prompt}/2"} and reasons == {0: "length", 1: "length"}
    if path == "chat":  # each choice opens with its role
        roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
        assert roles == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_fails_the_request_and_leaves_nothing_running(
    http: TestClient, engine: ChoiceEngine, stream: bool
) -> None:
    engine.refuse, engine.hang = {"bad"}, {"slow"}
    req = {**COMPLETION, "prompt": ["slow", "bad", "slow"], "stream": stream}
    assert_error(http.post("/v1/completions", json=req), 400, "prompt", "prompt bad is too long")
    ids = [r.request_id for r in engine.requests]
    assert sorted(engine.closed) == sorted(ids)  # every engine stream was closed ...
    assert all(i in engine.aborted for i in (ids[0], ids[2]))  # ... the running ones aborted


def test_a_failing_choice_mid_stream_ends_the_stream_and_aborts_the_others(
    engine: ChoiceEngine, http: TestClient
) -> None:
    original = engine._stream

    async def failing(request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        async for chunk in original(request):
            yield chunk
            if request.request_id.endswith("-1"):  # once streaming began (the others hang)
                await asyncio.sleep(0.1)
                raise RuntimeError("secret internal detail")

    engine._stream = failing  # type: ignore[method-assign]
    engine.hang = {COMPLETION["prompt"]}
    events = sse(http.post("/v1/completions", json={**COMPLETION, "n": 3, "stream": True}))
    assert events[-2]["error"]["type"] == "server_error" and "secret" not in str(events)
    ids = [r.request_id for r in engine.requests]
    assert sorted(engine.closed) == sorted(ids) and sorted(engine.aborted) == sorted(ids)  # none left


def test_derived_seeds_wrap_and_speculation_blocks_merge() -> None:
    assert derived_seed(2**64 - 1, 1) == -(2**63) and derived_seed(-5, 2) == -3
    a = SpeculationInfo(proposer="ngram", steps=2, spec_steps=2, drafted=4, accepted=2,
                        accepted_per_position=[2], steps_by_proposer={"draft": 2, "self": 1})  # fmt: skip
    b = SpeculationInfo(proposer="self", steps=3, spec_steps=1, drafted=2, accepted=2,
                        accepted_per_position=[1, 1], steps_by_proposer={"self": 1})  # fmt: skip
    merged = merge_speculation([a, None, b])
    assert merged.steps_by_proposer == {"draft": 2, "self": 2}
    assert (merged.drafted, merged.accepted, merged.accepted_per_position) == (6, 4, [3, 1])
    assert merged.acceptance_rate == round(4 / 6, 4) and merged.mean_accepted_length == round(7 / 3, 4)
    assert merge_speculation([None, a]) is a and merge_speculation([]) is None


def test_one_choice_passes_the_engine_stream_through(http: TestClient, engine: ChoiceEngine) -> None:
    body = http.post("/v1/chat/completions", json={**CHAT, "seed": 4}).json()
    assert engine.requests[-1].request_id == body["id"] and engine.requests[-1].sampling.seed == 4
    assert [dataclasses.asdict(r.sampling)["seed"] for r in engine.requests] == [4]


def test_penalties_and_logit_bias_reach_the_engine(http: TestClient, engine: ChoiceEngine) -> None:
    extra = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.1,
             "logit_bias": {"7": -100, "5": 10.5}}  # fmt: skip
    for url, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        assert http.post(url, json={**base, **extra}).status_code == 200
        s = engine.requests[-1].sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.1)
        assert s.logit_bias == ((5, 10.5), (7, -100.0)) and s.penalized
    http.post("/v1/chat/completions", json=CHAT)
    assert not engine.requests[-1].sampling.penalized  # nothing asked: nothing to pay
