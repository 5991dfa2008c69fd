"""A chat request planned for the schedulers, the same for /v1/chat/completions and /v1/responses:
its messages through the chat template (with its options), the prompt's token ids, the sampling
parameters with the one output constraint (a forcing tool_choice's grammar, or a structured output,
let through only after the reasoning of a thinking model), and how its output is to be read
(reasoning, tool calls). Every refusal is an ApiError naming the field."""

from __future__ import annotations

import time
from dataclasses import dataclass

from radixserve.common.sampling import Constraint, SamplingParams
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api import requests as api
from radixserve.tokenizer.openai_api.chat_request import ChatCompletionRequest, template_messages
from radixserve.tokenizer.openai_api.choices import ChatParsing
from radixserve.tokenizer.text.model_text import ChatRender, ModelText
from radixserve.tokenizer.text.reasoning import Start
from radixserve.tokenizer.text.tool_calls import PARSERS, ToolParser
from radixserve.tokenizer.text.tool_grammar import tool_choice_constraint


@dataclass(frozen=True, slots=True)
class ChatPlan:
    ids: list[int]  # the prompt
    sampling: SamplingParams
    parsing: ChatParsing
    tokenized: tuple[float, float]  # when tokenizing started and ended (the trace's span)


async def plan_chat(gw: Gateway, body: ChatCompletionRequest) -> ChatPlan:
    body.check_fields()
    t0 = time.monotonic()
    text = gw.text
    tools = body.tool_dicts()  # validated here, once
    parser, tool_constraint = _tool_plan(gw, body, tools)
    render = ChatRender(body.opens_a_turn, body.continue_final_message, body.template_variables())
    prompt = text.render_chat(template_messages(body.messages), tools, render)
    ids = body.truncated(text.encode_rendered(prompt, body.add_special_tokens is True), gw.max_context())
    t1 = time.monotonic()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # OpenAI: up to the context length
        ctx = gw.max_context()
        max_tokens = max(1, ctx - len(ids)) if ctx else api.COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
    start = text.reasoning.mode(prompt) if text.reasoning is not None else Start.ANSWER
    source = _after_reasoning(text, body.output_constraint(tool_constraint), start)
    sp = body.sampling_params(max_tokens, text.vocab_size, source)
    await check_constraint(text, source)
    parsing = ChatParsing(
        parser,
        one_call=body.parallel_tool_calls is False,
        reasoning=text.reasoning if body.separate_reasoning else None,
        reasoning_start=start,
    )
    return ChatPlan(ids, sp, parsing, (t0, t1))


async def check_constraint(text: ModelText, source: api.Source | None) -> None:
    """An invalid schema, regex or grammar is the client's 400 here, not a failure on a scheduler.
    A tool_choice grammar is built from the tools' parameters: those are what to fix."""
    if source is not None:
        field, constraint = source
        await text.check_constraint(constraint, "tools" if field == "tool_choice" else field)


def _after_reasoning(text: ModelText, source: api.Source | None, start: Start) -> api.Source | None:
    """A constraint on a reasoning model's output applies to its answer: the reasoning before it goes
    free (structured outputs and forced tool calls alike). The field that asked stays the same."""
    if source is None or text.reasoning is None:
        return source
    head = text.reasoning.grammar_head(start, text.tag_term)
    if head is None:
        return source
    from radixserve.scheduler.grammar import GrammarError, after_prefix

    field, constraint = source
    try:
        return field, after_prefix(constraint, *head)
    except GrammarError as e:  # the client's own constraint is malformed
        raise ApiError(400, f"{field}: {e}", param=field) from e


def _tool_plan(
    gw: Gateway, body: ChatCompletionRequest, tools: list[dict[str, object]] | None
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
