"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

A request's lifecycle (submit, results, abort on disconnect, usage) is its RequestSession's
(session.py); this module turns OpenAI's bodies (requests.py: checked, mapped to SamplingParams)
into a session and its outputs into OpenAI's responses: one JSON body, or server-sent events ending in
``[DONE]``. What each choice shows (echo, logprobs, tool calls) is choices.py's; the bodies
are bodies.py's. With API keys configured, every path but /health (and /metrics, unless
--protect-metrics) needs one (auth.py).
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.common.sampling import SamplingParams
from radixserve.tokenizer.auth import RequireApiKey
from radixserve.tokenizer.errors import ApiError, ClientErrorLog, internal_error
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api import bodies as resp
from radixserve.tokenizer.openai_api import requests as api
from radixserve.tokenizer.openai_api.bodies import Pieces, chat_logprobs, scored
from radixserve.tokenizer.openai_api.body_limits import BodyLimits
from radixserve.tokenizer.openai_api.chat_plan import check_constraint, plan_chat
from radixserve.tokenizer.openai_api.chat_request import ChatCompletionRequest
from radixserve.tokenizer.openai_api.choices import (
    ChatChoiceState,
    ChatParsing,
    CompletionChoiceState,
    CompletionFold,
    chat_answer,
    finish_reason,
)
from radixserve.tokenizer.openai_api.fields import CHAT, COMPLETIONS, refused
from radixserve.tokenizer.openai_api.http_util import event_stream, submitted, unless_gone
from radixserve.tokenizer.openai_api.responses_route import add_response_routes
from radixserve.tokenizer.openai_api.tokenize import add_routes, model_card
from radixserve.tokenizer.session import Output, RequestSession
from radixserve.tokenizer.text.model_text import ModelText
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
    add_response_routes(app, gw)  # /v1/responses
    if gw.api_keys.enabled:  # added last, so outermost: a refusal comes before the body is read
        open_paths = ["/health"] if gw.protect_metrics else ["/health", "/metrics"]
        app.add_middleware(RequireApiKey, keys=gw.api_keys, open_paths=open_paths, refused=routes.refused)
    return app


