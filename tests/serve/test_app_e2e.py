"""The Ray Serve application end to end through Ray Serve with the real SmolLM2 pack, the official
`openai` client and real HTTP (its pure parts: ``test_app.py``).

One application serves every end-to-end test (with an API key, so every test also exercises auth):
SmolLM2-135M as target and as its own draft, so speculation is on and accepts nearly everything,
in float32 so greedy speculative output must equal plain output token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from ray import serve

from serve_app.app import build_app

APP = "specserve-e2e"
MODEL = "smollm2"
KEY = "sk-test-e2e"
MAX_SEQ_LEN = 512
MAX_TOKENS_LIMIT = 256
MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


@pytest.fixture(scope="module")
def base_url(smollm2_path, serve_http: str) -> Iterator[str]:
    """The application, deployed once for the module (the pack first: no Ray when it is missing)."""
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": pack},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 4, "max_seq_len": MAX_SEQ_LEN},
        # static: every "auto" request drafts with the draft model. (goodput, the default, would
        # rightly prefer the free n-gram proposer here: SmolLM2 drafting for itself costs as much
        # as the target.)
        "speculation": {
            "method": "draft",
            "depth": 4,
            "policy": "static",
            "proposers": {"draft": {"int8": False}},
        },
        "server": {"api_key": KEY, "served_model_name": MODEL, "max_tokens_limit": MAX_TOKENS_LIMIT},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 16},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield serve_http
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def engine_stats() -> dict:
    from serve_app.app import ENGINE_DEPLOYMENT

    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP).stats.remote().result()


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def chat(client: openai.OpenAI, **kwargs):
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0.0, **kwargs}
    return client.chat.completions.create(**params)


def streamed_text(client: openai.OpenAI, **kwargs) -> tuple[str, dict | None, str | None]:
    text, speculation, reason = [], None, None
    for chunk in chat(client, stream=True, **kwargs):
        extra = chunk.model_extra or {}
        speculation = extra.get("speculation") or speculation
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(text), speculation, reason


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_health_models_and_api_key(base_url: str, client: openai.OpenAI) -> None:
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200  # no key needed
    assert MODEL in [m.id for m in client.models.list().data]
    assert requests.get(f"{base_url}/v1/models", timeout=30).status_code == 401
    wrong = requests.get(f"{base_url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_chat_with_speculation(client: openai.OpenAI) -> None:
    response = chat(client)
    choice = response.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert 0 < response.usage.completion_tokens <= 40
    speculation = response.model_extra["speculation"]
    assert speculation["proposer"] == "draft" and speculation["drafted"] > 0
    assert speculation["accepted"] > 0 and speculation["mean_accepted_length"] > 1.0


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_stream_equals_plain_decoding(client: openai.OpenAI) -> None:
    spec_text, speculation, reason = streamed_text(client)
    plain = chat(client, extra_body={"speculation": {"mode": "off"}})
    assert spec_text == plain.choices[0].message.content
    assert reason == plain.choices[0].finish_reason
    assert speculation is not None and speculation["drafted"] > 0
    assert plain.model_extra["speculation"]["drafted"] == 0
    plain_stream, _, _ = streamed_text(client, extra_body={"speculation": {"mode": "off"}})
    assert plain_stream == spec_text


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_a_request_may_ask_for_token_trees(client: openai.OpenAI) -> None:
    """``speculation.tree_nodes`` through the official client: the same text as plain decoding, a
    ``tree_steps`` count in the block; a negative budget is a 400 in OpenAI's shape."""
    plain = chat(client, extra_body={"speculation": {"mode": "off"}})
    trees = {"speculation": {"mode": "draft", "tree_nodes": 3}}
    text, speculation, _ = streamed_text(client, extra_body=trees)
    assert text == plain.choices[0].message.content
    assert speculation is not None and speculation["drafted"] > 0 and speculation["tree_steps"] >= 0
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, extra_body={"speculation": {"mode": "draft", "tree_nodes": -1}})
    assert "tree_nodes" in str(refused.value)


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_unknown_request_fields_are_ignored(client: openai.OpenAI) -> None:
    """What LangChain / LiteLLM send beside OpenAI's fields: accepted, ignored, the same answer."""
    extras = {"chat_template_kwargs": {"enable_thinking": False}, "repetition_detection": True}
    with_extras = chat(client, extra_body={**extras, "speculation": {"mode": "off"}})
    plain = chat(client, extra_body={"speculation": {"mode": "off"}})
    assert with_extras.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_tokenize_counts_what_a_request_uses(base_url: str, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict) -> dict:
        response = requests.post(f"{base_url}{path}", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    prompt = "def fibonacci(n):"
    tokens = post("/tokenize", {"model": MODEL, "prompt": prompt})
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
    assert tokens["count"] == completion.usage.prompt_tokens == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_SEQ_LEN
    assert post("/detokenize", {"tokens": tokens["tokens"]})["prompt"].endswith(prompt)
    counted = post("/tokenize", {"messages": MESSAGES})["count"]
    assert counted == chat(client, max_tokens=4).usage.prompt_tokens
    assert requests.get(f"{base_url}/version", headers=headers, timeout=30).json()["version"]


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_seeded_sampling_is_the_same_with_speculation_on_or_off_streamed_or_not(
    base_url: str, client: openai.OpenAI
) -> None:
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 5, "max_tokens": 32}
    spec = chat(client, **sampled)
    plain = chat(client, extra_body={"speculation": {"mode": "off"}}, **sampled)
    streamed, speculation, _ = streamed_text(client, **sampled)
    assert spec.model_extra["speculation"]["drafted"] > 0 and speculation["drafted"] > 0
    assert spec.choices[0].message.content == plain.choices[0].message.content == streamed
    other = chat(client, **{**sampled, "seed": 6}).choices[0].message.content
    assert other != streamed  # the seed, not a fixed stream, decides
    card = client.models.list().data[0].model_extra
    assert card["exact"] is True and card["max_model_len"] == MAX_SEQ_LEN
    assert requests.get(f"{base_url}/health", timeout=30).json() == {"status": "ok", "exact": True}


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_completions_and_concurrent_requests(client: openai.OpenAI) -> None:
    prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time"]

    def complete(prompt: str) -> str:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0)
        return response.choices[0].text

    alone = [complete(p) for p in prompts[:2]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts))
    assert together[:2] == alone  # batch composition never changes an output
    assert all(together)


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"max_tokens": MAX_TOKENS_LIMIT + 1}, 400),
        ({"messages": [{"role": "user", "content": "hello " * MAX_SEQ_LEN}]}, 400),  # over the context
        ({"model": "no-such-model"}, 404),
        ({"extra_body": {"speculation": {"mode": "no-such-proposer"}}}, 400),
        ({"extra_body": {"speculation": {"mode": "off", "bogus": 1}}}, 400),
        ({"temperature": -1.0}, 400),
    ],
)
def test_bad_requests_are_4xx(client: openai.OpenAI, kwargs: dict, status: int) -> None:
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            response = chat(client, stream=stream, **kwargs)
            if stream:
                list(response)
        assert info.value.status_code == status, info.value.response.text
        assert info.value.response.json()["error"]["message"]
    assert chat(client, max_tokens=4).choices[0].message.content  # the server is fine


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_client_disconnect_frees_the_slot(base_url: str) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS_LIMIT,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    aborts = engine_stats()["aborts"]
    url = f"{base_url}/v1/chat/completions"
    with requests.post(url, json=body, headers=headers, stream=True, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines(decode_unicode=True)
        events = [line for line in (next(lines) for _ in range(12)) if line.startswith("data:")]
        assert events
        assert engine_stats()["running"] == 1
    # The connection is closed: proxy -> ingress -> engine replica -> abort in the engine loop.
    wait_for(lambda: engine_stats()["running"] == 0 and engine_stats()["streams"] == 0)
    stats = engine_stats()
    assert stats["aborts"] == aborts + 1  # aborted, not finished
    assert stats["waiting"] == 0 and stats["healthy"]
