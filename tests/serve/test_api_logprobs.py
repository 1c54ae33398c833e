"""Logprobs and echo through the HTTP layer.

First the shapes, on the fake engine of ``test_api``: chat's ``logprobs.content`` and completions'
legacy columns, streamed (each chunk carries the logprobs of its own tokens) and not, ``echo`` with
text and token-id prompts. Then the official ``openai`` client against a real local server over a
real (tiny) engine: the values with speculation on equal those with it off, streamed or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from serve_app.api import create_app
from serve_app.async_engine import AsyncEngine
from serve_app.config import ServerSettings
from serve_app.engine.token_logprobs import LogprobRun
from serve_app.wire import GenerateChunk
from tests.conftest import make_tiny_engine, make_tiny_hf_model
from tests.serve.fake_engine import CHAT, COMPLETION, SPEC, FakeEngine, engine, http, serving, sse

__all__ = ["engine", "http"]  # fixtures used below

# "Hel", "lo", then "€" split over two tokens (its bytes e2 | 82 ac), then "!".
PIECES = {
    1: ("Hel", b"Hel"),
    2: ("lo", b"lo"),
    3: ("!", b"!"),
    4: ("\ufffd", b"\xe2"),
    5: ("\ufffd", b"\x82\xac"),
}
INF = float("-inf")


def run(*entries: tuple[int, float | None, list[tuple[int, float]]]) -> LogprobRun:
    """A run from (token, logprob, [(alternative, logprob), ...]) entries."""
    return LogprobRun(
        [e[0] for e in entries],
        [e[1] for e in entries],
        [[t for t, _ in e[2]] for e in entries],
        [[v for _, v in e[2]] for e in entries],
        PIECES,
    )


E1 = (1, -0.5, [(1, -0.5), (2, -1.5)])
E2 = (2, -0.125, [(2, -0.125), (1, -4.0)])
E4 = (4, -2.0, [(4, -2.0), (2, INF)])  # an alternative the model rules out
E5 = (5, INF, [(3, -1.0), (1, -2.0)])  # a chosen token outside the alternatives
E3 = (3, -1.0, [(3, -1.0), (2, -1.0)])


def logprob_chunks() -> list[GenerateChunk]:
    """Three chunks: "Hello", then the first byte of "€" (text held back by the detokenizer), then
    "€!" (final); the first carries the prompt's logprobs too."""
    prompt = run((2, None, []), (3, -3.0, [(1, -0.25), (3, -3.0)]))
    return [
        GenerateChunk("", "Hello", [1, 2], prompt_tokens=2, completion_tokens=2, logprobs=run(E1, E2),
                      prompt_logprobs=prompt),
        GenerateChunk("", "", [4], prompt_tokens=2, completion_tokens=3, logprobs=run(E4)),
        GenerateChunk("", "€!", [5, 3], True, "stop", 2, 5, SPEC, logprobs=run(E5, E3)),
    ]  # fmt: skip