def _error(e: ApiError) -> JSONResponse:
    retry_after = e.retry_after if e.retry_after is not None else RETRY_AFTER_S if e.status == 503 else None
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class OpenAIRoutes:
    """The endpoints and error handlers, over one Gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.metrics = gw.metrics
        self.client_errors = ClientErrorLog()
        self.paths = {
            "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
            "/v1/tokenize", "/v1/detokenize", "/v1/responses",
        }  # fmt: skip

    # -------------------------------------------------------------------------------- errors
    def refused(self, path: str) -> None:
        # A request without an accepted key (401): counted under its path if it is one of ours; the
        # paths a keyless client makes up are not a label of their own each.
        self.metrics.requests.labels(path if path in self.paths else "other", "401").inc()

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = api.validation_message(list(exc.errors()))
        return self._refuse(request, ApiError(400, msg, param=param))

    async def api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return self._refuse(request, exc)

    async def http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse, 404, 405): OpenAI's error body too
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        if exc.status_code == 404 and request.url.path not in self.paths:  # OpenAI's words for it
            message = f"Invalid URL ({request.method} {request.url.path})"
        return self._refuse(request, ApiError(exc.status_code, message, type_))

    def _refuse(self, request: Request, e: ApiError) -> JSONResponse:
        path = request.url.path
        # Made-up paths share one label: each would otherwise be a time series of its own.
        self.metrics.requests.labels(path if path in self.paths else "other", str(e.status)).inc()
        if e.status < 500:
            self.client_errors.refused(request.method, path, e)
        return _error(e)

    async def unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        # A bug before a request's session began (one inside it is an ApiError already): still
        # OpenAI's error body, logged with an id the client also gets.
        self.metrics.requests.labels(request.url.path, "500").inc()
        return _error(internal_error(self.metrics, exc))

    # ------------------------------------------------------------------------------ endpoints
    async def health(self) -> JSONResponse:
        up = {h.address: h.healthy for h in self.gw.pool.handles}
        if any(up.values()):
            return JSONResponse({"status": "ok", "schedulers": up})
        # Holding requests (scale to zero), the gateway serves without a scheduler: it stays ready.
        hold = self.gw.hold
        if hold.enabled:
            return JSONResponse({"status": "holding", "schedulers": up, "held": hold.held})
        return JSONResponse({"status": "no scheduler", "schedulers": up}, 503)

    async def prometheus(self) -> Response:
        self.metrics.schedulers_up.set(sum(h.healthy for h in self.gw.pool.handles))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(self.gw)]})

    async def completions(self, body: api.CompletionRequest, request: Request) -> Response:
        self._check(body, COMPLETIONS)
        t0 = time.monotonic()
        special = body.add_special_tokens is not False  # on by default for completions (vLLM's)
        context = self.gw.max_context()
        prompts = [body.truncated(ids, context) for ids in _prompts(self.gw.text, body.prompt, special)]
        t1 = time.monotonic()
        source = body.constraint()
        sp = body.sampling_params(self.gw.text.vocab_size, source)
        await check_constraint(self.gw.text, source)
        echo = [_echo(self.gw, body.prompt, i, ids) for i, ids in enumerate(prompts)] if body.echo else None
        pieces, wants = self.gw.text.pieces, body.logprobs is not None
        states = [
            CompletionChoiceState(pieces, wants, echo[i // body.n] if echo else None)
            for i in range(len(prompts) * body.n)
        ]
        out = _CompletionOutput(states, wants)
        return await self._serve(request, body, prompts, sp, out, tokenized=(t0, t1))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check(body, CHAT)
        plan = await plan_chat(self.gw, body)
        out = _ChatOutput(self.gw.text.pieces, bool(body.logprobs), plan.parsing, body.n)
        return await self._serve(request, body, [plan.ids], plan.sampling, out, tokenized=plan.tokenized)

    def _check(self, body: api.CompletionRequest | ChatCompletionRequest, endpoint: str) -> None:
        self.gw.check_model(body.model)
        not_served = refused(body, endpoint)
        if not_served is not None:
            raise ApiError(400, not_served[1], param=not_served[0], code="unsupported_parameter")
        body.check_stream_options()

    async def _serve(
        self,
        request: Request,
        body: api.CompletionRequest | ChatCompletionRequest,
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
        # Failing, it ends the session; a client that leaves while it is held (no scheduler yet) too.
        if not await submitted(
            request, session.submit(prompts, sp, body.n, body.skip_special_tokens), self.gw.hold.enabled
        ):
            self.metrics.requests.labels(path, "499").inc()
            return Response(status_code=499)
        if body.stream:
            usage = _StreamUsage(body.include_usage, body.continuous_usage)
            return event_stream(_stream(session, out, usage, path))
        async with session:
            built = await unless_gone(request, out.collect(session))
        if built is None:  # the client went away
            self.metrics.requests.labels(path, "499").inc()
            return Response(status_code=499)
        self.metrics.requests.labels(path, "200").inc()
        return JSONResponse(built(session.rid, self.gw.model_name, _usage(session)))


def _prompts(text: ModelText, prompt: Prompt, special: bool) -> list[list[int]]:
    ids = _prompt_ids(text, prompt, special)
    # A scheduler refuses an empty prompt only late (after routing); nothing can be generated from it.
    if not ids or not all(ids):
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def _prompt_ids(text: ModelText, prompt: Prompt, special: bool) -> list[list[int]]:
    """Token ids of each prompt; ``special``: the tokenizer adds its special tokens (BOS) to text."""
    if isinstance(prompt, str):
        return [text.encode(prompt, special)]
    if not prompt:
        return []
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [text.encode(p, special) for p in prompt]
    return [list(p) for p in prompt]


def _echo(gw: Gateway, prompt: Prompt, i: int, ids: list[int]) -> tuple[str, list[int]]:
    """Prompt ``i``'s text as echo shows it (the client's own string, else its ids decoded), and its ids."""
    if isinstance(prompt, str):
        return prompt, ids
    if isinstance(prompt, list) and prompt and isinstance(prompt[i], str):
        return str(prompt[i]), ids
    return str(gw.tokenizer.decode(ids, skip_special_tokens=False)), ids


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
    """/v1/chat/completions' chunks and body: text read as ``parsing`` says (reasoning, tool calls),
    logprobs when asked."""

    def __init__(self, pieces: Pieces, logprobs: bool, parsing: ChatParsing, n: int) -> None:
        self.logprobs, self.parsing = logprobs, parsing
        self.states = [ChatChoiceState(pieces, logprobs, parsing) for _ in range(n)]
        self.pieces = pieces

    def hello(self, rid: str, model: str, created: int) -> list[resp.Body]:
        """Each choice's first chunk: the role (OpenAI's, before any content)."""
        delta: resp.ChatDelta = {"role": "assistant", "content": ""}
        return [resp.chat_chunk(rid, model, created, i, delta, None) for i in range(len(self.states))]

    def chunk(self, o: Output, rid: str, model: str, created: int) -> resp.Body | None:
        s = self.states[o.index].step(o)
        if not (s.reasoning or s.content or s.tool_calls) and s.logprobs is None and s.finish_reason is None:
            return None
        delta: resp.ChatDelta = {}
        if s.reasoning:
            delta["reasoning_content"] = s.reasoning
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
            a = chat_answer("".join(texts[i]), self.parsing)
            lp = scores[i] if self.logprobs else None
            reason = finish_reason(reasons[i], bool(a.tool_calls))
            results.append(resp.ChatResult(i, a.content, reason, a.tool_calls, lp, a.reasoning))
        return lambda rid, model, use: resp.chat_body(rid, model, results, use)


_Output = _CompletionOutput | _ChatOutput


@dataclass(frozen=True, slots=True)
class _StreamUsage:
    """stream_options: a last chunk with the usage (include_usage), the usage so far on every chunk
    (vLLM's continuous_usage_stats)."""

    last: bool = False
    every: bool = False


async def _stream(
    session: RequestSession, out: _Output, usage: _StreamUsage, path: str
) -> AsyncIterator[str]:
    model, rid, created = session.gw.model_name, session.rid, int(time.time())
    chat = isinstance(out, _ChatOutput)
    status = "200"
    try:
        async with session:
            hello = out.hello(rid, model, created)
            if hello:
                yield "".join(_sse(_usage_slot(c, usage, session)) for c in hello)
            async for outputs in session:
                chunks = [
                    _sse(c) for o in outputs if (c := _chunk(out, o, rid, model, created, usage, session))
                ]
                if chunks:
                    yield "".join(chunks)
            if usage.last:
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
    out: _Output, o: Output, rid: str, model: str, created: int, usage: _StreamUsage, session: RequestSession
) -> resp.Body | None:
    chunk = out.chunk(o, rid, model, created)
    return _usage_slot(chunk, usage, session) if chunk is not None else None


def _usage_slot(chunk: resp.Body, usage: _StreamUsage, session: RequestSession) -> resp.Body:
    """The chunk's ``usage``: so far (continuous), else OpenAI's null before the usage's own chunk."""
    if usage.every:
        chunk["usage"] = _usage(session)
    elif usage.last:
        chunk["usage"] = None
    return chunk


def _usage(session: RequestSession) -> resp.UsageBody:
    u = session.usage()
    return resp.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _sse(obj: Mapping[str, object]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
