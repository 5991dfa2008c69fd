"""``POST /v1/responses``, ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``: the Responses API
over the chat pipeline (chat_plan.py), its bodies and conversion in responses.py, its stored
responses in the gateway's response store (response_store.py).

Streamed, a response is OpenAI's event sequence: ``response.created`` and ``response.in_progress``;
per output item ``response.output_item.added``, its content (``response.content_part.added``, the
``response.reasoning_text.delta`` / ``response.output_text.delta`` /
``response.function_call_arguments.delta`` events as the model writes, their ``.done``), and
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when
max_output_tokens cut it, ``response.failed`` when it failed). Every event carries its
``sequence_number``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from radixserve.tokenizer.auth import presented_key
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api import requests as api
from radixserve.tokenizer.openai_api import responses as ra
from radixserve.tokenizer.openai_api.bodies import ToolCallBody
from radixserve.tokenizer.openai_api.chat_plan import ChatPlan, plan_chat
from radixserve.tokenizer.openai_api.chat_request import ChatCompletionRequest
from radixserve.tokenizer.openai_api.choices import ChatAnswer, ChatChoiceState, ChatStep, chat_answer
from radixserve.tokenizer.openai_api.fields import RESPONSES, refused
from radixserve.tokenizer.openai_api.http_util import event_stream, submitted, unless_gone
from radixserve.tokenizer.openai_api.response_store import ResponseStore, StoredResponse, owner_of
from radixserve.tokenizer.session import RequestSession, Usage
from radixserve.tokenizer.tracing import inference_span

PATH = "/v1/responses"
ITEM_PATH = "/v1/responses/{response_id}"  # the metrics' label: ids are the client's to make up

Json = dict[str, object]

# Chat's names for the fields a converted request can be refused over, as this endpoint calls them.
_FIELDS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


class ResponsesRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.store = gw.responses

    async def create(self, body: ra.ResponseRequest, request: Request) -> Response:
        self.gw.check_model(body.model)
        not_served = refused(body, RESPONSES)
        if not_served is not None:
            raise ApiError(400, not_served[1], param=not_served[0], code="unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        owner = owner_of(presented_key(request.headers))
        history: list[Json] = []
        if body.previous_response_id is not None:
            previous = await self.store.get(owner, body.previous_response_id)
            if previous is None:
                msg = f"response {body.previous_response_id!r} not found (expired, deleted or never stored)"
                raise ApiError(404, msg, param="previous_response_id", code="response_not_found")
            history = previous.messages
        plan = await self._plan(body.chat_body(history))
        name, genai = inference_span("chat", body.model, self.gw.model_name)
        attributes = {
            **genai,
            "http.request.method": "POST",
            "http.route": PATH,
            "radixserve.stream": body.stream,
        }
        session = RequestSession(self.gw, name, request.headers, attributes, start=plan.tokenized[0])
        response_id = f"resp_{session.rid}"
        session.trace.annotate({"gen_ai.response.id": response_id})
        session.trace.child("tokenize", *plan.tokenized, {"radixserve.prompts": 1})
        # Failing, it ends the session; a client that leaves while it is held (no scheduler yet) too.
        if not await submitted(
            request, session.submit([plan.ids], plan.sampling, 1, True), self.gw.hold.enabled
        ):
            self.gw.metrics.requests.labels(PATH, "499").inc()
            return Response(status_code=499)
        run = _Run(self.gw, self.store, owner, response_id, body, plan, history, int(time.time()))
        if body.stream:
            return event_stream(run.events(session))
        async with session:
            collected = await unless_gone(request, run.collect(session))
        if collected is None:  # the client went away
            self.gw.metrics.requests.labels(PATH, "499").inc()
            return Response(status_code=499)
        answer, reason = collected
        response = await run.finish(answer, reason, session.usage())
        self.gw.metrics.requests.labels(PATH, "200").inc()
        return JSONResponse(response)

    async def _plan(self, chat: Json) -> ChatPlan:
        try:
            body = ChatCompletionRequest.model_validate(chat)
            return await plan_chat(self.gw, body)
        except ValidationError as e:
            msg, param = api.validation_message(list(e.errors()))
            raise _renamed(ApiError(400, msg, param=param)) from e
        except ApiError as e:
            raise _renamed(e) from e

    async def get(self, response_id: str, request: Request) -> JSONResponse:
        found = await self.store.get(owner_of(presented_key(request.headers)), response_id)
        if found is None:
            return self._missing(response_id)
        self.gw.metrics.requests.labels(ITEM_PATH, "200").inc()
        return JSONResponse(found.response)

    async def delete(self, response_id: str, request: Request) -> JSONResponse:
        if not await self.store.delete(owner_of(presented_key(request.headers)), response_id):
            return self._missing(response_id)
        self.gw.metrics.requests.labels(ITEM_PATH, "200").inc()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _missing(self, response_id: str) -> JSONResponse:
        self.gw.metrics.requests.labels(ITEM_PATH, "404").inc()
        e = ApiError(
            404, f"response {response_id!r} not found", param="response_id", code="response_not_found"
        )
        return JSONResponse(e.body(), status_code=404)


def _renamed(e: ApiError) -> ApiError:
    """A refusal of the converted chat request, naming this endpoint's field."""
    if e.param is None:
        return e
    head, dot, rest = e.param.partition(".")
    if head not in _FIELDS:
        return e
    return ApiError(e.status, e.message, e.type, _FIELDS[head] + dot + rest, e.code)


