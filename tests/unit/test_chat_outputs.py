"""What a chat's output becomes for its client: reasoning split off (--reasoning-parser), tool calls
streamed as the model writes them, usage on every chunk, and the chat template's options
(chat_template_kwargs, reasoning_effort, continue_final_message, add_generation_prompt); plus the
vLLM sampling extensions as the schedulers are sent them (min_tokens, include_stop_str_in_output,
truncate_prompt_tokens, add_special_tokens). Pure parsers directly; the rest through the gateway's
app over scripted schedulers (tests/helpers/gateway.py)."""

from __future__ import annotations

import json
import random
from typing import Any

import llguidance
import llguidance.hf
import pytest
from fastapi import FastAPI

from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api.app import build_app
from radixserve.tokenizer.text.reasoning import REASONING_PARSERS, Start
from tests.helpers.gateway import (
    CALL_TEXT,
    MODEL,
    USER,
    WEATHER,
    ScriptedSchedulers,
    chat,
    complete,
    events,
    post,
    refused,
    sent,
    text,
)


# ------------------------------------------------------------------------------ reasoning parsers
@pytest.mark.parametrize(
    ("parser", "start", "output", "reasoning", "content"),
    [
        ("qwen3", Start.MAYBE, "<think>\nweigh it\n</think>\n\nParis", "\nweigh it\n", "Paris"),
        ("qwen3", Start.MAYBE, "Paris", None, "Paris"),  # thinking off by itself: all answer
        ("qwen3", Start.MAYBE, "  <think>cut by max_tokens", "cut by max_tokens", None),
        ("qwen3", Start.INSIDE, "weigh it</think>Paris", "weigh it", "Paris"),  # the prompt opened it
        ("qwen3", Start.ANSWER, "<think>x</think>y", None, "<think>x</think>y"),  # switched off: verbatim
        ("deepseek_r1", Start.MAYBE, "weigh it</think>\nParis", "weigh it", "Paris"),  # R1: no <think>
        ("deepseek_r1", Start.MAYBE, "<think>weigh it</think>Paris", "weigh it", "Paris"),  # R1-0528
        ("deepseek_r1", Start.MAYBE, "still thinking", "still thinking", None),
        ("qwen3", Start.MAYBE, "<thin", None, "<thin"),
        ("qwen3", Start.MAYBE, "", None, None),
    ],
)
def test_reasoning_parse_and_stream_agree_in_any_chunking(parser, start, output, reasoning, content):
    p = REASONING_PARSERS[parser]()
    assert p.parse(output, start) == (reasoning, content)
    rng = random.Random(len(output))
    for _ in range(30):
        s, got_r, got_c, i = p.stream(start), "", "", 0
        while i < len(output):
            n = rng.randint(1, 5)
            part = s.feed(output[i : i + n])
            got_r, got_c, i = got_r + part.reasoning, got_c + part.content, i + n
        last = s.finish()
        assert (got_r + last.reasoning or None, got_c + last.content or None) == (reasoning, content)


@pytest.mark.parametrize(
    ("prompt", "mode"),
    [
        ("<|im_start|>assistant\n", Start.MAYBE),
        ("<|im_start|>assistant\n<think>\n", Start.INSIDE),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", Start.ANSWER),
    ],
)
def test_where_the_output_begins_is_read_from_the_prompt(prompt, mode):
    assert REASONING_PARSERS["qwen3"].mode(prompt) is mode


# ----------------------------------------------------------------------------- thinking gateway
@pytest.fixture(scope="module")
def thinking_gw(demo_model) -> Gateway:
    path = demo_model("qwen3", thinking=True)
    config = GatewayConfig(schedulers=("127.0.0.1:1",), reasoning_parser="qwen3")
    return Gateway(path, MODEL, config)


@pytest.fixture(scope="module")
def thinking_app(thinking_gw) -> FastAPI:
    return build_app(thinking_gw)


@pytest.fixture
def thinking(thinking_gw, monkeypatch) -> ScriptedSchedulers:
    e = ScriptedSchedulers()
    monkeypatch.setattr(thinking_gw, "submit", e.submit)
    return e


def say(engine: ScriptedSchedulers, *pieces: str, finish: str = "stop") -> None:
    """The model's output, delivered in these pieces."""
    engine.script = lambda k, ids, sp: [
        *(text(p, [5]) for p in pieces[:-1]),
        text(pieces[-1], [5], finish),
    ]


