"""vLLM-style tokenizer endpoints and OpenAI's model lookup, on the gateway alone (no scheduler needed):

- ``POST /v1/tokenize``: a prompt, or chat messages, as the token ids the gateway would send a
  scheduler for it (``/v1/completions`` / ``/v1/chat/completions``), their count and the context
  length (``max_model_len``: None while no scheduler has reported one);
- ``POST /v1/detokenize``: token ids back to text, special tokens kept (the ids are the client's own,
  so nothing is hidden from it);
- ``GET /v1/models/{model_id}``: one entry of ``GET /v1/models``, or a 404 ``model_not_found``.

The request bodies are strict like requests.py's: an unknown field, a wrong type or a value out of
range is a 400 naming the field (build_app's app-wide RequestValidationError / ApiError handlers
write OpenAI's error body).
"""

from __future__ import annotations

from typing import Annotated, TypedDict

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api.chat_request import (
    ChatMessage,
    ChatTool,
    opens_a_turn,
    template_messages,
    tool_dicts,
)
from radixserve.tokenizer.openai_api.requests import (
    MAX_MESSAGES,
    MAX_TOOLS,
    JsonObject,
    Text,
    TokenId,
    _Strict,
)
from radixserve.tokenizer.text.model_text import ChatRender

TOKENIZE_PATH = "/v1/tokenize"
DETOKENIZE_PATH = "/v1/detokenize"
# The route's template, not the requested path, labels the metrics: ids are the client's to make up,
# and each made-up one would otherwise be a time series of its own.
MODEL_PATH = "/v1/models/{model_id}"

_PROMPT_ONLY: tuple[str, ...] = ("add_special_tokens",)
_CHAT_ONLY: tuple[str, ...] = (
    "add_generation_prompt",
    "tools",
    "chat_template_kwargs",
    "continue_final_message",
)


# requests.py's strict base and field types: these endpoints refuse what the completion endpoints do.
class TokenizeRequest(_Strict):
    """vLLM's two shapes in one schema, so one route (and one body type) serves both: ``prompt``
    with ``add_special_tokens``, or ``messages`` with ``add_generation_prompt`` and ``tools`` (the chat
    endpoint's own types: what it takes, this counts). Which one, and that
    no field of the other shape came along, is ``shape_error``'s to say: a pydantic validator could
    only blame the whole body, not the field."""

    model: Annotated[Text, Field(max_length=512)]
    prompt: Text | None = None
    add_special_tokens: bool = True
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: JsonObject | None = None
    continue_final_message: bool = False

    def shape_error(self) -> ApiError | None:
        """The 400 for a body that is neither shape, or both, naming the field that does not belong."""
        if self.prompt is not None and self.messages is not None:
            return ApiError(400, "give either prompt or messages, not both", param="messages")
        if self.prompt is None and self.messages is None:
            return ApiError(400, "one of prompt (text) or messages (chat) is required", param="prompt")
        if self.prompt is not None:
            given, other, wrong = "prompt", "messages", _CHAT_ONLY
        else:
            given, other, wrong = "messages", "prompt", _PROMPT_ONLY
        # Set explicitly, even to its default: a client sending it expects it to matter.
        for name in wrong:
            if name in self.model_fields_set:
                return ApiError(400, f"{name} goes with {other}, not with {given}", param=name)
        return None


class DetokenizeRequest(_Strict):
    model: Annotated[Text, Field(max_length=512)]
    tokens: list[TokenId]


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeResponse(TypedDict):
    prompt: str


class ModelCard(TypedDict):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None


def model_card(gw: Gateway) -> ModelCard:
    """The served model as an entry of ``GET /v1/models`` (the test holds the two equal)."""
    return {
        "id": gw.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "radixserve",
        "max_model_len": gw.max_context(),
    }


class TokenizeRoutes:
    """The three endpoints over one Gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        self.gw.check_model(body.model)
        refused = body.shape_error()
        if refused is not None:
            raise refused
        if body.messages is not None:
            # The chat endpoint's own steps (checks, conversion, template): the count is its prompt_tokens.
            messages, tools = template_messages(body.messages), tool_dicts(body.tools)
            opens = opens_a_turn(
                body.add_generation_prompt, body.continue_final_message, body.model_fields_set
            )
            render = ChatRender(opens, body.continue_final_message, dict(body.chat_template_kwargs or {}))
            ids = self.gw.text.encode_chat(messages, tools, render)
        elif body.add_special_tokens:
            ids = self.gw.encode(body.prompt or "")  # /v1/completions' call: the same ids
        else:
            ids = list(self.gw.tokenizer.encode(body.prompt or "", add_special_tokens=False))
        out: TokenizeResponse = {"count": len(ids), "max_model_len": self.gw.max_context(), "tokens": ids}
        self.gw.metrics.requests.labels(TOKENIZE_PATH, "200").inc()
        return JSONResponse(out)

    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        self.gw.check_model(body.model)
        # The schema bounds ids to int32 only; the tokenizer's vocabulary is this model's, and
        # decoding silently drops an id beyond it (the text would not be what was asked for).
        vocab = self.gw.text.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            msg = f"tokens[{bad}] = {body.tokens[bad]} is outside the vocabulary (ids 0..{vocab - 1})"
            raise ApiError(400, msg, param="tokens")
        out: DetokenizeResponse = {"prompt": self.gw.tokenizer.decode(body.tokens, skip_special_tokens=False)}
        self.gw.metrics.requests.labels(DETOKENIZE_PATH, "200").inc()
        return JSONResponse(out)

    async def model(self, model_id: str) -> JSONResponse:
        try:
            self.gw.check_model(model_id)
        except ApiError as e:
            # Answered here rather than by the app's handler, which labels by the requested path.
            self.gw.metrics.requests.labels(MODEL_PATH, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)
        self.gw.metrics.requests.labels(MODEL_PATH, "200").inc()
        return JSONResponse(model_card(self.gw))


def add_routes(app: FastAPI, gw: Gateway) -> None:
    """Register the three endpoints on ``app`` (build_app's: its error handlers and middleware,
    API keys included, apply to them as to every route)."""
    routes = TokenizeRoutes(gw)
    app.post(TOKENIZE_PATH)(routes.tokenize)
    app.post(DETOKENIZE_PATH)(routes.detokenize)
    # ``:path``: an id may hold slashes (``org/name``); ``/v1/models`` itself stays the list route.
    app.get("/v1/models/{model_id:path}")(routes.model)
