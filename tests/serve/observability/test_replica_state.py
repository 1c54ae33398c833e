"""What a replica holds, read from outside (the soak's leak view), on a tiny in-process engine.

The engine's part comes from the snapshot its loop thread publishes (``EngineLoad``): free KV
slots of the target and of a draft with its own cache, requests the engine still indexes. The
process's part (``process_state``) must move when something really is held: a slot taken and not
given back, objects kept alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from serve_app.async_engine import AsyncEngine
from serve_app.engine.params import SamplingParams
from serve_app.observability.replica_state import EngineLoad, process_state
from serve_app.wire import GenerateRequest
from tests.conftest import make_tiny_engine, make_tiny_hf_model

SLOTS = 3
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tiny_engine(tokenizer):
    """A tiny engine whose draft (the target itself) keeps a KV cache of its own."""
    target = make_tiny_hf_model(len(tokenizer), seed=0)
    return make_tiny_engine(target, tokenizer, proposers=["draft"], method="draft", depth=3, slots=SLOTS)


def test_stats_show_every_slot_given_back_after_finished_and_abandoned_streams(tiny_tokenizer) -> None:
    engine = AsyncEngine(tiny_engine(tiny_tokenizer), model_name="tiny")
    try:
        start = engine.stats()  # published by the loop thread right after it built the engine
        assert (start["free_slots"], start["slots"], start["requests"]) == (SLOTS, SLOTS, 0)
        assert start["proposer_free_slots"] == {"draft": SLOTS}

        async def consume(i: int, leave_after: int | None) -> None:
            request = GenerateRequest(request_id=f"r{i}", sampling=PARAMS, prompt="The quick brown fox")
            async with contextlib.aclosing(engine.generate(request)) as chunks:
                seen = 0
                async for _ in chunks:
                    seen += 1
                    if leave_after is not None and seen >= leave_after:
                        return  # the client goes: aclose() sends the abort

        async def run() -> None:  # more requests than slots: some wait, some are abandoned
            await asyncio.gather(*(consume(i, 1 if i % 3 == 0 else None) for i in range(8)))

        asyncio.run(run())
        deadline = time.monotonic() + 10
        while engine.stats()["running"] or engine.stats()["streams"]:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.01)
        stats = engine.stats()
        assert (stats["free_slots"], stats["requests"], stats["waiting"]) == (SLOTS, 0, 0)
        assert stats["proposer_free_slots"] == {"draft": SLOTS} and stats["aborts"] >= 1
    finally:
        engine.shutdown()


def test_a_slot_taken_and_not_given_back_shows(tiny_tokenizer) -> None:
    engine = tiny_engine(tiny_tokenizer)
    assert EngineLoad.of(engine).free_slots == SLOTS
    engine.cache.allocate()  # what a request that finished without being released would hold
    engine.proposers["draft"].cache.allocate()
    load = EngineLoad.of(engine)
    assert (load.free_slots, load.slots, load.running) == (SLOTS - 1, SLOTS, 0)
    assert load.as_dict()["proposer_free_slots"] == {"draft": SLOTS - 1}


def test_process_state_counts_what_is_kept_alive() -> None:
    state = process_state()
    assert state["rss_bytes"] > 10 * 1024 * 1024 and state["peak_rss_bytes"] >= state["rss_bytes"]
    assert 1 <= state["threads"] <= state["os_threads"] and state["open_fds"] > 0
    kept = [[i] for i in range(200_000)]  # tracked containers, as a leak would keep them
    grown = process_state()
    # Other threads of the test process (a Ray session's, earlier tests') make and free objects of
    # their own between the two counts (~15,000 seen in the full suite): the kept ones dominate.
    assert grown["gc_objects"] - state["gc_objects"] >= 0.75 * len(kept)
    assert process_state(count_objects=False)["gc_objects"] is None
    del kept
