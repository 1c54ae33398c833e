"""The OpenAI-compatible HTTP app: ``create_app(client, settings, tracer)``.

Engine-agnostic: it talks only to an `EngineClient` (a Ray Serve handle in production, anything
with the same three methods in tests). Routes: ``POST /v1/completions``, ``POST
/v1/chat/completions`` (JSON or SSE), ``GET /v1/models[/{id}]``, ``GET /health`` (never behind the
API key). A request's engine stream is always closed when the request ends for any reason (done,
error, timeout, client gone), which is what aborts it in the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from serve_app.api import protocol as p
from serve_app.api.errors import APIError, ApiKeyMiddleware, install_error_handlers
from serve_app.api.fanout import Choices, FanOutStream, choices, expand
from serve_app.api.outcome import Outcome
from serve_app.api.tokenizer_routes import add_tokenizer_routes
from serve_app.api.tool_calls import tool_format
from serve_app.api.tool_prompt import prepare_tools
from serve_app.config import ServerSettings
from serve_app.observability import tracing as otel
from serve_app.wire import EngineClient, EngineInfo, GenerateChunk, GenerateError, GenerateRequest

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _aclose(iterator: Any) -> None:
    """Close an engine stream (which aborts the request there), even while being cancelled."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with anyio.CancelScope(shield=True):
            try:
                await close()
            except Exception:
                logger.exception("closing the engine stream failed")


class _Span:
    """A request's root span (GenAI semantic conventions); a no-op without a tracer."""

    def __init__(self, tracer: Any, request: Request, op: str, model: str, stream: bool) -> None:
        self.span, self.op, self.model, self.stream = None, op, model, stream
        self.t0, self.ttft = time.perf_counter(), None  # ttft: seconds to the first token, once seen
        if tracer is not None:
            parent = propagate.extract(dict(request.headers))  # continues a client's trace, if sent
            attrs = {"gen_ai.operation.name": op, "gen_ai.request.model": model}
            attrs["gen_ai.provider.name"] = otel.GEN_AI_PROVIDER
            name = otel.gen_ai_span_name(op, model)
            self.span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs)

    def start(self, greq: GenerateRequest, info: EngineInfo) -> GenerateRequest:
        """Record the request's parameters; returns ``greq`` carrying this span's W3C context."""
        if self.span is None:
            return greq
        s = greq.sampling
        attrs = otel.gen_ai_request_attributes(
            self.op, self.model, s.max_tokens, s.temperature, s.top_p,
            top_k=s.top_k, seed=s.seed, stop_sequences=s.stop, stream=self.stream,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        )  # fmt: skip
        self.span.set_attributes({**attrs, "gen_ai.response.id": greq.request_id})
        self.span.set_attribute("gen_ai.response.model", info.model)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return dataclasses.replace(greq, trace_context=carrier)

    def saw(self, chunk: GenerateChunk) -> None:
        """Note the time to the first token when ``chunk`` is the first to carry one."""
        if self.ttft is None and chunk.token_ids:
            self.ttft = time.perf_counter() - self.t0

    def end(self, outcome: Outcome | Choices | None = None, error: BaseException | None = None) -> None:
        span, self.span = self.span, None
        if span is None:
            return
        attrs: dict[str, Any] = {otel.TIME_TO_FIRST_TOKEN: self.ttft}
        if self.stream:  # the conventions' attribute is defined for streamed responses only
            attrs[otel.TIME_TO_FIRST_CHUNK] = self.ttft
        if outcome is not None:
            attrs["gen_ai.usage.input_tokens"] = outcome.prompt_tokens
            attrs["gen_ai.usage.output_tokens"] = outcome.completion_tokens
            if outcome.finish_reason:
                attrs["gen_ai.response.finish_reasons"] = [outcome.finish_reason]
            spec = outcome.speculation.model_dump() if outcome.speculation else {}
            for key in ("proposer", "drafted", "accepted", "acceptance_rate", "mean_accepted_length"):
                attrs[f"specserve.{key}"] = spec.get(key)
        if error is not None:
            attrs["error.type"] = error.type if isinstance(error, APIError) else type(error).__name__
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.set_attributes({k: v for k, v in attrs.items() if v is not None})
        span.end()


