"""AsyncEngine in-process, on a tiny random model: streaming, aborts, errors, health, telemetry.

No Ray here: the AsyncEngine is the replica's engine client as the Serve deployment wraps it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.async_engine import AsyncEngine
from serve_app.config import TelemetrySettings
from serve_app.engine.engine import SpecEngine
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.observability import metric_names as m
from serve_app.observability.metrics import EngineMetrics
from serve_app.observability.tracing import get_tracer, inject_context, setup_tracing
from serve_app.wire import GenerateChunk, GenerateRequest
from tests.conftest import make_tiny_engine, make_tiny_hf_model

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    '{"name": "specserve", "tags": [',
    "for i in range(10):\n    print(i",
    "The dog",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    return make_tiny_hf_model(len(tiny_tokenizer), seed=0)


def make_engine(target_hf, tokenizer, slots: int = 4, max_waiting: int = 64, spec: bool = True) -> SpecEngine:
    """A float32 tiny engine; with ``spec`` the target drafts for itself (speculation always on)."""
    return make_tiny_engine(
        target_hf, tokenizer, proposers=["draft"] if spec else (), method="draft" if spec else None,
        depth=3, max_depth=8, slots=slots, max_seq_len=MAX_SEQ_LEN, max_waiting=max_waiting,
    )  # fmt: skip


@pytest.fixture
def make_async(target_hf, tiny_tokenizer):
    """Build AsyncEngines (memory metrics) and shut every one down at the end of the test."""
    made: list[AsyncEngine] = []

    def build(engine: SpecEngine | None = None, **kwargs) -> AsyncEngine:
        engine = engine or make_engine(target_hf, tiny_tokenizer)
        kwargs.setdefault("metrics", EngineMetrics("tiny", backend="memory"))
        kwargs.setdefault("max_tokens_limit", 64)
        async_engine = AsyncEngine(engine, model_name="tiny", **kwargs)
        made.append(async_engine)
        return async_engine

    yield build
    for async_engine in made:
        async_engine.shutdown()


def request(request_id: str, prompt=None, params: SamplingParams = GREEDY, **kwargs) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, sampling=params, prompt=prompt, **kwargs)


async def collect(engine: AsyncEngine, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(req)]


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_concurrent_requests_match_the_sync_engine(make_async, target_hf, tiny_tokenizer) -> None:
    reference = make_engine(target_hf, tiny_tokenizer, slots=8)
    expected = reference.generate([tiny_tokenizer(p)["input_ids"] for p in PROMPTS], GREEDY)
    engine = make_async(make_engine(target_hf, tiny_tokenizer, slots=3))  # fewer slots: requests wait

    async def run() -> list[list[GenerateChunk]]:
        reqs = [request(f"r{i}", prompt) for i, prompt in enumerate(PROMPTS)]
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    results = asyncio.run(run())
    for chunks, want in zip(results, expected, strict=True):
        assert all(c.error is None for c in chunks)
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        final = chunks[-1]
        assert final.finished and final.finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])
        assert final.completion_tokens == 16 and final.prompt_tokens == len(want.prompt_ids)
        assert final.speculation is not None and final.speculation["drafted"] > 0
        assert final.speculation["accepted"] == final.speculation["drafted"]  # self-draft
    metrics = engine.metrics
    assert metrics.value(m.REQUEST_SUCCESS, finished_reason="length") == len(PROMPTS)
    assert metrics.value(m.NUM_DRAFT_TOKENS) == sum(r.spec_stats.drafted for r in expected)
    assert metrics.value(m.GENERATION_TOKENS) == 16 * len(PROMPTS)  # first tokens (prefill) included
    assert metrics.histogram(m.TTFT).count == len(PROMPTS)
    assert metrics.histogram(m.TPOT).count == len(PROMPTS)
    assert metrics.histogram(m.ITL).count == 15 * len(PROMPTS)  # one sample per token after the first
    for name in (m.E2E, m.QUEUE_TIME, m.PREFILL_TIME, m.DECODE_TIME, m.INFERENCE_TIME):
        assert metrics.histogram(name).count == len(PROMPTS), name
    # every request's decode time is the sum of its inter-token gaps
    assert metrics.histogram(m.ITL).sum == pytest.approx(metrics.histogram(m.DECODE_TIME).sum)
    assert metrics.value(m.NUM_RUNNING) == 0 and metrics.value(m.NUM_WAITING) == 0
    assert metrics.value(m.KV_CACHE_USAGE) == 0.0 and metrics.value(m.EXACT_MODE) == float(
        engine.engine.exact
    )
    assert engine.stats()["running"] == 0 and engine.engine.cache.num_free == 3


def test_ids_and_messages_prompts(make_async, target_hf, tiny_tokenizer) -> None:
    engine = make_async()
    messages = [{"role": "user", "content": "The quick brown fox"}]
    chat_ids = engine.engine.encode_messages(messages)
    reference = make_engine(target_hf, tiny_tokenizer, spec=False)
    want = reference.generate([chat_ids], GREEDY)[0].token_ids

    async def run():
        by_messages = await collect(engine, request("m", messages=messages))
        by_ids = await collect(engine, request("i", prompt=chat_ids, speculation=SpecOverride(mode="off")))
        return by_messages, by_ids

    by_messages, by_ids = asyncio.run(run())
    assert [t for c in by_messages for t in c.token_ids] == want
    assert [t for c in by_ids for t in c.token_ids] == want
    assert by_ids[-1].speculation["drafted"] == 0


def slowed(engine: SpecEngine, seconds: float) -> SpecEngine:
    """Make every step of ``engine`` take at least ``seconds`` longer."""
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]
    return engine


def test_early_close_aborts_and_frees_the_slot(make_async, target_hf, tiny_tokenizer) -> None:
    engine = make_async(slowed(make_engine(target_hf, tiny_tokenizer), 0.01))  # 100 tokens: >= 0.25 s
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        gen = engine.generate(request("long", "The dog", long))
        first = await gen.__anext__()
        assert first.error is None and not first.finished
        assert engine.stats()["running"] == 1
        await gen.aclose()
        await wait_for(lambda: engine.stats()["running"] == 0 and engine.stats()["streams"] == 0)
        # A cancelled consumer task aborts too.
        task = asyncio.create_task(collect(engine, request("cancelled", "The dog", long)))
        await wait_for(lambda: engine.stats()["running"] == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: engine.stats()["running"] == 0 and engine.stats()["streams"] == 0)
        chunks = await collect(engine, request("after", "The dog"))  # the engine goes on
        assert chunks[-1].finished and chunks[-1].error is None

    asyncio.run(run())
    assert engine.engine.cache.num_free == 4
    assert engine.engine.proposers["draft"].cache.num_free == 4
    assert engine.metrics.value(m.REQUEST_SUCCESS, finished_reason="abort") == 2
    assert engine.stats()["aborts"] == 2


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prompt": "The dog " * 200}, "maximum sequence length"),
        ({"prompt": [10**6]}, "token ids"),
        ({"prompt": "x", "speculation": SpecOverride(mode="medusa")}, "medusa"),
        ({"prompt": ""}, "empty"),
        ({"messages": [{"role": "user", "content": "hi"}], "prompt": None}, None),  # fine
    ],
)
def test_bad_input_is_one_400_chunk(make_async, kwargs, needle) -> None:
    engine = make_async()
    chunks = asyncio.run(collect(engine, request("bad", **kwargs)))
    if needle is None:
        assert chunks[-1].error is None
        return
    assert len(chunks) == 1
    (chunk,) = chunks
    assert chunk.finished and chunk.error is not None
    assert chunk.error.status == 400 and chunk.error.type == "invalid_request_error"
    assert needle in chunk.error.message
    assert engine.stats()["streams"] == 0 and engine.is_healthy()


def test_queue_full_is_503_overloaded(make_async, target_hf, tiny_tokenizer) -> None:
    engine = make_async(make_engine(target_hf, tiny_tokenizer, max_waiting=0))
    (chunk,) = asyncio.run(collect(engine, request("full", "The dog")))
    assert chunk.finished and chunk.error.status == 503
    assert chunk.error.type == "overloaded_error" and chunk.error.code == "overloaded"
    assert engine.metrics.value(m.REQUESTS_REFUSED, reason=m.ENGINE_QUEUE_FULL) == 1


def test_request_timeout_aborts(make_async, target_hf, tiny_tokenizer) -> None:
    spec_engine = slowed(make_engine(target_hf, tiny_tokenizer), 0.02)
    engine = make_async(spec_engine, request_timeout_s=0.3)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    chunks = asyncio.run(collect(engine, request("slow", "The dog", long)))
    assert chunks[-1].finished and chunks[-1].error.status == 504
    assert sum(len(c.token_ids) for c in chunks) < 100

    async def settle() -> None:
        await wait_for(lambda: engine.stats()["running"] == 0)

    asyncio.run(settle())
    assert spec_engine.cache.num_free == 4


def test_health_goes_false_while_a_step_is_stuck(make_async, target_hf, tiny_tokenizer) -> None:
    spec_engine = make_engine(target_hf, tiny_tokenizer)
    release = threading.Event()
    stuck = threading.Event()
    step = spec_engine.step

    def blocking_step():
        stuck.set()
        release.wait()
        return step()

    spec_engine.step = blocking_step
    engine = make_async(spec_engine, stuck_after_s=0.2)

    async def run() -> list[GenerateChunk]:
        assert await engine.health()
        task = asyncio.create_task(collect(engine, request("r", "The dog")))
        await wait_for(stuck.is_set)
        await wait_for(lambda: not engine.is_healthy(), timeout=5)
        assert not await engine.health()
        release.set()
        chunks = await task
        assert await engine.health()
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finished and chunks[-1].error is None


def test_loop_survives_a_failing_step(make_async, target_hf, tiny_tokenizer) -> None:
    """The batch of a step that raises fails with 500; waiting and later requests are served."""
    spec_engine = make_engine(target_hf, tiny_tokenizer, slots=1)  # one running at a time
    step = spec_engine.step

    def failing_step():
        outputs = step()
        if any(o.request_id == "bad" for o in outputs):
            raise RuntimeError("boom")
        return outputs

    spec_engine.step = failing_step
    engine = make_async(spec_engine)
    expected = make_engine(target_hf, tiny_tokenizer).generate(
        [tiny_tokenizer("The dog")["input_ids"]], GREEDY
    )

    async def run():
        # Tasks start in order: "bad" is added first and takes the only slot; "good" waits.
        bad = asyncio.create_task(collect(engine, request("bad", "x")))
        good = asyncio.create_task(collect(engine, request("good", "The dog")))
        return await bad, await good, await collect(engine, request("later", "The dog"))

    bad, good, later = asyncio.run(run())
    assert len(bad) == 1 and bad[0].error.status == 500 and "boom" in bad[0].error.message
    for chunks in (good, later):
        assert chunks[-1].error is None
        assert [t for c in chunks for t in c.token_ids] == expected[0].token_ids
    assert engine.is_healthy() and engine.stats()["step_failures"] == 1
    assert spec_engine.cache.num_free == 1


def test_dead_loop_is_unhealthy_and_refuses(make_async, target_hf, tiny_tokenizer) -> None:
    spec_engine = make_engine(target_hf, tiny_tokenizer)
    engine = make_async(spec_engine)

    def broken() -> bool:
        raise RuntimeError("loop bug")

    spec_engine.has_work = broken
    chunks = asyncio.run(collect(engine, request("r", "The dog")))  # wakes the loop, which dies
    assert chunks[-1].error is not None and chunks[-1].error.status == 503
    assert not engine.is_healthy()
    (chunk,) = asyncio.run(collect(engine, request("r2", "The dog")))
    assert chunk.error.status == 503 and "loop bug" in chunk.error.message


def test_idle_loop_does_not_step(make_async) -> None:
    engine = make_async()
    asyncio.run(collect(engine, request("r", "The dog")))
    steps = engine.stats()["steps"]
    time.sleep(0.2)
    assert engine.stats()["steps"] == steps
    assert engine._thread.is_alive()


def test_info(make_async) -> None:
    info = asyncio.run(make_async(default_max_tokens=32).info())
    assert info.model == "tiny" and info.max_seq_len == MAX_SEQ_LEN and info.max_tokens_limit == 64
    assert info.proposers == ["draft"] and info.default_method == "draft" and info.default_max_tokens == 32
    # no limit configured: the context; a limit above the context: the context
    for limit in (None, 10 * MAX_SEQ_LEN):
        info = asyncio.run(make_async(max_tokens_limit=limit).info())
        assert info.max_tokens_limit == MAX_SEQ_LEN and info.default_max_tokens is None


def test_spans_continue_the_callers_trace(make_async) -> None:
    exporter = InMemorySpanExporter()
    provider = setup_tracing(TelemetrySettings(), exporter=exporter, set_global=False)
    tracer = get_tracer(provider)
    engine = make_async(tracer=tracer)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with tracer.start_as_current_span("chat tiny") as root:
        carrier = inject_context()
    chunks = asyncio.run(collect(engine, request("traced", "The dog", params, trace_context=carrier)))
    assert chunks[-1].finished
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"chat tiny", "queue", "prefill", "decode"} <= set(spans)
    root_id = root.get_span_context().span_id
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent is not None and spans[name].parent.span_id == root_id
        assert spans[name].context.trace_id == root.get_span_context().trace_id
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert queue.end_time == prefill.start_time <= prefill.end_time == decode.start_time <= decode.end_time
    attrs = decode.attributes
    assert attrs["specserve.drafted"] == chunks[-1].speculation["drafted"] > 0
    assert attrs["specserve.proposer"] == "draft"
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["specserve.emitted_tokens"] == 40 - 1  # the first token is the prefill span's
    assert decode.events and decode.events[0].name == "specserve.speculation"
    assert trace.get_current_span() is trace.INVALID_SPAN

    # An aborted request ends its spans too, and marks the error of a refused one.
    exporter.clear()
    bad = asyncio.run(collect(engine, request("bad", "x " * 500, trace_context=carrier)))
    assert bad[0].error is not None
    (queue,) = [s for s in exporter.get_finished_spans() if s.name == "queue"]
    assert queue.status.status_code == trace.StatusCode.ERROR
    provider.shutdown()


def test_a_build_function_runs_on_the_loop_thread_and_its_error_is_raised(target_hf, tiny_tokenizer) -> None:
    """All of a replica's torch work on one thread (one OpenMP pool): the engine is built there."""
    built_on: list[str] = []

    def build() -> SpecEngine:
        built_on.append(threading.current_thread().name)
        return make_engine(target_hf, tiny_tokenizer)

    engine = AsyncEngine(build, model_name="tiny", max_tokens_limit=64)
    try:
        chunks = asyncio.run(collect(engine, request("built-here", PROMPTS[0])))
        assert chunks[-1].finished and chunks[-1].error is None
        assert built_on == [engine._thread.name]
    finally:
        engine.shutdown()

    def broken() -> SpecEngine:
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="nowhere"):
        AsyncEngine(broken, model_name="tiny")