def chat_entry(token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
    def one(t: int, v: float) -> dict:
        return {"token": PIECES[t][0], "logprob": v, "bytes": list(PIECES[t][1])}

    return {**one(token, logprob), "top_logprobs": [one(t, v) for t, v in top]}


CHAT_CONTENT = [
    chat_entry(*E1),
    chat_entry(*E2),
    chat_entry(4, -2.0, [(4, -2.0), (2, -9999.0)]),  # JSON has no -inf: vLLM's floor
    chat_entry(5, -9999.0, [(3, -1.0), (1, -2.0)]),
    chat_entry(*E3),
]


def test_chat_logprobs(http: TestClient, engine: FakeEngine) -> None:
    engine.chunks = logprob_chunks()
    body = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    assert engine.requests[-1].sampling.logprobs == 2 and engine.requests[-1].sampling.prompt_logprobs is None
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "Hello€!"
    assert choice["logprobs"] == {"content": CHAT_CONTENT}
    assert b"".join(bytes(e["bytes"]) for e in CHAT_CONTENT) == "Hello€!".encode()
    http.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert engine.requests[-1].sampling.logprobs == 0  # the chosen tokens alone
    http.post("/v1/chat/completions", json={**CHAT, "logprobs": False})
    assert engine.requests[-1].sampling.logprobs is None


def test_chat_stream_chunks_carry_their_tokens_logprobs(http: TestClient, engine: FakeEngine) -> None:
    engine.chunks = logprob_chunks()
    req = {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True}
    *chunks, _ = sse(http.post("/v1/chat/completions", json=req))
    role, *content, final = chunks
    assert role["choices"][0]["logprobs"] is None and final["choices"][0]["logprobs"] is None
    # the held-back token still shows (empty content) so every token's logprob is streamed
    assert [c["choices"][0]["delta"]["content"] for c in content] == ["Hello", "", "€!"]
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in content] == [2, 1, 2]
    assert [e for c in content for e in c["choices"][0]["logprobs"]["content"]] == CHAT_CONTENT


def completion_logprobs(echo: bool) -> dict:
    prompt = {
        "tokens": ["lo", "!"],
        "token_logprobs": [None, -3.0],
        "top_logprobs": [None, {"Hel": -0.25, "!": -3.0}],
    }
    out = {
        "tokens": ["Hel", "lo", "\ufffd", "\ufffd", "!"],
        "token_logprobs": [-0.5, -0.125, -2.0, -9999.0, -1.0],
        # the k alternatives and the chosen token (up to k + 1 entries); one text, one entry
        "top_logprobs": [{"Hel": -0.5, "lo": -1.5}, {"lo": -0.125, "Hel": -4.0},
                         {"\ufffd": -2.0, "lo": -9999.0}, {"!": -1.0, "Hel": -2.0, "\ufffd": -9999.0},
                         {"!": -1.0, "lo": -1.0}],
    }  # fmt: skip
    columns = {k: (prompt[k] if echo else []) + out[k] for k in out}
    lengths = [len(t) for t in columns["tokens"]]
    return {"text_offset": [sum(lengths[:i]) for i in range(len(lengths))], **columns}


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_and_echo(http: TestClient, engine: FakeEngine, echo: bool) -> None:
    engine.chunks = logprob_chunks()
    body = http.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "echo": echo}).json()
    sampling = engine.requests[-1].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs) == (2, 2 if echo else None)
    (choice,) = body["choices"]
    assert choice["text"] == ("def add(a, b):" if echo else "") + "Hello€!"
    assert choice["logprobs"] == completion_logprobs(echo)
    *chunks, _ = sse(
        http.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "echo": echo, "stream": True})
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [c["choices"][0]["text"] for c in chunks] == [
        ("def add(a, b):" if echo else "") + "Hello",
        "",
        "€!",
        "",
    ]
    assert len(streamed) == 3
    joined = {k: [x for part in streamed for x in part[k]] for k in streamed[0]}
    assert joined == choice["logprobs"]  # offsets go on across chunks


def test_echo_without_logprobs_and_with_token_ids(http: TestClient, engine: FakeEngine) -> None:
    body = http.post("/v1/completions", json={**COMPLETION, "prompt": [104, 105], "echo": True}).json()
    assert body["choices"][0]["text"] == "hi" + "Hello, world!" and body["choices"][0]["logprobs"] is None
    assert engine.requests[-1].sampling.prompt_logprobs is None
    *chunks, _ = sse(http.post("/v1/completions", json={**COMPLETION, "echo": True, "stream": True}))
    assert [c["choices"][0]["text"] for c in chunks] == ["def add(a, b):Hello", ", world", "!", ""]


# --- the openai client against a real server over a real tiny engine ---------------------------------