class _EngineStream(StreamingResponse):
    """An SSE response that runs ``cleanup`` however it ends (even if the body never started)."""

    def __init__(self, body: AsyncGenerator[str, None], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._body, self._cleanup = body, cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # ASGI >= 2.4 servers report a vanished client this way
            logger.debug("client disconnected from a stream")
        finally:
            with anyio.CancelScope(shield=True):
                await self._body.aclose()
                await self._cleanup()


def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def _watch_disconnect(request: Request, scope: anyio.CancelScope, gone: list[bool]) -> None:
    """Cancel ``scope`` when the client disconnects (ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        await anyio.sleep(0.05)  # no other message is expected; never spin on one
    gone.append(True)
    scope.cancel()


async def _guarded(request: Request, timeout: float, work: Callable[[], Awaitable[None]]) -> Exception | None:
    """Run ``work`` until it ends, fails (returned), times out (`TimeoutError`) or the client leaves
    (`ClientDisconnect`): the time before a response starts, when nothing else would notice."""
    gone: list[bool] = []
    error: Exception | None = None
    try:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:  # errors are kept out of it: no ExceptionGroup
                tg.start_soon(_watch_disconnect, request, tg.cancel_scope, gone)
                try:
                    await work()
                except Exception as e:
                    error = e
                tg.cancel_scope.cancel()
    except TimeoutError as e:
        error = e
    return ClientDisconnect() if gone else error


class _Ingress:
    def __init__(self, client: EngineClient, settings: ServerSettings, tracer: Any) -> None:
        self.client, self.settings, self.tracer = client, settings, tracer
        self.timeout = settings.request_timeout_s
        self.started = int(time.time())
        self._info: EngineInfo | None = None
        self._ignored_fields: set[str] = set()  # unknown request fields already logged once
        self.tool_format = tool_format(settings.tool_call_parser)

    async def info(self) -> EngineInfo:
        """The engine's model and limits, asked once (they don't change while it runs)."""
        if self._info is None:
            try:
                self._info = await self.client.info()
            except Exception as e:
                logger.warning("engine info unavailable: %r", e)
                message = "The engine is not ready; retry shortly."
                raise APIError(503, message, code="engine_unavailable") from None
        return self._info

    @property
    def has_info(self) -> bool:
        return self._info is not None

    def card(self, info: EngineInfo) -> p.ModelCard:
        """The served model as ``/v1/models`` lists it."""
        return p.ModelCard(
            id=info.model, created=self.started, max_model_len=info.max_seq_len, exact=info.exact
        )

    def check_model(self, info: EngineInfo, name: str) -> None:
        if name not in {info.model, self.settings.served_model_name}:
            message = f"The model `{name}` does not exist or you do not have access to it."
            raise APIError(404, message, param="model", code="model_not_found")

    def check_unknown_fields(self, body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        """Unknown top-level fields: a 400 under ``strict_requests``, else ignored, each name logged once."""
        names = sorted(body.model_extra or {})
        if names and self.settings.strict_requests:
            raise APIError(400, f"Unrecognized request argument supplied: {names[0]}", param=names[0])
        for name in names:
            if name not in self._ignored_fields:
                self._ignored_fields.add(name)
                logger.warning(
                    "ignoring unknown request field %r (server.strict_requests refuses them)", name
                )

    def _http_error(self, error: Exception | None) -> Exception | None:
        if isinstance(error, TimeoutError):
            return APIError(504, f"The request timed out after {self.timeout:g} s.", code="timeout")
        if isinstance(error, ClientDisconnect):
            return APIError(499, "Client closed the request.")
        return error

    async def handle(self, body: p.CompletionRequest | p.ChatCompletionRequest, request: Request) -> Response:
        chat = isinstance(body, p.ChatCompletionRequest)
        op = "chat" if chat else "text_completion"
        span = _Span(self.tracer, request, op, body.model, bool(body.stream))
        try:
            info = await self.info()
            self.check_model(info, body.model)
            self.check_unknown_fields(body)
            rid = p.new_request_id(chat)
            limit = min(info.max_tokens_limit, self.settings.max_tokens_limit or info.max_tokens_limit)
            greq = span.start(p.to_generate_request(body, info, request_id=rid, max_tokens_limit=limit), info)
            greq, tool_calls = prepare_tools(body, greq, info, self.tool_format)
            # one engine request per choice (n per prompt, api.fanout), each with its own Outcome
            out = await choices(self.client, body, expand(greq, body), lambda e: Outcome(chat, e, tool_calls))
            if body.stream:
                return await self._stream(greq, body, span, request, out)
            return await self._complete(greq, body, span, request, out)
        except BaseException as e:
            span.end(error=e)
            raise

    async def _complete(
        self, greq: GenerateRequest, body: Any, span: _Span, request: Request, out: Choices
    ) -> Response:
        stream = FanOutStream(self.client, out.requests)

        async def collect() -> None:
            async for chunk in stream:
                if chunk.error is not None:
                    raise APIError.from_generate_error(chunk.error)
                span.saw(chunk)
                out.add(chunk)
                if out.finished:  # every choice
                    return
            raise APIError(500, _ENDED)

        try:
            error = self._http_error(await _guarded(request, self.timeout, collect))
        finally:
            await _aclose(stream)
        span.end(out, error)
        if error is not None:
            raise error
        base = {"id": greq.request_id, "created": int(time.time()), "model": body.model, "usage": out.usage()}
        kind = p.ChatCompletion if isinstance(body, p.ChatCompletionRequest) else p.Completion
        result = kind(choices=out.choices(), speculation=out.speculation, **base)
        return JSONResponse(result.model_dump(mode="json"), headers={"X-Request-Id": greq.request_id})

    async def _stream(
        self, greq: GenerateRequest, body: Any, span: _Span, request: Request, out: Choices
    ) -> Response:
        stream, deadline = FanOutStream(self.client, out.requests), anyio.current_time() + self.timeout
        got: list[GenerateChunk] = []

        async def first_chunk() -> None:
            got.append(await stream.first() or _ENDED_EARLY)  # every choice's first (or a refusal)
            span.saw(got[0])

        try:
            error = self._http_error(await _guarded(request, self.timeout, first_chunk))
            if error is None and got[0].error is not None:  # refused before any output: plain error
                error = APIError.from_generate_error(got[0].error)
            if error is not None:
                raise error
        except BaseException:
            await _aclose(stream)
            raise
        first, chat = got[0], isinstance(body, p.ChatCompletionRequest)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {"id": greq.request_id, "created": int(time.time()), "model": body.model}

        def event(
            text: str | None,
            reason: str | None = None,
            first: bool = False,
            logprobs: Any = None,
            tool_calls: Any = None,
            index: int = 0,
            **extra: Any,
        ) -> str:
            choice: BaseModel
            if chat:
                delta = p.ChatDelta(role="assistant" if first else None, content=text, tool_calls=tool_calls)
                choice = p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
            else:
                text = text or ""
                choice = p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)
            kind = p.ChatCompletionChunk if chat else p.Completion
            return _sse(kind(choices=[] if extra.get("usage") else [choice], **base, **extra))

        async def events() -> AsyncGenerator[str, None]:
            chunk, error = first, None
            try:
                for index in range(len(out.outcomes) if chat else 0):
                    yield event("", first=True, index=index)
                while chunk.error is None:
                    span.saw(chunk)  # a no-op after the first chunk, which carries the first token
                    index, one = out.add(chunk)  # its choice
                    # the echoed prompt leads the first; tokens whose text is held back still show
                    for text, logprobs, calls in one.stream_events(chunk):
                        yield event(text, logprobs=logprobs, tool_calls=calls, index=index)
                    if chunk.finished:
                        yield event(None, one.finish_reason, index=index, speculation=one.speculation)
                    if out.finished:
                        if usage:
                            yield event(None, usage=out.usage(), speculation=out.speculation)
                        break
                    with anyio.fail_after(max(deadline - anyio.current_time(), 0)):
                        chunk = await anext(aiter(stream), None) or _ENDED_EARLY
                if chunk.error is not None:
                    error = APIError.from_generate_error(chunk.error)
            except TimeoutError as e:
                error = self._http_error(e)
            except Exception as e:
                logger.exception("streaming %s failed", greq.request_id)
                error = APIError(500, "The server had an error while processing your request.")
                error.__cause__ = e
            if error is not None:
                yield _sse(error.body())
            yield "data: [DONE]\n\n"
            await cleanup(error)

        async def cleanup(error: BaseException | None = None) -> None:
            await _aclose(stream)
            span.end(out, error)

        return _EngineStream(events(), lambda: cleanup(APIError(499, "Client closed the stream.")))


# Stands for the missing final chunk of an engine stream that ended without finishing.
_ENDED = "The engine stream ended before the request finished."
_ENDED_EARLY = GenerateChunk("", error=GenerateError(_ENDED, "server_error", status=500))


def create_app(client: EngineClient, settings: ServerSettings, tracer: object | None = None) -> FastAPI:
    """The ingress app; ``tracer`` (OpenTelemetry) adds a root span per generation request."""
    # FastAPI's own HTTP spans are off: our GenAI span is the request's root span.
    app = FastAPI(title="specserve", telemetry={"tracing": False}, strict_content_type=False)
    ingress = _Ingress(client, settings, tracer)
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        try:
            with anyio.fail_after(10):
                ok = bool(await client.health())
        except Exception:
            ok = False
        body: dict[str, object] = {"status": "ok" if ok else "unavailable"}
        if ok and ingress.has_info:
            body["exact"] = (await ingress.info()).exact  # known once the engine answered info()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models", response_model=p.ModelList)
    async def list_models() -> p.ModelList:
        info = await ingress.info()
        return p.ModelList(data=[ingress.card(info)])

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard)
    async def get_model(model_id: str) -> p.ModelCard:
        info = await ingress.info()
        ingress.check_model(info, model_id)
        return ingress.card(info)

    add_tokenizer_routes(app, client, ingress)

    @app.post("/v1/completions", responses={200: {"model": p.Completion}})
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await ingress.handle(body, request)

    @app.post("/v1/chat/completions", responses={200: {"model": p.ChatCompletion}})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await ingress.handle(body, request)

    return app
