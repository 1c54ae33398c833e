"""AsyncEngine: a SpecEngine behind an asyncio interface, in one process (no Ray here).

The engine is single-threaded torch code; an asyncio server must never run it on its event loop.
``AsyncEngine`` owns one dedicated **loop thread** that is the only code touching the engine:

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

Telemetry: each request's spans hang under the trace context the ingress sent along
(``GenerateRequest.trace_context``): ``queue`` (arrival until the first output, i.e. admission and
prefill) and the decode span of a ``DecodeSpanRecorder`` fed with each step's speculation outcome.
Metrics (``EngineMetrics``) are recorded by the loop thread: one ``on_step`` per engine step,
``on_request_finished`` (TTFT, time per output token) and ``set_load``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import queue as queue_mod
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_app.engine.request import RequestOutput
from serve_app.engine.scheduler import QueueFullError
from serve_app.generation import EngineInfo, GenerateChunk, GenerateError, GenerateRequest
from serve_app.stats import EngineStatsSink, SharedStats

if TYPE_CHECKING:
    from serve_app.config import Settings
    from serve_app.engine.engine import SpecEngine
    from serve_app.metrics import EngineMetrics

log = logging.getLogger(__name__)

STUCK_AFTER_S = 120.0  # one loop iteration running longer than this means the loop is stuck
MAX_CONSECUTIVE_FAILURES = 3  # failing steps in a row after which the engine reports unhealthy


def overloaded_error(message: str) -> GenerateError:
    return GenerateError(message=message, type="overloaded_error", code="overloaded", status=503)


def _unavailable(message: str) -> GenerateError:
    return GenerateError(message=message, type="server_error", code="engine_unavailable", status=503)


@dataclass(frozen=True)
class _Output:
    """A RequestOutput and the loop thread's clock when the step that made it ended."""

    output: RequestOutput
    time: float  # time.perf_counter()
    first: bool  # the request's first output (its prefill)


@dataclass(eq=False)
class _Stream:
    """One request as both sides see it: the consumer's loop and queue, and timing."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    first_output: float | None = None  # loop thread: when the first output was made
    cancelled: bool = False  # consumer: gone; the loop thread skips or aborts it

    def deliver(self, item: _Output | GenerateError) -> None:
        """Hand an item to the consumer's event loop (any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            self.cancelled = True


def _wall_ns(perf_time: float) -> int:
    """A ``time.perf_counter()`` reading as wall-clock nanoseconds (what spans are stamped with)."""
    return time.time_ns() - int((time.perf_counter() - perf_time) * 1e9)