@pytest.fixture(scope="module")
def tiny_client(tiny_tokenizer) -> Iterator[openai.OpenAI]:
    """uvicorn serving the API over an AsyncEngine (no Ray) whose tiny float32 engine has n-gram,
    self-speculation and the target as its own draft; static policy: a request drafts whenever it
    names a proposer."""
    target = make_tiny_hf_model(len(tiny_tokenizer), seed=0, layers=4)
    proposers = {"ngram": {"min_ngram": 1}, "self": {}, "draft": {}}
    engine = make_tiny_engine(target, tiny_tokenizer, proposers=proposers, method="draft", policy="static",
                              max_depth=8, self_skip=[1], max_seq_len=256)  # fmt: skip
    async_engine = AsyncEngine(engine, model_name="tiny")
    with serving(create_app(async_engine, ServerSettings())) as client:
        yield client
    async_engine.shutdown()


SPECULATION = [{"mode": "off"}, {"mode": "ngram", "max_depth": 4}, {"mode": "self", "max_depth": 1},
               {"mode": "self", "max_depth": 4}, {"mode": "draft", "max_depth": 4}]  # fmt: skip


def chat_logprobs(client: openai.OpenAI, speculation: dict, stream: bool, **kwargs: Any) -> tuple[list, dict]:
    """The chat's logprobs content (as dicts) and its speculation block."""
    params = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 5,
        "extra_body": {"speculation": speculation, "ignore_eos": True},
    }
    params.update(kwargs)  # fmt: skip
    if not stream:
        response = client.chat.completions.create(**params)
        return [e.model_dump() for e in response.choices[0].logprobs.content], response.model_extra[
            "speculation"
        ]
    content, block = [], {}
    for chunk in client.chat.completions.create(stream=True, **params):
        block = (chunk.model_extra or {}).get("speculation") or block
        for choice in chunk.choices:
            content.extend(e.model_dump() for e in (choice.logprobs.content if choice.logprobs else []))
    return content, block


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"]
)
def test_chat_logprobs_equal_with_speculation_on_and_off(tiny_client: openai.OpenAI, sampling: dict) -> None:
    plain, block = chat_logprobs(tiny_client, SPECULATION[0], False, **sampling)
    assert len(plain) == 24 and block["drafted"] == 0 and all(len(e["top_logprobs"]) == 5 for e in plain)
    accepted = 0
    for speculation in SPECULATION:
        for stream in (False, True):
            content, block = chat_logprobs(tiny_client, speculation, stream, **sampling)
            assert content == plain, (speculation, stream)  # floats through JSON: equal iff identical
            accepted += block["accepted"]
    assert accepted > 0


def test_completion_echo_logprobs_equal_with_speculation_on_and_off(tiny_client: openai.OpenAI) -> None:
    def complete(speculation: dict, stream: bool) -> tuple[str, dict]:
        extra = {"speculation": speculation, "ignore_eos": True}
        params = {"model": "tiny", "prompt": "for i in range(10):", "max_tokens": 16, "temperature": 0.0,
                  "logprobs": 3, "echo": True, "extra_body": extra}  # fmt: skip
        if not stream:
            choice = tiny_client.completions.create(**params).choices[0]
            return choice.text, choice.logprobs.model_dump()
        text, columns = "", {}
        for chunk in tiny_client.completions.create(stream=True, **params):
            text += chunk.choices[0].text
            for key, values in (
                chunk.choices[0].logprobs.model_dump() if chunk.choices[0].logprobs else {}
            ).items():
                columns.setdefault(key, []).extend(values)
        return text, columns

    text, plain = complete(SPECULATION[0], False)
    assert text.startswith("for i in range(10):") and plain["token_logprobs"][0] is None
    assert plain["top_logprobs"][0] is None and all(plain["top_logprobs"][1:])  # texts may collide: <= 4
    assert len(plain["tokens"]) > 16 and "".join(plain["tokens"]).startswith("for i in range(10):")
    for speculation in SPECULATION:
        for stream in (False, True):
            assert complete(speculation, stream) == (text, plain), (speculation, stream)