@dataclass
class _Run:
    """One response being made: its id, its request, its chat plan, and how it ends."""

    gw: Gateway
    store: ResponseStore
    owner: str
    response_id: str
    body: ra.ResponseRequest
    plan: ChatPlan
    history: list[Json]
    created_at: int

    def response(
        self,
        status: str,
        output: list[Json],
        use: Json | None = None,
        incomplete: str | None = None,
        error: Json | None = None,
    ) -> Json:
        return ra.response_object(
            self.response_id,
            self.body,
            self.gw.model_name,
            self.created_at,
            status,
            output,
            use,
            incomplete,
            error,
        )

    async def collect(self, session: RequestSession) -> tuple[ChatAnswer, str | None]:
        texts: list[str] = []
        reason: str | None = None
        async for outputs in session:
            for o in outputs:
                texts.append(o.text)
                reason = o.finish_reason or reason
        return chat_answer("".join(texts), self.plan.parsing), reason

    async def finish(
        self, answer: ChatAnswer, reason: str | None, usage: Usage, output: list[Json] | None = None
    ) -> Json:
        """The final response (stored when asked); ``output``: its items as streamed (ids kept)."""
        items = ra.output_items(answer, cut=reason == "length") if output is None else output
        reasoning_tokens = len(self.gw.text.encode(answer.reasoning, False)) if answer.reasoning else 0
        use = ra.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, reasoning_tokens)
        incomplete = "max_output_tokens" if reason == "length" else None
        response = self.response(
            "incomplete" if incomplete else "completed", items, use, incomplete=incomplete
        )
        if self.body.store:
            messages = [*self.history, *ra.chat_messages(self.body.input_items()), _assistant(items)]
            await self.store.put(self.owner, self.response_id, StoredResponse(response, messages))
        return response

    async def events(self, session: RequestSession) -> AsyncIterator[str]:
        stream = _EventStream()
        status = "200"
        try:
            async with session:
                yield stream.event("response.created", response=self.response("in_progress", []))
                yield stream.event("response.in_progress", response=self.response("in_progress", []))
                state = ChatChoiceState(self.gw.text.pieces, False, self.plan.parsing)
                texts: list[str] = []
                reason: str | None = None
                async for outputs in session:
                    out: list[str] = []
                    for o in outputs:
                        texts.append(o.text)
                        reason = o.finish_reason or reason
                        out += stream.step(state.step(o))
                    if out:
                        yield "".join(out)
                closing = stream.close("incomplete" if reason == "length" else "completed")
                answer = _answer(stream.items)
                final = await self.finish(answer, reason, session.usage(), stream.items)
                kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield "".join(closing) + stream.event(kind, response=final)
        except ApiError as e:  # mid-stream: the status line is sent already; the failure goes in the stream
            status = str(e.status)
            error: Json = {"code": e.code or e.type, "message": e.message}
            yield stream.event("response.failed", response=self.response("failed", stream.items, error=error))
        finally:
            if status == "200" and not session.done:
                status = "499"
            self.gw.metrics.requests.labels(PATH, status).inc()


def _answer(items: list[Json]) -> ChatAnswer:
    """The output items as the chat answer they are (the history of a follow-up)."""
    reasoning = "".join(str(p["text"]) for i in items if i["type"] == "reasoning" for p in i["content"])  # type: ignore[attr-defined]
    text = "".join(str(p["text"]) for i in items if i["type"] == "message" for p in i["content"])  # type: ignore[attr-defined]
    calls: list[ToolCallBody] = [
        {
            "id": str(i["call_id"]),
            "type": "function",
            "function": {"name": str(i["name"]), "arguments": str(i["arguments"])},
        }
        for i in items
        if i["type"] == "function_call"
    ]
    return ChatAnswer(reasoning or None, text or None, calls)