class _RequestTrace:
    """The spans of one request in this replica (no-ops unless a tracer provider exports them).

    ``queue`` runs from arrival to the first output (waiting for a slot, then the prefill); the
    ``decode`` span (a ``DecodeSpanRecorder``) from there to the end, with the speculation
    outcome of every step aggregated into span events.
    """

    def __init__(self, tracer: Any, carrier: dict[str, str], request_id: str) -> None:
        from serve_app import telemetry

        self._tracer = tracer
        self._parent = telemetry.extract_context(carrier or {})
        self._queue_span = tracer.start_span(
            "queue", context=self._parent, attributes={"gen_ai.response.id": request_id}
        )
        self._recorder: Any = None
        self._done = False

    def on_output(self, item: _Output) -> None:
        from serve_app import telemetry

        output = item.output
        if item.first:
            at = _wall_ns(item.time)
            self._queue_span.set_attribute("gen_ai.usage.input_tokens", output.prompt_tokens)
            self._queue_span.end(end_time=at)
            self._recorder = telemetry.DecodeSpanRecorder(self._tracer, self._parent, start_time=at)
        elif self._recorder is not None:
            drafted = output.step_drafted
            self._recorder.on_step(
                output.step_proposer, drafted, drafted, output.step_accepted, len(output.new_token_ids)
            )
        if output.finished:
            stats = output.spec_stats.as_dict() if output.spec_stats is not None else None
            self._finish(stats, output.finish_reason, None, _wall_ns(item.time))

    def close(self, reason: str, error: GenerateError | None = None) -> None:
        """The request ended without a final output: an error, an abort or a time-out."""
        exc = RuntimeError(f"{error.status} {error.type}: {error.message}") if error is not None else None
        self._finish(None, reason, exc, None)

    def _finish(
        self, stats: dict[str, Any] | None, reason: str | None, error: Exception | None, end_ns: int | None
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        if self._done:
            return
        self._done = True
        if self._recorder is None:  # never got an output: the queue span is all there is
            if reason is not None:
                self._queue_span.set_attribute("gen_ai.response.finish_reasons", (reason,))
            if error is not None:
                self._queue_span.record_exception(error)
                self._queue_span.set_status(Status(StatusCode.ERROR, str(error)))
            self._queue_span.end(end_time=end_ns)
        else:
            self._recorder.finish(stats, reason, error=error, end_time=end_ns)


COSTED_POLICIES = ("goodput", "bandit")  # policies that read the cost model


def load_or_profile_cost_model(engine: Any, stats: SharedStats, model: str, threads: int) -> None:
    """Take the cluster's cost model for this hardware and model pair, or profile one and share it."""
    from policies import FittedCostModel
    from serve_app.engine.proposers import ModelDrafter

    hardware = f"{platform.machine()}-{_cpu_name()}-{threads}t-{engine.model.dtype}"
    cached = stats.get_cost_model(hardware, model)
    # A cached model that lacks one of this engine's model-based proposers (e.g. shared by a replica
    # of the same pair without self-speculation) would price its draft steps at 0: profile instead.
    drafters = {n for n, p in engine.proposers.items() if isinstance(p, ModelDrafter)}
    if cached and drafters <= set(cached.get("draft", {})):
        engine.use_cost_model(FittedCostModel.from_dict(cached))
        return
    started = time.perf_counter()
    cost = engine.profile_cost_model()
    log.info("profiled the cost model in %.1f s", time.perf_counter() - started)
    stats.put_cost_model(hardware, model, cost.to_dict())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip().replace(" ", "_")
    except OSError:
        pass
    return platform.processor() or "cpu"


class AsyncEngine:
    """The engine as an ``EngineClient``: async streaming over a dedicated loop thread."""

    def __init__(
        self,
        engine: SpecEngine,
        *,
        model_name: str,
        max_tokens_limit: int = 2048,
        request_timeout_s: float = 600.0,
        metrics: EngineMetrics | None = None,
        tracer: Any = None,
        stuck_after_s: float = STUCK_AFTER_S,
        threads: int | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.stuck_after_s = stuck_after_s
        if tracer is None:
            from serve_app import telemetry

            tracer = telemetry.get_tracer()
        self.tracer = tracer
        self._threads = threads
        self._commands: queue_mod.SimpleQueue[tuple[str, Any]] = queue_mod.SimpleQueue()
        self._wake = threading.Condition()
        self._stopping = False
        self.on_shutdown: list[Callable[[], None]] = []  # closed after the loop stops (stats, ...)
        self._streams: dict[str, _Stream] = {}  # loop thread only
        # Published by the loop thread, read by anyone.
        self._busy_since: float | None = None  # monotonic start of the running loop iteration
        self._consecutive_failures = 0
        self.steps = 0
        self.step_failures = 0
        self.aborts = 0  # requests aborted before they finished (consumer gone, time-out)
        self._load = (0, 0)  # (running, waiting)
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_settings(
        cls, settings: Settings, metrics_backend: str = "ray", tracer: Any = None
    ) -> AsyncEngine:
        """Resolve the models through the store (fetching packs on first use) and start the loop.

        torch threads: ``settings.runtime.threads``, else the CPUs a replica reserves
        (``autoscaling.replica_num_cpus``, at least 1).
        """
        import torch

        from serve_app.cli import _store, engine_config
        from serve_app.engine.engine import SpecEngine
        from serve_app.metrics import EngineMetrics

        threads = settings.runtime.threads or max(1, int(settings.autoscaling.replica_num_cpus))
        torch.set_num_threads(threads)
        path = _store(settings).resolve(settings.model.target)
        config = engine_config(settings)
        stats = SharedStats(settings.stats, replica_id=f"{socket.gethostname()}-{os.getpid()}")
        stats.start()
        pair = f"{settings.model.target}|{settings.model.draft if config.spec_method == 'draft' else '-'}"
        engine = SpecEngine.from_path(
            path, config, settings.runtime.dtype, settings.runtime.device, EngineStatsSink(stats), pair
        )
        if settings.speculation.profile_cost_model and settings.speculation.policy in COSTED_POLICIES:
            load_or_profile_cost_model(engine, stats, pair, threads)
        name = served_model_name(settings)
        instance = cls(
            engine,
            model_name=name,
            max_tokens_limit=settings.server.max_tokens_limit,
            request_timeout_s=settings.server.request_timeout_s,
            metrics=EngineMetrics(name, backend=metrics_backend),
            tracer=tracer,
            threads=threads,
        )
        instance.on_shutdown.append(stats.close)
        return instance

    # ------------------------------------------------------------------------------ EngineClient
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream a request's chunks; the last has ``finished`` (and ``error`` if it failed)."""
        loop = asyncio.get_running_loop()
        stream = _Stream(request, loop, asyncio.Queue())
        if self._stopping or not self._thread.is_alive():
            yield GenerateChunk(request.request_id, finished=True, error=self._not_running_error())
            return
        trace = _RequestTrace(self.tracer, request.trace_context, request.request_id)
        self._submit("add", stream)
        if not self._thread.is_alive():  # it ended between the check above and the submit
            self._fail_all(self._not_running_error())
        finished = False
        deadline = loop.time() + self.request_timeout_s
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    finished = True  # the abort goes out now, not from `finally`
                    stream.cancelled = True
                    self._submit("abort", request.request_id)
                    message = f"the request did not finish within {self.request_timeout_s:g} s"
                    error = GenerateError(message=message, type="timeout_error", code="timeout", status=504)
                    trace.close("timeout", error)
                    yield GenerateChunk(request.request_id, finished=True, error=error)
                    return
                items = [item]
                while not stream.queue.empty():  # coalesce what piled up while the consumer was busy
                    items.append(stream.queue.get_nowait())
                for chunk in self._chunks(request.request_id, items, trace):
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
            max_tokens_limit=self.max_tokens_limit,
            proposers=sorted(self.engine.proposers),
            default_method=config.spec_method,
        )

    async def health(self) -> bool:
        return self.is_healthy()

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
        """Load and liveness, as last published by the loop thread (a debug / test view)."""
        running, waiting = self._load
        return {
            "running": running,
            "waiting": waiting,
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
        return _unavailable(f"the engine loop is not running ({reason}); retry on another replica")

    def _chunks(
        self, request_id: str, items: list[_Output | GenerateError], trace: _RequestTrace
    ) -> list[GenerateChunk]:
        """Turn queued items into chunks: outputs merge into one; an error ends the stream."""
        chunks: list[GenerateChunk] = []
        text: list[str] = []
        ids: list[int] = []
        last: RequestOutput | None = None
        for item in items:
            if isinstance(item, GenerateError):
                if last is not None:
                    chunks.append(self._chunk(request_id, text, ids, last))
                trace.close("error", item)
                chunks.append(GenerateChunk(request_id, finished=True, error=item))
                return chunks
            trace.on_output(item)
            last = item.output
            text.append(last.new_text)
            ids.extend(last.new_token_ids)
            if last.finished:
                break
        if last is not None:
            chunks.append(self._chunk(request_id, text, ids, last))
        return chunks

    @staticmethod
    def _chunk(request_id: str, text: list[str], ids: list[int], last: RequestOutput) -> GenerateChunk:
        return GenerateChunk(
            request_id=request_id,
            text="".join(text),
            token_ids=list(ids),
            finished=last.finished,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            speculation=last.spec_stats.as_dict() if last.finished and last.spec_stats else None,
        )

    # ------------------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        if self._threads:
            import torch

            torch.set_num_threads(self._threads)
        try:
            while True:
                with self._wake:
                    while not self._stopping and self._commands.empty() and not self.engine.has_work():
                        self._busy_since = None
                        self._wake.wait()
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

    def _add(self, stream: _Stream) -> None:
        from jinja2 import TemplateError

        if stream.cancelled:  # the consumer left before the request reached the engine
            return
        request = stream.request
        try:
            prompt_ids = self._tokenize(request)
            self.engine.add_request(
                prompt_ids, request.sampling, request.request_id, speculation=request.speculation
            )
        except QueueFullError as exc:
            stream.deliver(overloaded_error(str(exc)))
        except (ValueError, TypeError, TemplateError) as exc:
            stream.deliver(GenerateError(message=str(exc), status=400))
        except Exception as exc:
            log.exception("could not add request %s", request.request_id)
            stream.deliver(GenerateError(message=f"internal error: {exc}", type="server_error", status=500))
        else:
            self._streams[request.request_id] = stream

    def _tokenize(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            return self.engine.encode_messages(request.messages)
        if request.prompt is None:
            raise ValueError("the request has neither a prompt nor messages")
        return self.engine.encode_prompt(request.prompt)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished, failed or never added
        self.engine.abort(request_id)
        self.aborts += 1
        self._request_finished(stream, None, "abort")

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
        outcomes = []
        prefill_tokens = 0
        deliveries: list[tuple[_Stream, _Output]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted in the meantime (the engine knows already)
            first = stream.first_output is None
            if first:
                stream.first_output = now
                prefill_tokens += len(output.new_token_ids)
            elif self.metrics is not None:
                outcomes.append(_step_outcome(output))
            if output.finished:
                del self._streams[output.request_id]
                self._request_finished(stream, output, output.finish_reason or "stop", now)
            if not stream.cancelled:  # a cancelled one's abort command is on its way
                deliveries.append((stream, _Output(output, now, first)))
        if self.metrics is not None and (outcomes or prefill_tokens):
            try:
                if outcomes:
                    self.metrics.on_step(len(outcomes), outcomes)
                self.metrics.on_prefill(prefill_tokens)
            except Exception:
                log.exception("metrics: on_step failed")
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
                self._request_finished(stream, None, "error")

    def _request_finished(
        self, stream: _Stream, output: RequestOutput | None, reason: str, now: float | None = None
    ) -> None:
        if self.metrics is None:
            return
        now = now if now is not None else time.perf_counter()
        first = stream.first_output
        completion = output.completion_tokens if output is not None else 0
        ttft = (first - stream.arrival) if first is not None else None
        tpot = (now - first) / (completion - 1) if first is not None and completion > 1 else None
        try:
            self.metrics.on_request_finished(
                ttft_s=ttft,
                tpot_s=tpot,
                prompt_tokens=output.prompt_tokens if output is not None else 0,
                completion_tokens=completion,
                finish_reason=reason,
            )
        except Exception:
            log.exception("metrics: on_request_finished failed")

    def _publish_load(self) -> None:
        scheduler = self.engine.scheduler
        self._load = (scheduler.num_running, scheduler.num_waiting)
        if self.metrics is not None:
            try:
                self.metrics.set_load(*self._load)
            except Exception:
                log.exception("metrics: set_load failed")

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


def _step_outcome(output: RequestOutput) -> Any:
    from serve_app.metrics import StepOutcome

    return StepOutcome(
        proposer=output.step_proposer,
        depth=output.step_drafted,
        drafted=output.step_drafted,
        accepted=output.step_accepted,
        emitted=len(output.new_token_ids),
    )


def served_model_name(settings: Settings) -> str:
    """What clients put in "model": the configured name, else the target (a folder: its name)."""
    if settings.server.served_model_name:
        return settings.server.served_model_name
    target = settings.model.target
    path = Path(target).expanduser()
    return path.name if path.is_dir() else target
