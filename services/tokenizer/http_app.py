"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

A request's lifecycle (submit, results, abort on disconnect, usage) is its RequestSession's
(session.py); this module turns OpenAI's bodies into a session and its outputs into OpenAI's
responses: one JSON body, or server-sent events ending in ``[DONE]``. With API keys configured, every
path but /health (and /metrics, unless --protect-metrics) needs one (auth.py).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.tokenizer import openai_api as api
from radixserve.tokenizer.auth import RequireApiKey
from radixserve.tokenizer.body_limits import BodyLimits
from radixserve.tokenizer.errors import ApiError, internal_error
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.session import Output, RequestSession

MAX_BODY_BYTES = 8 * 2**20  # 413 above this, before parsing
MAX_JSON_DEPTH = 32  # the schemas nest 5 deep; far deeper is an attack on the parser
RETRY_AFTER_S = 1  # a 503 is retryable: another scheduler, or the same one restarted, can serve it

Prompt = str | list[str] | list[int] | list[list[int]]  # /v1/completions' ``prompt``


def build_app(gw: Gateway) -> FastAPI:
    kwargs: dict[str, Any] = {}  # FastAPI's own options differ by version (keyword types vary)
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        # Newer FastAPI makes its own server span from the global tracer provider; the request
        # span here (RequestTrace) is the one the rest of the trace hangs off, so only one may exist.
        kwargs["telemetry"] = {"tracing": False}
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, **kwargs)
    routes = OpenAIRoutes(gw)
    app.exception_handler(RequestValidationError)(routes.invalid)
    app.exception_handler(ApiError)(routes.api_error)
    app.exception_handler(StarletteHTTPException)(routes.http_error)
    app.exception_handler(Exception)(routes.unexpected)
    app.add_middleware(BodyLimits, max_bytes=MAX_BODY_BYTES, max_depth=MAX_JSON_DEPTH)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus)
    app.get("/v1/models")(routes.models)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat)
    if gw.api_keys.enabled:  # added last, so outermost: a refusal comes before the body is read
        open_paths = ["/health"] if gw.protect_metrics else ["/health", "/metrics"]
        app.add_middleware(RequireApiKey, keys=gw.api_keys, open_paths=open_paths, refused=routes.refused)
    return app


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class OpenAIRoutes:
    """The endpoints and error handlers, over one Gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.metrics = gw.metrics
        self.paths = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}

    # -------------------------------------------------------------------------------- errors
    def refused(self, path: str) -> None:
        # A request without an accepted key (401): counted under its path if it is one of ours; the
        # paths a keyless client makes up are not a label of their own each.
        self.metrics.requests.labels(path if path in self.paths else "other", "401").inc()

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = api.validation_message(list(exc.errors()))
        self.metrics.requests.labels(request.url.path, "400").inc()
        return _error(ApiError(400, msg, param=param))

    async def api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return _error(exc)

    async def http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse, 404, 405): OpenAI's error body too
        self.metrics.requests.labels(request.url.path, str(exc.status_code)).inc()
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(ApiError(exc.status_code, str(exc.detail), type_))

    async def unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        # A bug before a request's session began (one inside it is an ApiError already): still
        # OpenAI's error body, logged with an id the client also gets.
        self.metrics.requests.labels(request.url.path, "500").inc()
        return _error(internal_error(self.metrics, exc))

    # ------------------------------------------------------------------------------ endpoints
    async def health(self) -> JSONResponse:
        up = {h.address: h.healthy for h in self.gw.pool.handles}
        ok = any(up.values())
        return JSONResponse({"status": "ok" if ok else "no scheduler", "schedulers": up}, 200 if ok else 503)

    async def prometheus(self) -> Response:
        self.metrics.schedulers_up.set(sum(h.healthy for h in self.gw.pool.handles))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> JSONResponse:
        card = {
            "id": self.gw.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radixserve",
            "max_model_len": self.gw.max_context(),
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, body: api.CompletionRequest, request: Request) -> Response:
        self._check(body)
        t0 = time.monotonic()
        prompts = _prompts(self.gw, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else api.COMPLETIONS_DEFAULT_MAX_TOKENS
        return await self._serve(
            request, body, prompts, max_tokens, chat=False, tokenized=(t0, time.monotonic())
        )

    async def chat(self, body: api.ChatCompletionRequest, request: Request) -> Response:
        self._check(body)
        t0 = time.monotonic()
        ids = self.gw.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        t1 = time.monotonic()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: up to the context length
            ctx = self.gw.max_context()
            max_tokens = max(1, ctx - len(ids)) if ctx else api.COMPLETIONS_DEFAULT_MAX_TOKENS
        return await self._serve(request, body, [ids], max_tokens, chat=True, tokenized=(t0, t1))

    def _check(self, body: api.CompletionRequest | api.ChatCompletionRequest) -> None:
        self.gw.check_model(body.model)
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")

    async def _serve(
        self,
        request: Request,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int,
        chat: bool,
        tokenized: tuple[float, float],
    ) -> Response:
        if max_tokens < 1:
            field = (
                "max_completion_tokens"
                if getattr(body, "max_completion_tokens", None) is not None
                else "max_tokens"
            )
            raise ApiError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
        sp = body.sampling_params(max_tokens)
        attributes = {
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.model": body.model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.choice.count": body.n,
            "radixserve.stream": body.stream,
        }
        path = request.url.path
        session = RequestSession(self.gw, f"POST {path}", request.headers, attributes, start=tokenized[0])
        session.trace.child("tokenize", *tokenized, {"radixserve.prompts": len(prompts)})
        await session.submit(prompts, sp, body.n, body.skip_special_tokens)  # failing, it ends the session
        if body.stream:
            return StreamingResponse(
                _stream(session, body.include_usage, chat, path),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        async with session:
            collect = asyncio.create_task(_collect(session))
            gone = asyncio.create_task(_disconnected(request))
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:  # the client went away: free the scheduler's slots now
                collect.cancel()
                self.metrics.requests.labels(path, "499").inc()
                return Response(status_code=499)
            gone.cancel()
            texts = collect.result()
        self.metrics.requests.labels(path, "200").inc()
        build = api.chat_body if chat else api.completion_body
        return JSONResponse(build(session.rid, self.gw.model_name, texts, _usage(session)))


def _prompts(gw: Gateway, prompt: Prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [gw.encode(prompt)]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [gw.encode(p) for p in prompt]
    return [list(p) for p in prompt]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(session: RequestSession) -> list[api.ChoiceText]:
    parts: list[list[str]] = [[] for _ in range(session.choice_count)]
    reasons: list[str | None] = [None] * session.choice_count
    async for outputs in session:
        for o in outputs:
            parts[o.index].append(o.text)
            reasons[o.index] = o.finish_reason
    return [api.ChoiceText(i, "".join(p), reasons[i]) for i, p in enumerate(parts)]


async def _stream(session: RequestSession, include_usage: bool, chat: bool, path: str) -> AsyncIterator[str]:
    model, rid, created = session.gw.model_name, session.rid, int(time.time())
    status = "200"
    try:
        async with session:
            if chat:
                hello: api.AssistantMessage = {"role": "assistant", "content": ""}
                yield "".join(
                    _sse(api.chat_chunk(rid, model, created, i, hello, None))
                    for i in range(session.choice_count)
                )
            async for outputs in session:
                chunks = [
                    _sse(c) for o in outputs if (c := _chunk(o, rid, model, created, chat, include_usage))
                ]
                if chunks:
                    yield "".join(chunks)
            if include_usage:
                yield _sse(api.usage_chunk(rid, model, created, chat, _usage(session)))
            yield "data: [DONE]\n\n"
    except ApiError as e:  # mid-stream: the status line is sent already; the error goes in the stream
        status = str(e.status)
        yield _sse(e.body())
    finally:  # also on disconnect (the generator is cancelled / closed)
        if status == "200" and not session.done:
            status = "499"
        session.gw.metrics.requests.labels(path, status).inc()


def _chunk(o: Output, rid: str, model: str, created: int, chat: bool, include_usage: bool) -> api.Body | None:
    """One choice's new text as a chunk; None when there is nothing to say (no text, not finished)."""
    if not o.text and o.finish_reason is None:
        return None
    if chat:
        delta: api.AssistantMessage = {"content": o.text} if o.text else {}
        chunk = api.chat_chunk(rid, model, created, o.index, delta, o.finish_reason)
    else:
        chunk = api.completion_chunk(rid, model, created, o.index, o.text, o.finish_reason)
    if include_usage:
        chunk["usage"] = None
    return chunk


def _usage(session: RequestSession) -> api.UsageBody:
    u = session.usage()
    return api.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _sse(obj: Mapping[str, object]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