def _assistant(items: list[Json]) -> Json:
    return ra.assistant_message(_answer(items))


@dataclass
class _Open:
    """The output item being streamed."""

    kind: str  # reasoning | message | function_call
    index: int  # in the response's output
    item_id: str
    text: str = ""  # reasoning / message text, or a call's arguments so far
    call: ToolCallBody | None = None


@dataclass
class _EventStream:
    """A chat's steps as Responses events, in order, each numbered."""

    items: list[Json] = field(default_factory=list)  # the output's finished items
    seq: int = 0
    open: _Open | None = None

    def event(self, kind: str, **fields: object) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def step(self, s: ChatStep) -> list[str]:
        out: list[str] = []
        if s.reasoning:
            out += self._ensure("reasoning")
            out += self._delta("response.reasoning_text.delta", s.reasoning, content_index=0)
        if s.content:
            out += self._ensure("message")
            out += self._delta("response.output_text.delta", s.content, content_index=0, logprobs=[])
        for tc in s.tool_calls:
            if "id" in tc:  # a new call
                out += self.close()
                fn = tc.get("function", {})
                call: ToolCallBody = {
                    "id": tc["id"],
                    "type": "function",
                    "function": {"name": fn.get("name", ""), "arguments": ""},
                }
                out += self._open("function_call", ra.new_id("fc"), call)
            args = tc.get("function", {}).get("arguments", "")
            if args and self.open is not None and self.open.kind == "function_call":
                out += self._delta("response.function_call_arguments.delta", args)
        return out

    def _ensure(self, kind: str) -> list[str]:
        if self.open is not None and self.open.kind == kind:
            return []
        return self.close() + self._open(kind, ra.new_id("rs" if kind == "reasoning" else "msg"))

    def _open(self, kind: str, item_id: str, call: ToolCallBody | None = None) -> list[str]:
        self.open = _Open(kind, len(self.items), item_id, call=call)
        if kind == "reasoning":
            item, part = ra.reasoning_item(item_id, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item, part = ra.message_item(item_id, None, "in_progress"), ra.output_text("")
        else:
            assert call is not None
            return [
                self.event(
                    "response.output_item.added",
                    output_index=self.open.index,
                    item=ra.function_call_item(item_id, call, "", "in_progress"),
                )
            ]
        return [
            self.event("response.output_item.added", output_index=self.open.index, item=item),
            self.event(
                "response.content_part.added",
                item_id=item_id,
                output_index=self.open.index,
                content_index=0,
                part=part,
            ),
        ]

    def _delta(self, kind: str, text: str, **fields: object) -> list[str]:
        o = self.open
        assert o is not None
        o.text += text
        return [self.event(kind, item_id=o.item_id, output_index=o.index, delta=text, **fields)]

    def close(self, status: str = "completed") -> list[str]:
        """End the open item (its done events); it joins ``items``. ``status``: incomplete when the
        output was cut inside it."""
        o, self.open = self.open, None
        if o is None:
            return []
        where = {"item_id": o.item_id, "output_index": o.index}
        if o.kind == "function_call":
            assert o.call is not None
            item = ra.function_call_item(o.item_id, o.call, o.text, status)
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=o.call["function"]["name"],
                    arguments=o.text,
                )
            ]
        elif o.kind == "reasoning":
            item = ra.reasoning_item(o.item_id, o.text, status)
            part = {"type": "reasoning_text", "text": o.text}
            events = [
                self.event("response.reasoning_text.done", **where, content_index=0, text=o.text),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            item = ra.message_item(o.item_id, o.text, status)
            events = [
                self.event("response.output_text.done", **where, content_index=0, text=o.text, logprobs=[]),
                self.event(
                    "response.content_part.done", **where, content_index=0, part=ra.output_text(o.text)
                ),
            ]
        self.items.append(item)
        return [*events, self.event("response.output_item.done", output_index=o.index, item=item)]


def add_response_routes(app: FastAPI, gw: Gateway) -> None:
    routes = ResponsesRoutes(gw)
    app.post(PATH)(routes.create)
    app.get(ITEM_PATH)(routes.get)
    app.delete(ITEM_PATH)(routes.delete)
