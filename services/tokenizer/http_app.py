"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

A request's lifecycle (submit, results, abort on disconnect, usage) is its RequestSession's
(session.py); this module turns OpenAI's bodies (openai_api.py: checked, mapped to SamplingParams)
into a session and its outputs into OpenAI's responses: one JSON body, or server-sent events ending in
``[DONE]``. What each choice shows (echo, logprobs, tool calls) is openai_choices.py's; the bodies
are openai_responses.py's. With API keys configured, every path but /health (and /metrics, unless
--protect-metrics) needs one (auth.py).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.common.sampling import Constraint, SamplingParams
from radixserve.tokenizer import openai_api as api
from radixserve.tokenizer import openai_responses as resp
from radixserve.tokenizer.auth import RequireApiKey
from radixserve.tokenizer.body_limits import BodyLimits
from radixserve.tokenizer.errors import ApiError, internal_error
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_choices import (
    ChatChoiceState,
    CompletionChoiceState,
    CompletionFold,
    chat_content,
    finish_reason,
)
from radixserve.tokenizer.openai_responses import Pieces, chat_logprobs, scored
from radixserve.tokenizer.session import Output, RequestSession
from radixserve.tokenizer.tokenize_api import add_routes, model_card
from radixserve.tokenizer.tool_calls import PARSERS, ToolParser
from radixserve.tokenizer.tool_grammar import tool_choice_constraint
from radixserve.tokenizer.tracing import inference_span

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
    add_routes(app, gw)  # /v1/tokenize, /v1/detokenize, /v1/models/{id}
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
        self.paths = {
            "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
            "/v1/tokenize", "/v1/detokenize",
        }  # fmt: skip

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
        return JSONResponse({"object": "list", "data": [model_card(self.gw)]})

    async def completions(self, body: api.CompletionRequest, request: Request) -> Response:
        self._check(body)
        t0 = time.monotonic()
        prompts = _prompts(self.gw, body.prompt)
        t1 = time.monotonic()
        source = body.constraint()
        sp = body.sampling_params(self.gw.text.vocab_size, source)
        await self._check_constraint(source)
        echo = [_echo(self.gw, body.prompt, i, ids) for i, ids in enumerate(prompts)] if body.echo else None
        pieces, wants = self.gw.text.pieces, body.logprobs is not None
        states = [
            CompletionChoiceState(pieces, wants, echo[i // body.n] if echo else None)
            for i in range(len(prompts) * body.n)
        ]
        out = _CompletionOutput(states, wants)
        return await self._serve(request, body, prompts, sp, out, tokenized=(t0, t1))

    async def chat(self, body: api.ChatCompletionRequest, request: Request) -> Response:
        self._check(body)
        body.check_fields()
        t0 = time.monotonic()
        tools = body.tool_dicts()  # validated here, once
        parser, tool_constraint = _tool_plan(self.gw, body, tools)
        ids = self.gw.text.encode_chat(api.template_messages(body.messages), tools)
        t1 = time.monotonic()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: up to the context length
            ctx = self.gw.max_context()
            max_tokens = max(1, ctx - len(ids)) if ctx else api.COMPLETIONS_DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            raise ApiError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
        source = body.output_constraint(tool_constraint)
        sp = body.sampling_params(max_tokens, self.gw.text.vocab_size, source)
        await self._check_constraint(source)
        out = _ChatOutput(
            self.gw.text.pieces, bool(body.logprobs), parser, body.parallel_tool_calls is False, body.n
        )
        return await self._serve(request, body, [ids], sp, out, tokenized=(t0, t1))

    def _check(self, body: api.CompletionRequest | api.ChatCompletionRequest) -> None:
        self.gw.check_model(body.model)
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")
        body.check_stream_options()

    async def _check_constraint(self, source: api.Source | None) -> None:
        """An invalid schema, regex or grammar is the client's 400 here, not a failure on a scheduler.
        A tool_choice grammar is built from the tools' parameters: those are what to fix."""
        if source is not None:
            field, constraint = source
            await self.gw.text.check_constraint(constraint, "tools" if field == "tool_choice" else field)

    async def _serve(
        self,
        request: Request,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        prompts: list[list[int]],
        sp: SamplingParams,
        out: _Output,
        tokenized: tuple[float, float],
    ) -> Response:
        chat = isinstance(out, _ChatOutput)
        path = request.url.path
        name, genai = inference_span("chat" if chat else "text_completion", body.model, self.gw.model_name)
        attributes = {
            **genai,
            "gen_ai.request.max_tokens": sp.max_new_tokens,
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.choice.count": body.n,
            "http.request.method": "POST",
            "http.route": path,
            "radixserve.stream": body.stream,
        }
        session = RequestSession(self.gw, name, request.headers, attributes, start=tokenized[0])
        session.trace.annotate({"gen_ai.response.id": resp.response_id(session.rid, chat)})
        session.trace.child("tokenize", *tokenized, {"radixserve.prompts": len(prompts)})
        await session.submit(prompts, sp, body.n, body.skip_special_tokens)  # failing, it ends the session
        if body.stream:
            return StreamingResponse(
                _stream(session, out, body.include_usage, path),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        async with session:
            collect = asyncio.create_task(out.collect(session))
            gone = asyncio.create_task(_disconnected(request))
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:  # the client went away: free the scheduler's slots now
                collect.cancel()
                self.metrics.requests.labels(path, "499").inc()
                return Response(status_code=499)
            gone.cancel()
            built = collect.result()
        self.metrics.requests.labels(path, "200").inc()
        return JSONResponse(built(session.rid, self.gw.model_name, _usage(session)))


def _prompts(gw: Gateway, prompt: Prompt) -> list[list[int]]:
    ids = _prompt_ids(gw, prompt)
    # A scheduler refuses an empty prompt only late (after routing); nothing can be generated from it.
    if not ids or not all(ids):
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def _prompt_ids(gw: Gateway, prompt: Prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [gw.encode(prompt)]
    if not prompt:
        return []
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [gw.encode(p) for p in prompt]
    return [list(p) for p in prompt]


def _echo(gw: Gateway, prompt: Prompt, i: int, ids: list[int]) -> tuple[str, list[int]]:
    """Prompt ``i``'s text as echo shows it (the client's own string, else its ids decoded), and its ids."""
    if isinstance(prompt, str):
        return prompt, ids
    if isinstance(prompt, list) and prompt and isinstance(prompt[i], str):
        return str(prompt[i]), ids
    return str(gw.tokenizer.decode(ids, skip_special_tokens=False)), ids


def _tool_plan(
    gw: Gateway, body: api.ChatCompletionRequest, tools: list[dict[str, object]] | None
) -> tuple[ToolParser | None, Constraint | None]:
    """The parser for the model's tool calls (None: the model is not to call any) and the grammar a
    forcing tool_choice imposes; ``tools``: the request's tool_dicts (validated)."""
    if tools is None:
        return None, None
    name = gw.text.tool_call_parser
    if name is None:
        msg = (
            "this model's chat template has no tool-call format this server knows; start the gateway"
            f" with --tool-call-parser ({', '.join(PARSERS)}) to use tools"
        )
        raise ApiError(400, msg, param="tools")
    try:
        # parallel_tool_calls: false -> a forced call is exactly one call
        constraint = tool_choice_constraint(
            tools, body.tool_choice_value(), name, body.parallel_tool_calls is not False
        )
    except ValueError as e:
        raise ApiError(400, str(e), param="tools") from e
    return PARSERS[name](), constraint


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


BodyBuilder = Callable[[str, str, resp.UsageBody], resp.Body]  # (rid, model, usage) -> the response


class _CompletionOutput:
    """/v1/completions' chunks and body from its choices' deliveries."""

    def __init__(self, states: list[CompletionChoiceState], logprobs: bool) -> None:
        self.states = states
        self.logprobs = logprobs

    def hello(self, rid: str, model: str, created: int) -> list[resp.Body]:
        return []

    def chunk(self, o: Output, rid: str, model: str, created: int) -> resp.Body | None:
        """The delivery as a chunk; None when it says nothing (no text, no scores, not finished)."""
        text, lp = self.states[o.index].step(o)
        if not text and lp is None and o.finish_reason is None:
            return None
        return resp.completion_chunk(rid, model, created, o.index, text, o.finish_reason, lp)

    async def collect(self, session: RequestSession) -> BodyBuilder:
        fold = CompletionFold(self.states, self.logprobs)
        async for outputs in session:
            for o in outputs:
                fold.add(o)
        results = fold.done()
        return lambda rid, model, use: resp.completion_body(rid, model, results, use)


class _ChatOutput:
    """/v1/chat/completions' chunks and body: text through the tool-call parser (``parser``, when the
    model may call tools), logprobs when asked."""

    def __init__(
        self, pieces: Pieces, logprobs: bool, parser: ToolParser | None, one_call: bool, n: int
    ) -> None:
        self.logprobs, self.parser, self.one_call = logprobs, parser, one_call
        self.states = [ChatChoiceState(pieces, logprobs, parser, one_call) for _ in range(n)]
        self.pieces = pieces

    def hello(self, rid: str, model: str, created: int) -> list[resp.Body]:
        """Each choice's first chunk: the role (OpenAI's, before any content)."""
        delta: resp.ChatDelta = {"role": "assistant", "content": ""}
        return [resp.chat_chunk(rid, model, created, i, delta, None) for i in range(len(self.states))]

    def chunk(self, o: Output, rid: str, model: str, created: int) -> resp.Body | None:
        s = self.states[o.index].step(o)
        if not s.content and not s.tool_calls and s.logprobs is None and s.finish_reason is None:
            return None
        delta: resp.ChatDelta = {}
        if s.content:
            delta["content"] = s.content
        if s.tool_calls:
            delta["tool_calls"] = s.tool_calls
        return resp.chat_chunk(rid, model, created, o.index, delta, s.finish_reason, s.logprobs)

    async def collect(self, session: RequestSession) -> BodyBuilder:
        n = len(self.states)
        texts: list[list[str]] = [[] for _ in range(n)]
        scores: list[list[resp.ContentLogprob]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        async for outputs in session:
            for o in outputs:
                texts[o.index].append(o.text)
                reasons[o.index] = o.finish_reason
                if o.logprobs is not None:
                    scores[o.index] += chat_logprobs(scored(o.token_ids, o.logprobs), self.pieces)
        results = []
        for i in range(n):
            content, calls = chat_content("".join(texts[i]), self.parser, self.one_call)
            lp = scores[i] if self.logprobs else None
            results.append(resp.ChatResult(i, content, finish_reason(reasons[i], bool(calls)), calls, lp))
        return lambda rid, model, use: resp.chat_body(rid, model, results, use)


_Output = _CompletionOutput | _ChatOutput


async def _stream(
    session: RequestSession, out: _Output, include_usage: bool, path: str
) -> AsyncIterator[str]:
    model, rid, created = session.gw.model_name, session.rid, int(time.time())
    chat = isinstance(out, _ChatOutput)
    status = "200"
    try:
        async with session:
            hello = out.hello(rid, model, created)
            if hello:
                yield "".join(_sse(_usage_slot(c, include_usage)) for c in hello)
            async for outputs in session:
                chunks = [
                    _sse(c) for o in outputs if (c := _chunk(out, o, rid, model, created, include_usage))
                ]
                if chunks:
                    yield "".join(chunks)
            if include_usage:
                yield _sse(resp.usage_chunk(rid, model, created, chat, _usage(session)))
            yield "data: [DONE]\n\n"
    except ApiError as e:  # mid-stream: the status line is sent already; the error goes in the stream
        status = str(e.status)
        yield _sse(e.body())
    finally:  # also on disconnect (the generator is cancelled / closed)
        if status == "200" and not session.done:
            status = "499"
        session.gw.metrics.requests.labels(path, status).inc()


def _chunk(
    out: _Output, o: Output, rid: str, model: str, created: int, include_usage: bool
) -> resp.Body | None:
    chunk = out.chunk(o, rid, model, created)
    return _usage_slot(chunk, include_usage) if chunk is not None else None


def _usage_slot(chunk: resp.Body, include_usage: bool) -> resp.Body:
    """With include_usage, OpenAI's every chunk before the last (the usage's own) says ``usage: null``."""
    if include_usage:
        chunk["usage"] = None
    return chunk


def _usage(session: RequestSession) -> resp.UsageBody:
    u = session.usage()
    return resp.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _sse(obj: Mapping[str, object]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
