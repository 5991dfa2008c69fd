"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.tokenizer import openai_api as api
from radixserve.tokenizer.gateway import ApiError, Choice, Gateway
from radixserve.tokenizer.gateway import internal_error as _internal
from radixserve.tokenizer.tracing import RequestTrace

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 8 * 2**20  # 413 above this, before parsing
MAX_JSON_DEPTH = 32  # the schemas nest 5 deep; far deeper is an attack on the parser


RETRY_AFTER_S = 1  # a 503 is retryable: another scheduler, or the same one restarted, can serve it


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(gw: Gateway) -> FastAPI:
    kwargs: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        # Newer FastAPI makes its own server span from the global tracer provider; the request
        # span here (RequestTrace) is the one the rest of the trace hangs off, so only one may exist.
        kwargs["telemetry"] = {"tracing": False}
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, **kwargs)
    metrics = gw.metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = api.validation_message(list(exc.errors()))
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(ApiError(400, msg, param=param))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse, 404, 405): OpenAI's error body too
        metrics.requests.labels(request.url.path, str(exc.status_code)).inc()
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(ApiError(exc.status_code, str(exc.detail), type_))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: still OpenAI's error body, logged with an id the client also gets.
        metrics.requests.labels(request.url.path, "500").inc()
        return _error(_internal(metrics, exc))

    app.add_middleware(BodyLimits, max_bytes=MAX_BODY_BYTES, max_depth=MAX_JSON_DEPTH)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = {h.address: h.healthy for h in gw.pool.handles}
        ok = any(up.values())
        return JSONResponse({"status": "ok" if ok else "no scheduler", "schedulers": up}, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.schedulers_up.set(sum(h.healthy for h in gw.pool.handles))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": gw.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radixserve",
            "max_model_len": gw.max_context(),
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        _check_model(gw, body.model)
        _check_supported(body)
        t0 = time.monotonic()
        prompts = _prompts(gw, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _serve(
            gw, request, body, prompts, max_tokens, chat=False, tokenized=(t0, time.monotonic())
        )

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatCompletionRequest, request: Request) -> Response:
        _check_model(gw, body.model)
        _check_supported(body)
        t0 = time.monotonic()
        ids = gw.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        t1 = time.monotonic()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: up to the context length
            ctx = gw.max_context()
            max_tokens = max(1, ctx - len(ids)) if ctx else COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _serve(gw, request, body, [ids], max_tokens, chat=True, tokenized=(t0, t1))

    return app


class BodyLimits:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 before anything parses it, and
    JSON nested deeper than ``max_depth`` a 400 (Python's parser would recurse out of its stack)."""

    def __init__(self, app: Any, max_bytes: int, max_depth: int) -> None:
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, 413, f"the request body is over {self.max_bytes} bytes", "body")
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, 413, f"the request body is over {self.max_bytes} bytes", "body")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if _json_depth(body) > self.max_depth:
            await self._refuse(
                send, 400, f"the JSON body is nested deeper than {self.max_depth} levels", "body"
            )
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send: Any, status: int, message: str, param: str) -> None:
        body = json.dumps(ApiError(status, message, param=param).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _json_depth(body: bytes) -> int:
    """How deep ``[`` / ``{`` nest in ``body``, outside strings (no parsing: linear in the bytes)."""
    depth = deepest = 0
    in_string = escaped = False
    for b in body:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:  # quote
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.model_name:
        raise ApiError(
            404,
            f"model {model!r} is not served here (this server serves {gw.model_name!r})",
            param="model",
            code="model_not_found",
        )


def _check_supported(body: api._Sampling) -> None:
    refused = body.unsupported()
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")


def _prompts(gw: Gateway, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [gw.encode(prompt)]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [gw.encode(p) for p in prompt]
    return [list(p) for p in prompt]


class _Progress:
    """One client request's results as they arrive: latency metrics, finish reasons, its trace."""

    def __init__(self, gw: Gateway, trace: RequestTrace) -> None:
        self.metrics = gw.metrics
        self.trace = trace
        self.last: dict[int, Any] = {}  # choice index -> its latest result
        self._seen_at: dict[int, float] = {}
        self.reasons: list[str] = []

    def results(self, got: list[tuple[int, Any]]) -> None:
        now = time.monotonic()
        if self.trace.first_result is None:
            self.metrics.ttft.observe(now - self.trace.start)
        self.trace.result()
        for i, t in got:
            prev = self._seen_at.get(i)
            if prev is not None and t.token_ids:
                self.metrics.itl.observe((now - prev) / len(t.token_ids))
            self._seen_at[i] = now
            self.last[i] = t
            if t.finish_reason:
                self.metrics.finished.labels(t.finish_reason).inc()
                self.reasons.append(t.finish_reason)
                if t.finish_reason == "abort":
                    raise ApiError(503, t.error or "the request was aborted", "server_error")

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        prompt = cached = 0
        seen: set[int] = set()
        for c in choices:  # a prompt's tokens count once, however many choices it has
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                t = self.last.get(c.index)
                prompt += c.prompt_tokens
                cached += t.cached_tokens if t is not None else 0
        completion = sum(t.completion_tokens for t in self.last.values())
        return api.usage(prompt, completion, cached)

    def done(self, use: dict[str, Any] | None, error: str | None = None) -> None:
        m = self.metrics
        if use is not None:
            m.e2e.observe(time.monotonic() - self.trace.start)
            m.prompt_tokens.inc(use["prompt_tokens"])
            m.cached_tokens.inc(use["prompt_tokens_details"]["cached_tokens"])
            m.generation_tokens.inc(use["completion_tokens"])
        self.trace.end(use, self.reasons, error)


async def _serve(
    gw: Gateway,
    request: Request,
    body: api._Sampling,
    prompts: list[list[int]],
    max_tokens: int,
    chat: bool,
    tokenized: tuple[float, float],
) -> Response:
    metrics = gw.metrics
    if max_tokens < 1:
        field = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None) is not None
            else "max_tokens"
        )
        raise ApiError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
    sp = body.sampling_params(max_tokens)
    trace = RequestTrace(
        f"POST {request.url.path}",
        request.headers,
        {
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.model": body.model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.choice.count": body.n,
            "radixserve.stream": body.stream,
        },
        start=tokenized[0],
    )
    trace.child("tokenize", *tokenized, {"radixserve.prompts": len(prompts)})
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()  # every choice of every prompt reports here
    choices: list[Choice] = []  # indexed prompt-major (OpenAI's order for n x prompts)
    try:
        for p, ids in enumerate(prompts):
            choices += await gw.submit(
                ids, sp, body.n, body.skip_special_tokens, trace=trace, queue=queue, prompt_index=p
            )
    except ApiError as e:
        gw.release(choices, "a sibling prompt was rejected")
        trace.end(None, [], e.message)
        raise
    rid = uuid.uuid4().hex[:24]
    progress = _Progress(gw, trace)
    metrics.in_flight.inc()
    if body.stream:
        gen = _stream(gw, progress, body, choices, rid, chat, request.url.path)
        return StreamingResponse(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        collect = asyncio.create_task(_collect(gw, progress, choices))
        gone = asyncio.create_task(_disconnected(request))
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:  # the client went away: free the scheduler's slots now
            collect.cancel()
            metrics.requests.labels(request.url.path, "499").inc()
            progress.done(None, "client disconnected")
            return Response(status_code=499)
        gone.cancel()
        try:
            texts, use = collect.result()
        except ApiError as e:
            progress.done(None, e.message)
            raise
    finally:
        gw.release(choices, "client disconnected")
        metrics.in_flight.dec()
    progress.done(use)
    metrics.requests.labels(request.url.path, "200").inc()
    build = api.chat_body if chat else api.completion_body
    return JSONResponse(build(rid, gw.model_name, texts, use))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    gw: Gateway, progress: _Progress, choices: list[Choice]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    parts: list[list[str]] = [[] for _ in choices]
    reasons: list[str | None] = [None] * len(choices)
    async for got in gw.events(choices):
        progress.results(got)
        for i, t in got:
            parts[i].append(t.text)
            reasons[i] = t.finish_reason or None
    texts = [{"index": i, "text": "".join(p), "finish_reason": reasons[i]} for i, p in enumerate(parts)]
    return texts, progress.usage(choices)


async def _stream(
    gw: Gateway,
    progress: _Progress,
    body: api._Sampling,
    choices: list[Choice],
    rid: str,
    chat: bool,
    path: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    model = gw.model_name
    status, use, error = "200", None, None
    try:
        if chat:
            yield "".join(
                _sse(api.chat_chunk(rid, model, created, c.index, {"role": "assistant", "content": ""}, None))
                for c in choices
            )
        async for got in gw.events(choices):
            progress.results(got)
            out = []
            for i, t in got:
                reason = t.finish_reason or None
                if not t.text and reason is None:
                    continue
                if chat:
                    delta = {"content": t.text} if t.text else {}
                    chunk = api.chat_chunk(rid, model, created, i, delta, reason)
                else:
                    chunk = api.completion_chunk(rid, model, created, i, t.text, reason)
                if body.include_usage:
                    chunk["usage"] = None
                out.append(_sse(chunk))
            if out:
                yield "".join(out)
        use = progress.usage(choices)
        if body.include_usage:
            yield _sse(
                {
                    "id": ("chatcmpl-" if chat else "cmpl-") + rid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": use,
                }
            )
        yield "data: [DONE]\n\n"
    except ApiError as e:  # mid-stream: the status line is sent already; the error goes in the stream
        status, error = str(e.status), e.message
        yield _sse(e.body())
    except Exception as e:  # a bug: the client still gets an error event, not a cut connection
        err = _internal(gw.metrics, e)
        status, error = "500", err.message
        yield _sse(err.body())
    finally:  # also on disconnect (the generator is cancelled / closed)
        if use is None and error is None:
            status, error = "499", "client disconnected"
        gw.release(choices, "client disconnected")
        gw.metrics.in_flight.dec()
        gw.metrics.requests.labels(path, status).inc()
        progress.done(use, error)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
