"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from radixserve.tokenizer import openai_api as api
from radixserve.tokenizer.gateway import ApiError, Choice, Gateway
from radixserve.tokenizer.metrics import GatewayMetrics

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(gw: Gateway, metrics: GatewayMetrics) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = api.validation_message(list(exc.errors()))
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(ApiError(400, msg, param=param))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return _error(exc)

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
        prompts = _prompts(gw, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _serve(gw, metrics, request, body, prompts, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatCompletionRequest, request: Request) -> Response:
        _check_model(gw, body.model)
        ids = gw.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: up to the context length
            ctx = gw.max_context()
            max_tokens = max(1, ctx - len(ids)) if ctx else COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _serve(gw, metrics, request, body, [ids], max_tokens, chat=True)

    return app


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.model_name:
        raise ApiError(
            404,
            f"model {model!r} is not served here (this server serves {gw.model_name!r})",
            param="model",
            code="model_not_found",
        )


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


async def _serve(
    gw: Gateway,
    metrics: GatewayMetrics,
    request: Request,
    body: api._Sampling,
    prompts: list[list[int]],
    max_tokens: int,
    chat: bool,
) -> Response:
    if max_tokens < 1:
        field = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None) is not None
            else "max_tokens"
        )
        raise ApiError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
    sp = body.sampling_params(max_tokens)
    started = time.perf_counter()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()  # every choice of every prompt reports here
    choices: list[Choice] = []  # indexed prompt-major (OpenAI's order for n x prompts)
    try:
        for p, ids in enumerate(prompts):
            choices += await gw.submit(ids, sp, body.n, body.skip_special_tokens, queue=queue, prompt_index=p)
    except ApiError:
        gw.release(choices, "a sibling prompt was rejected")
        raise
    rid = uuid.uuid4().hex[:24]
    metrics.in_flight.inc()
    if body.stream:
        gen = _stream(gw, metrics, body, choices, rid, chat, started, request.url.path)
        return StreamingResponse(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        collect = asyncio.create_task(_collect(gw, metrics, choices, started))
        gone = asyncio.create_task(_disconnected(request))
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:  # the client went away: free the scheduler's slots now
            collect.cancel()
            metrics.requests.labels(request.url.path, "499").inc()
            return Response(status_code=499)
        gone.cancel()
        texts, use = collect.result()
    finally:
        gw.release(choices, "client disconnected")
        metrics.in_flight.dec()
    metrics.requests.labels(request.url.path, "200").inc()
    build = api.chat_body if chat else api.completion_body
    return JSONResponse(build(rid, gw.model_name, texts, use))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    gw: Gateway, metrics: GatewayMetrics, choices: list[Choice], started: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    texts = [{"index": c.index, "text": [], "finish_reason": None} for c in choices]
    last: dict[int, Any] = {}
    first = True
    async for got in gw.events(choices):
        if first:
            metrics.ttft.observe(time.perf_counter() - started)
            first = False
        for i, t in got:
            texts[i]["text"].append(t.text)
            last[i] = t
            if t.finish_reason:
                if t.finish_reason == "abort":
                    raise ApiError(503, t.error or "the request was aborted", "server_error")
                texts[i]["finish_reason"] = t.finish_reason
    for t in texts:
        t["text"] = "".join(t["text"])
    use = _usage(choices, last)
    _count(metrics, use, started)
    return texts, use


def _usage(choices: list[Choice], last: dict[int, Any]) -> dict[str, Any]:
    prompt = cached = 0
    seen: set[int] = set()
    for c in choices:  # a prompt's tokens count once, however many choices it has
        if c.prompt_index not in seen:
            seen.add(c.prompt_index)
            t = last.get(c.index)
            prompt += c.prompt_tokens
            cached += t.cached_tokens if t is not None else 0
    completion = sum(t.completion_tokens for t in last.values())
    return api.usage(prompt, completion, cached)


def _count(metrics: GatewayMetrics, use: dict[str, Any], started: float) -> None:
    metrics.e2e.observe(time.perf_counter() - started)
    metrics.prompt_tokens.inc(use["prompt_tokens"])
    metrics.cached_tokens.inc(use["prompt_tokens_details"]["cached_tokens"])
    metrics.generation_tokens.inc(use["completion_tokens"])


async def _stream(
    gw: Gateway,
    metrics: GatewayMetrics,
    body: api._Sampling,
    choices: list[Choice],
    rid: str,
    chat: bool,
    started: float,
    path: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    model = gw.model_name
    last: dict[int, Any] = {}
    status = "200"
    try:
        if chat:
            yield "".join(
                _sse(api.chat_chunk(rid, model, created, c.index, {"role": "assistant", "content": ""}, None))
                for c in choices
            )
        first = True
        async for got in gw.events(choices):
            if first:
                metrics.ttft.observe(time.perf_counter() - started)
                first = False
            out = []
            for i, t in got:
                last[i] = t
                if t.finish_reason == "abort":
                    raise ApiError(503, t.error or "the request was aborted", "server_error")
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
        use = _usage(choices, last)
        _count(metrics, use, started)
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
        status = str(e.status)
        yield _sse(e.body())
    finally:  # also on disconnect (the generator is cancelled / closed)
        gw.release(choices, "client disconnected")
        metrics.in_flight.dec()
        metrics.requests.labels(path, status).inc()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
