"""AsyncEngine: a SpecEngine behind an asyncio interface, in one process (no Ray here).

The engine is single-threaded torch code; an asyncio server must never run it on its event loop.
``AsyncEngine`` owns one dedicated **loop thread** that is the only code touching the engine (and
builds it, given a function: see ``_run``):

- ``generate()`` (an async generator, any event loop) puts an *add* command on a thread-safe queue
  and waits on an ``asyncio.Queue`` of its own. The loop thread tokenizes the request (chat
  template included), calls ``add_request`` and, after every step, hands each request's
  ``RequestOutput`` to its queue with ``loop.call_soon_threadsafe``.
- Between steps the loop thread drains the command queue (adds, aborts); it steps while the engine
  has work and sleeps on a condition variable when idle (no busy wait).
- Closing the generator early (client gone: ``aclose()``, task cancelled, Serve cancelling the
  call) sends an *abort* command from its ``finally``, so the request's KV slot is free at the next
  step. ``request_timeout_s`` aborts the same way and ends the stream with a 504 error chunk.

Errors are data (``GenerateError`` in a final chunk), never exceptions through the stream:

- bad input (``ValueError`` from the engine: prompt too long, bad token ids, unknown proposer; or a
  chat template that rejects the messages): 400 ``invalid_request_error``;
- the engine's waiting queue is full (``QueueFullError``): 503 ``overloaded_error`` with code
  ``overloaded``, the status Ray Serve itself answers when its own queue is full, so a client sees
  one overload signal whichever queue refused it (OpenAI answers 503 "engine overloaded" too);
- a step that raises: every request of that step's batch gets 500 ``server_error`` (their state may
  be half-updated, so none is trusted); requests that were not in the batch, and later ones, go on.
  The loop thread survives; after ``MAX_CONSECUTIVE_FAILURES`` failing steps in a row the engine
  reports itself unhealthy so that Serve replaces the replica;
- the loop thread gone, or shut down: 503.

``health()`` is False when the loop thread died, when one loop iteration (commands + one step) has
been running longer than ``stuck_after_s``, or after repeated step failures.

Telemetry: a request's spans (``observability.request_spans``) hang under the trace context the
ingress sent along; the loop thread records the metrics (``EngineMetrics``) of every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as queue_mod
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from serve_app import tokenizing
from serve_app.engine.scheduler import QueueFullError
from serve_app.observability.metric_names import ENGINE_QUEUE_FULL
from serve_app.observability.replica_state import EngineLoad
from serve_app.observability.request_spans import RequestSpans
from serve_app.request_stream import (
    RequestStream,
    StepOutput,
    merge_chunks,
    overloaded_error,
    unavailable_error,
)
from serve_app.step_metrics import StepMetrics
from serve_app.wire import EngineInfo, GenerateChunk, GenerateError, GenerateRequest, TokenizeResult

if TYPE_CHECKING:
    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.params import SamplingParams
    from serve_app.observability.metrics import EngineMetrics

log = logging.getLogger(__name__)

STUCK_AFTER_S = 120.0  # one loop iteration running longer than this means the loop is stuck
MAX_CONSECUTIVE_FAILURES = 3  # failing steps in a row after which the engine reports unhealthy
LOOP_THREAD = "specserve-engine-loop"
GAUGE_REFRESH_S = 1.0  # an idle loop re-sets its gauges this often (Ray 2.60 evicts stale gauges)


class AsyncEngine:
    """The engine as an ``EngineClient``: async streaming over a dedicated loop thread."""

    def __init__(
        self,
        engine: SpecEngine | Callable[[], SpecEngine],  # or a function building it on the loop thread
        *,
        model_name: str,
        max_tokens_limit: int | None = None,
        default_max_tokens: int | None = None,
        request_timeout_s: float = 600.0,
        metrics: EngineMetrics | None = None,
        tracer: Any = None,
        stuck_after_s: float = STUCK_AFTER_S,
        threads: int | None = None,
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:  # tokens a chunk holds at least (server.stream_interval)
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        build = engine if callable(engine) else None
        self.engine: SpecEngine = None if build else engine  # type: ignore[assignment]
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit  # None: the context (max_seq_len)
        self.default_max_tokens = default_max_tokens
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self._recorder = StepMetrics(metrics)
        self.stuck_after_s = stuck_after_s
        if tracer is None:
            from serve_app.observability.tracing import get_tracer

            tracer = get_tracer()
        self.tracer = tracer
        self._threads = threads
        self._commands: queue_mod.SimpleQueue[tuple[str, Any]] = queue_mod.SimpleQueue()
        self._wake = threading.Condition()
        self._stopping = False
        self.on_shutdown: list[Callable[[], None]] = []  # closed after the loop stops (stats, ...)
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        # Published by the loop thread, read by anyone: the running iteration's monotonic start, counts.
        self._busy_since: float | None = None
        self.steps = self.step_failures = self._consecutive_failures = 0
        self.aborts = 0  # requests aborted before they finished (consumer gone, time-out)
        self._load = EngineLoad()  # replaced whole by the loop thread (replica_state explains why)
        self._dead: BaseException | None = None
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build,), name=LOOP_THREAD, daemon=True)
        self._thread.start()
        self._built.wait()
        if self._dead is not None:  # the build failed: say why, here
            raise self._dead

    # ------------------------------------------------------------------------------ EngineClient
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream a request's chunks; the last has ``finished`` (and ``error`` if it failed)."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request, loop, asyncio.Queue())
        if self._stopping or not self._thread.is_alive():
            yield GenerateChunk(request.request_id, finished=True, error=self._not_running_error())
            return
        trace = RequestSpans(self.tracer, request.trace_context, request.request_id)
        self._submit("add", stream)
        if not self._thread.is_alive():  # it ended between the check above and the submit
            self._fail_all(self._not_running_error())
        finished = False
        deadline = loop.time() + self.request_timeout_s
        try:
            while not finished:
                try:
                    items = await stream.receive(deadline, self.stream_interval)
                except TimeoutError:
                    finished = True  # the abort goes out now, not from `finally`
                    stream.cancelled = True
                    self._submit("abort", request.request_id)
                    message = f"the request did not finish within {self.request_timeout_s:g} s"
                    error = GenerateError(message=message, type="timeout_error", code="timeout", status=504)
                    for chunk in merge_chunks(request.request_id, stream.held, trace):  # held tokens first
                        yield chunk
                    trace.close("timeout", error)
                    yield GenerateChunk(request.request_id, finished=True, error=error)
                    return
                for chunk in merge_chunks(request.request_id, items, trace):
                    finished = chunk.finished
                    yield chunk
        finally:
            if not finished:  # the consumer left early: free the slot at the next step
                stream.cancelled = True
                self._submit("abort", request.request_id)
                trace.close("abort")

    async def info(self) -> EngineInfo:
        config = self.engine.config
        return EngineInfo(
            model=self.model_name,
            max_seq_len=config.max_seq_len,
            max_tokens_limit=min(self.max_tokens_limit or config.max_seq_len, config.max_seq_len),
            proposers=sorted(self.engine.proposers),
            default_method=config.spec_method,
            exact=self.engine.exact,
            sampling=config.sampling,
            default_max_tokens=self.default_max_tokens,
            **tokenizing.template_info(self.engine.tokenizer),
        )

    async def health(self) -> bool:
        return self.is_healthy()

    async def tokenize(self, *args: Any, **kwargs: Any) -> TokenizeResult:  # prompt, messages, tools
        return await asyncio.to_thread(tokenizing.tokenize, self.engine, *args, **kwargs)

    async def detokenize(self, token_ids: list[int]) -> TokenizeResult:
        return await asyncio.to_thread(tokenizing.detokenize, self.engine, token_ids)

    # ------------------------------------------------------------------------------ state
    def is_healthy(self) -> bool:
        """False when the loop thread died, is stuck in one iteration, or keeps failing steps."""
        if self._dead is not None or not self._thread.is_alive():
            return False
        busy_since = self._busy_since
        if busy_since is not None and time.monotonic() - busy_since > self.stuck_after_s:
            return False
        return self._consecutive_failures < MAX_CONSECUTIVE_FAILURES

    def stats(self) -> dict[str, Any]:
        """Load, KV slots and liveness, as last published by the loop thread (a debug / test view)."""
        return {
            **self._load.as_dict(),  # running, waiting, free_slots, slots, requests, proposer_free_slots
            "streams": len(self._streams),
            "steps": self.steps,
            "step_failures": self.step_failures,
            "aborts": self.aborts,
            "healthy": self.is_healthy(),
        }

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread; requests still running end with a 503 error chunk."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        while self.on_shutdown:
            self.on_shutdown.pop()()

    # ------------------------------------------------------------------------------ consumer side
    def _submit(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        with self._wake:
            self._wake.notify()

    def _not_running_error(self) -> GenerateError:
        reason = f"it failed: {self._dead!r}" if self._dead is not None else "it is shutting down"
        return unavailable_error(f"the engine loop is not running ({reason}); retry on another replica")

    # ------------------------------------------------------------------------------ loop thread
    def _run(self, build: Callable[[], SpecEngine] | None) -> None:
        # All torch work on this one thread. OpenMP keeps a worker pool per thread that starts parallel
        # regions; with two pools on two cores libgomp stops spinning and a small parallel op waits
        # ~70 us to wake its workers (a replica built elsewhere decoded at 0.67x of in-process).
        if self._threads:
            from serve_app.engine.device import set_threads

            set_threads(self._threads)
        try:
            self.engine = build() if build is not None else self.engine
            self._publish_load()  # stats() shows the free slots from the start
        except BaseException as exc:
            self._dead = exc
            return
        finally:
            self._built.set()
        if self.metrics is not None:  # what the engine turned out to be: its policy, exact or not
            self.metrics.set_policy(str(self.engine.config.policy))
            self.metrics.set_exact(self.engine.exact)
        try:
            while True:
                with self._wake:
                    while not self._stopping and self._commands.empty() and not self.engine.has_work():
                        self._busy_since = None
                        if not self._wake.wait(GAUGE_REFRESH_S) and self.metrics is not None:
                            self._publish_load()  # Ray drops a gauge that is not set again for seconds
                    if self._stopping:
                        break
                self._busy_since = time.monotonic()
                self._drain_commands()
                if self.engine.has_work():
                    self._step()
                self._publish_load()
        except BaseException as exc:  # a bug in this loop itself: fail loudly, never hang clients
            log.exception("engine loop thread died")
            self._dead = exc
        finally:
            self._busy_since = None
            self._fail_all(self._not_running_error())

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue_mod.Empty:
                return
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._abort(payload)

    def _add(self, stream: RequestStream) -> None:
        from jinja2 import TemplateError

        if stream.cancelled:  # the consumer left before the request reached the engine
            return
        request = stream.request
        try:
            prompt_ids = self._tokenize(request)
            sampling = self._fit_max_tokens(request, len(prompt_ids))
            self.engine.add_request(prompt_ids, sampling, request.request_id, speculation=request.speculation)
        except QueueFullError as exc:
            self._recorder.refused(ENGINE_QUEUE_FULL)
            stream.deliver(overloaded_error(str(exc)))
        except (ValueError, TypeError, TemplateError) as exc:
            stream.deliver(GenerateError(message=str(exc), status=400))
        except Exception as exc:
            log.exception("could not add request %s", request.request_id)
            stream.deliver(GenerateError(message=f"internal error: {exc}", type="server_error", status=500))
        else:
            self._streams[request.request_id] = stream

    def _fit_max_tokens(self, request: GenerateRequest, prompt_tokens: int) -> SamplingParams:
        """A request that named no max_tokens runs to the end of the context, within its bound."""
        if not request.fit_max_tokens:
            return request.sampling
        context = self.engine.config.max_seq_len
        room = context - prompt_tokens
        if room < 1:
            raise ValueError(
                f"the prompt ({prompt_tokens} tokens) leaves no room in the maximum sequence length of "
                f"{context} tokens"
            )
        return replace(request.sampling, max_tokens=min(request.sampling.max_tokens, room))

    def _tokenize(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            return self.engine.encode_messages(request.messages, tools=request.tools)
        if request.prompt is None:
            raise ValueError("the request has neither a prompt nor messages")
        return self.engine.encode_prompt(request.prompt)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished, failed or never added
        self.engine.abort(request_id)
        self.aborts += 1
        self._recorder.finished(stream, None, "abort", time.perf_counter())

    def _step(self) -> None:
        before = [r.request_id for r in self.engine.scheduler.running]
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc, before)
            return
        now = time.perf_counter()
        self.steps += 1
        self._consecutive_failures = 0
        # Bookkeeping and metrics first, delivery last: a consumer that has its final chunk sees
        # the metrics and the load of the step that made it.
        deliveries: list[tuple[RequestStream, StepOutput]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted in the meantime (the engine knows already)
            first = self._recorder.output(stream, output, now)
            if output.finished:
                del self._streams[output.request_id]
                self._recorder.finished(stream, output, output.finish_reason or "stop", now)
            if not stream.cancelled:  # a cancelled one's abort command is on its way
                deliveries.append((stream, StepOutput(output, now, first)))
        self._recorder.end_step()
        self._publish_load()
        for stream, item in deliveries:
            stream.deliver(item)

    def _step_failed(self, exc: Exception, before: list[str]) -> None:
        """Fail every request of the failed step's batch; the others (waiting) carry on."""
        self.step_failures += 1
        self._consecutive_failures += 1
        log.exception("engine step failed; failing the requests of its batch", exc_info=exc)
        batch = set(before) | {r.request_id for r in self.engine.scheduler.running}
        error = GenerateError(
            message=f"internal error in the engine step: {type(exc).__name__}: {exc}",
            type="server_error",
            status=500,
        )
        for request_id in batch:
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("could not abort %s after a failed step", request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.deliver(error)
                self._recorder.finished(stream, None, "error", time.perf_counter())

    def _publish_load(self) -> None:
        self._load = load = EngineLoad.of(self.engine)
        if self.metrics is not None:
            self._recorder.load(load.running, load.waiting, self.engine.cache.usage)

    def _fail_all(self, error: GenerateError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            with contextlib.suppress(Exception):  # the engine may be what broke
                self.engine.abort(request_id)
            stream.deliver(error)
        while True:  # requests that never reached the engine
            try:
                kind, payload = self._commands.get_nowait()
            except queue_mod.Empty:
                break
            if kind == "add":
                payload.deliver(error)