def test_reasoning_content_is_split_off_whole_and_streamed(thinking_app, thinking):
    say(thinking, "<think>\nthe capi", "tal is Par", "is\n</thi", "nk>\n\nPar", "is.")
    r = chat(thinking_app)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "\nthe capital is Paris\n" and message["content"] == "Paris."
    deltas = [c["choices"][0]["delta"] for c in events(chat(thinking_app, stream=True))]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nthe capital is Paris\n"
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_answer:])  # reasoning came first
    r = chat(thinking_app, separate_reasoning=False)  # SGLang's switch: the text as the model wrote it
    message = r.json()["choices"][0]["message"]
    assert (
        message["content"] == "<think>\nthe capital is Paris\n</think>\n\nParis."
        and "reasoning_content" not in message
    )


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(thinking_app, thinking):
    say(thinking, "<think>I need the weather</think>\n", CALL_TEXT)
    message = chat(thinking_app, tools=[WEATHER]).json()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["reasoning_content"] == "I need the weather"
    assert message["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["message"]["content"] is None


def _prompt(engine: ScriptedSchedulers, gw: Gateway) -> str:
    return str(gw.tokenizer.decode(engine.sent[-1][0], skip_special_tokens=False))


def test_the_thinking_switch_reaches_the_template(thinking_app, thinking_gw, thinking):
    say(thinking, "<think>x</think>y")
    chat(thinking_app)
    assert _prompt(thinking, thinking_gw).endswith("<|im_start|>assistant\n")
    for body in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = chat(thinking_app, **body)
        assert _prompt(thinking, thinking_gw).endswith("<think>\n\n</think>\n\n"), body
        # the prompt closed the reasoning: what the model writes is all answer
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}
    # an explicit kwarg wins over reasoning_effort; another effort turns thinking on
    chat(thinking_app, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert _prompt(thinking, thinking_gw).endswith("<|im_start|>assistant\n")
    chat(thinking_app, reasoning_effort="low")
    assert _prompt(thinking, thinking_gw).endswith("<|im_start|>assistant\n")


def test_past_reasoning_goes_back_to_the_template(thinking_app, thinking_gw, thinking):
    say(thinking, "ok")
    history = [*USER, {"role": "assistant", "content": "Paris", "reasoning_content": "hm"}, *USER]
    assert chat(thinking_app, messages=history).status_code == 200
    assert "<think>\nhm\n</think>\n\nParis" in _prompt(thinking, thinking_gw)


def _accepts(gw: Gateway, grammar: str, output: str) -> bool:
    tok = gw.tokenizer
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)), grammar)
    return all(m.consume_token(t) for t in tok.encode(output, add_special_tokens=False))


def test_structured_output_applies_to_the_answer_after_the_reasoning(thinking_app, thinking_gw, thinking):
    from radixserve.scheduler.grammar import grammar_text

    say(thinking, '<think>hm</think>\n{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = chat(thinking_app, response_format=fmt)
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant",
        "content": '{"a": 1}',
        "reasoning_content": "hm",
    }
    constraint = sent(thinking).constraint
    assert constraint is not None and constraint.kind == "llguidance"
    grammar = grammar_text(constraint)
    assert _accepts(thinking_gw, grammar, '<think>free text: {"a": ]</think>\n{"a":1}')
    assert _accepts(thinking_gw, grammar, '{"a":1}')  # the model may skip thinking
    assert not _accepts(thinking_gw, grammar, "<think>x</think>not json")
    assert not _accepts(thinking_gw, grammar, '{"a":1}<think>')
    # with thinking switched off the answer is constrained from its first token
    chat(thinking_app, response_format=fmt, chat_template_kwargs={"enable_thinking": False})
    assert sent(thinking).constraint.kind == "json_schema"
    # a bad schema is still the client's 400, naming its field
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    refused(chat(thinking_app, response_format=bad), "response_format")


# ------------------------------------------------------------------------- streamed tool calls
def test_tool_calls_stream_their_arguments_as_generated(app, engine):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    pieces = [call[i : i + 4] for i in range(0, len(call), 4)]
    say(engine, *pieces)
    chunks = events(chat(app, tools=[WEATHER], stream=True))
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    fragments = [tc["function"]["arguments"] for tc in calls[1:]]
    assert len(fragments) >= 5  # several chunks, not one at the end
    assert all("id" not in tc and tc["index"] == 0 for tc in calls[1:])
    assert "".join(fragments) == '{"city": "Paris", "days": 3}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_cut_by_max_tokens_ends_as_a_partial_call(app, engine):
    say(engine, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', finish="length")
    chunks = events(chat(app, tools=[WEATHER], stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all("<tool_call>" not in d.get("content", "") for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Pa'
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    choice = chat(app, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'


def test_parallel_calls_stream_each_under_its_index(app, engine):
    second = CALL_TEXT.replace("Paris", "Oslo")
    say(engine, CALL_TEXT[:40], CALL_TEXT[40:] + "\n" + second[:30], second[30:])
    calls = [
        tc
        for c in events(chat(app, tools=[WEATHER], stream=True))
        for tc in c["choices"][0]["delta"].get("tool_calls", [])
    ]
    by_index: dict[int, str] = {}
    for tc in calls:
        by_index[tc["index"]] = by_index.get(tc["index"], "") + tc["function"]["arguments"]
    assert {i: json.loads(a) for i, a in by_index.items()} == {0: {"city": "Paris"}, 1: {"city": "Oslo"}}


# ------------------------------------------------------------------------------------- usage
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(app, engine):
    engine.script = lambda k, ids, sp: [
        text("a", [5], done=1),
        text("b", [6], done=2),
        text("c", [7], "stop", done=3),
    ]
    for make in (chat, complete):
        r = make(app, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = events(r)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 3, counts
        assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
        assert chunks[-1]["choices"] == []  # include_usage's own last chunk still comes


# ---------------------------------------------------------------------- template and sampling
def test_continue_final_message_leaves_the_last_turn_open(app, gw, engine):
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    chat(app, messages=messages, continue_final_message=True)
    prompt = str(gw.tokenizer.decode(engine.sent[-1][0], skip_special_tokens=False))
    assert prompt.endswith("The answer is")
    r = chat(app, messages=messages, continue_final_message=True, add_generation_prompt=True)
    refused(r, "continue_final_message", "add_generation_prompt")
    chat(app, messages=USER, add_generation_prompt=False)
    assert str(gw.tokenizer.decode(engine.sent[-1][0], skip_special_tokens=False)).endswith("<|im_end|>\n")


def test_chat_template_kwargs_reach_the_template_but_not_its_own_parameters(app, engine):
    assert chat(app, chat_template_kwargs={"anything": 1}).status_code == 200
    refused(chat(app, chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools", "field of its own")


def test_named_messages_and_sdk_histories_are_accepted(app, gw, engine):
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "hi", "name": "alice"},
        {
            "role": "assistant",
            "content": "hello",
            "refusal": None,
            "audio": None,
            "function_call": None,
        },
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "now?"}]},
    ]
    assert chat(app, messages=history).status_code == 200
    prompt = str(gw.tokenizer.decode(engine.sent[-1][0], skip_special_tokens=False))
    assert "I can't help with that." in prompt and "and now?" in prompt


def test_vllm_sampling_extensions_reach_the_schedulers(app, engine):
    for make in (chat, complete):
        make(app, min_tokens=2, include_stop_str_in_output=True, stop=["x"])
        sp = sent(engine)
        assert (sp.min_new_tokens, sp.include_stop_str) == (2, True)
        make(app, no_stop_trim=True)
        assert sent(engine).include_stop_str
    refused(complete(app, min_tokens=3, max_tokens=2), "min_tokens", "max_new_tokens")
    refused(complete(app, min_tokens=1, guided_regex="a+"), "min_tokens", "constraint")


def test_truncate_prompt_tokens_and_add_special_tokens(app, gw, engine):
    complete(app, prompt="one two three four five six seven")
    full = engine.sent[-1][0]
    complete(app, prompt="one two three four five six seven", truncate_prompt_tokens=3)
    assert engine.sent[-1][0] == full[-3:]
    complete(app, prompt="hello", add_special_tokens=False)
    plain = engine.sent[-1][0]
    assert plain == gw.tokenizer.encode("hello", add_special_tokens=False)
    chat(app, add_special_tokens=True)
    with_bos = engine.sent[-1][0]
    chat(app)
    assert len(with_bos) >= len(engine.sent[-1][0])


def test_sglang_constraint_names_map_like_vllms(app, engine):
    complete(app, regex="a+")
    assert sent(engine).constraint.kind == "regex"
    complete(app, json_schema=json.dumps({"type": "object"}))
    assert sent(engine).constraint.kind == "json_schema"
    refused(complete(app, regex="a+", guided_regex="b+"), "regex", "both constrain")


def test_unknown_paths_answer_openais_error_body(app):
    r = post(app, "/v1/nope", {})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Invalid URL (POST /v1/nope)"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_refusals_are_logged_with_field_and_reason_at_a_bounded_rate(app, caplog):
    import logging

    from radixserve.tokenizer.errors import ApiError, ClientErrorLog

    with caplog.at_level(logging.INFO, logger="radixserve.tokenizer.errors"):
        chat(app, temperature=9)
    line = next(r.getMessage() for r in caplog.records if "refused 400" in r.getMessage())
    assert "POST /v1/chat/completions" in line and "field=temperature" in line and "temperature" in line
    now = [0.0]
    log = ClientErrorLog(per_second=2, clock=lambda: now[0])
    e = ApiError(400, "bad", param="x")
    assert [log.refused("POST", "/p", e) for _ in range(5)] == [True, True, False, False, False]
    now[0] = 1.0  # the budget refills; the next line says how many were not logged
    with caplog.at_level(logging.INFO, logger="radixserve.tokenizer.errors"):
        assert log.refused("POST", "/p", e)
    assert "(3 more not logged)" in caplog.records[-1].getMessage()


def test_the_gateways_reasoning_parser_choices_are_the_parsers():
    from radixserve.common.service_config import REASONING_PARSERS as CHOICES

    assert set(CHOICES) == set(REASONING_PARSERS)
