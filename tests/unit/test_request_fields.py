"""The field table (radixserve.tokenizer.openai_api.fields) against the request schemas, the OpenAI SDK's own
request types, and the gateway: every documented field is implemented, ignored by rule (and then
changes nothing the schedulers are sent), or refused by name unless neutral; nothing else passes."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import BaseModel

from radixserve.tokenizer.openai_api.chat_request import ChatCompletionRequest
from radixserve.tokenizer.openai_api.fields import (
    CHAT,
    COMPLETIONS,
    FIELDS,
    IGNORED,
    IMPLEMENTED,
    NEUTRAL_ONLY,
    RESPONSES,
    markdown_table,
    rules,
)
from radixserve.tokenizer.openai_api.requests import CompletionRequest
from radixserve.tokenizer.openai_api.responses import ResponseRequest
from tests.helpers.gateway import MODEL, USER, post, refused

ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES)
SCHEMAS: dict[str, type[BaseModel]] = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
    RESPONSES: ResponseRequest,
}
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses"}


def schema_paths(model: type[BaseModel], prefix: str, whole: set[str]) -> set[str]:
    """Every field path of ``model``, down through nested models and lists of them, but not below a
    path the table covers whole."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        out.add(path)
        if path in whole:
            continue
        for sub, many in _models(info.annotation):
            out |= schema_paths(sub, f"{path}[]." if many else f"{path}.", whole)
    return out


def _models(tp: object, many: bool = False) -> list[tuple[type[BaseModel], bool]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [(tp, many)]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is list:
        return [m for a in args for m in _models(a, True)]
    return [m for a in args for m in _models(a, many)]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_schema_and_the_table_name_the_same_fields(endpoint):
    table = rules(endpoint)
    whole = {p for p, r in table.items() if r.whole}
    got = schema_paths(SCHEMAS[endpoint], "", whole)
    assert got - table.keys() == set(), "fields the schema takes that the table does not say"
    # a row below a row that covers its subtree whole refines it (a part type refused by name)
    refining = {p for p in table if any(p.startswith(w + ".") or p.startswith(w + "[]") for w in whole)}
    assert table.keys() - got - refining == set(), "rows of the table the schema does not take"


def _sdk_fields() -> dict[str, set[str]]:
    from openai.types import completion_create_params as completion
    from openai.types.chat import chat_completion_message_param as message
    from openai.types.chat import completion_create_params as chat

    chat_fields = {*chat.CompletionCreateParamsBase.__annotations__, "stream"}
    for m in typing.get_args(message.ChatCompletionMessageParam):
        if m.__name__ != "ChatCompletionFunctionMessageParam":  # role "function": deprecated, refused
            chat_fields |= {f"messages[].{k}" for k in m.__annotations__}
    from openai.types.responses import response_create_params as responses

    return {
        CHAT: chat_fields,
        COMPLETIONS: {*completion.CompletionCreateParamsBase.__annotations__, "stream"},
        RESPONSES: {*responses.ResponseCreateParamsBase.__annotations__, "stream"},
    }


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_of_the_openai_sdk_is_in_the_table(endpoint):
    missing = _sdk_fields()[endpoint] - rules(endpoint).keys()
    assert not missing, f"OpenAI documents {sorted(missing)}: say what radixserve does with each"


# A value for each field not implemented: ignored ones must change nothing, the others are refused.
SAMPLES: dict[str, object] = {
    "stream_options.include_obfuscation": True,
    "user": "u-1",
    "best_of": 3,
    "suffix": "def f():",
    "messages[].audio": {"id": "audio-1"},
    "messages[].annotations": [{"type": "url_citation", "url_citation": {"url": "https://x"}}],
    "messages[].function_call": {"name": "f", "arguments": "{}"},
    "metadata": {"team": "search"},
    "store": True,
    "service_tier": "priority",
    "safety_identifier": "hash-1",
    "prompt_cache_key": "tenant-7",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "hello"},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "spaces_between_special_tokens": False,
    "guided_decoding_backend": "xgrammar",
    "guided_grammar": 'root ::= "a"',
    "guided_whitespace_pattern": " ",
    "ebnf": 'root ::= "a"',
    "structured_outputs": {"regex": "a+"},
    "priority": 5,
    "routed_dp_rank": 1,
    "data_parallel_rank": 1,
    "disagg_prefill_dp_rank": 0,
    "extra_key": "tenant-a",
    "custom_labels": {"team": "a"},
    "request_id": "abc",
    "rid": "abc",
    "cache_salt": "salt",
    "prompt_logprobs": 1,
    "return_tokens_as_token_ids": True,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "use_beam_search": True,
    "length_penalty": 0.5,
    "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1},
    "lora_path": "adapter",
    "session_id": "s",
    "session_params": {"id": "s"},
    "custom_logit_processor": "x",
    "custom_params": {"a": 1},
    "stop_regex": "a+",
    "return_hidden_states": True,
    "return_routed_experts": True,
    "routed_experts_start_len": 3,
    "return_cached_tokens_details": True,
    "return_token_ids": True,
    "images_config": {"a": 1},
    "ngram_corpus_id": "c",
    "bootstrap_host": "10.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
    "stream_reasoning": False,
    "echo": True,
    "documents": [{"text": "x"}],
    "chat_template": "{{ messages }}",
    "tool_parser": "hermes",
    "input_ids": [1, 2, 3],
    "return_prompt_token_ids": True,
    "return_meta_info": True,
    "max_dynamic_patch": 4,
    "min_dynamic_patch": 1,
    "use_audio_in_video": True,
    "task": "title",
    "messages[].content[].type": "image_url",
    "input[].content[].type": "input_image",
    "text.verbosity": "high",
    "reasoning.summary": "auto",
    "reasoning.generate_summary": "concise",
    "max_tool_calls": 3,
    "include": ["message.output_text.logprobs"],
    "top_logprobs": 2,
    "truncation": "auto",
    "background": True,
    "background_options": {"a": 1},
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
    "context_management": [{"type": "compaction"}],
    "image": {"a": 1},
    "access_programs": ["x"],
}


def _unserved(endpoint: str) -> list[str]:
    return [p for p, r in rules(endpoint).items() if r.policy is not IMPLEMENTED]


def test_every_unserved_field_has_a_sample():
    paths = {p for e in ENDPOINTS for p in _unserved(e)}
    assert paths - SAMPLES.keys() == set()


_UNSET = object()


def _body(endpoint: str, path: str, value: object = _UNSET) -> dict[str, Any]:
    """A valid request with ``path`` set to ``value`` (a message or content part made to hold it);
    without a value, the same request without the field."""
    base: dict[str, Any] = {"model": MODEL}
    if endpoint == COMPLETIONS:
        base |= {"prompt": "hello", "max_tokens": 2}
    elif endpoint == CHAT:
        base |= {"messages": [dict(m) for m in USER], "max_tokens": 2}
    else:
        base |= {"input": "hello", "max_output_tokens": 2}
    key = path.rsplit(".", 1)[-1]
    given = value is not _UNSET
    if path.startswith(("messages[].content[].", "input[].content[].")):
        first = {"type": "text" if endpoint == CHAT else "input_text", "text": "hi"}
        part = {"type": value} if key == "type" else {"type": key, key: value}
        content = [first, part] if given else [first]
        base["messages" if endpoint == CHAT else "input"] = [{"role": "user", "content": content}]
    elif path.startswith("messages[]."):
        extra = {key: value} if given else {}
        base["messages"] = [*base["messages"], {"role": "assistant", "content": "ok", **extra}]
    elif "." in path:
        head = path.split(".", 1)[0]
        if given:
            base[head] = {key: value}
            if head == "stream_options":
                base["stream"] = True
    elif given:
        base[path] = value
    return base


def _where(path: str) -> str:
    """The concrete place a refusal names for the sample body of ``path``."""
    if path.startswith(("messages[].content[].", "input[].content[].")):
        return path.split("[]", 1)[0] + ".0.content.1." + path.rsplit(".", 1)[1]
    if path.startswith("messages[]."):
        return "messages.1." + path.rsplit(".", 1)[1]
    return path


CASES = [(e, p) for e in ENDPOINTS for p in _unserved(e)]


@pytest.mark.parametrize(("endpoint", "path"), CASES, ids=[f"{e}:{p}" for e, p in CASES])
def test_unserved_fields_are_ignored_without_effect_or_refused_by_name(app, engine, endpoint, path):
    rule = rules(endpoint)[path]
    assert post(app, PATHS[endpoint], _body(endpoint, path)).status_code == 200
    baseline = engine.sent[-1]
    r = post(app, PATHS[endpoint], _body(endpoint, path, SAMPLES[path]))
    if rule.policy is IGNORED:
        assert r.status_code == 200, r.text
        ids, sp = engine.sent[-1]
        assert (ids, sp) == baseline, f"ignoring {path} changed what the scheduler was sent"
        return
    assert rule.policy is NEUTRAL_ONLY
    refused(r, _where(path), "not supported by this server")
    assert r.json()["error"]["code"] == "unsupported_parameter"
    if path.endswith(".type"):
        return  # the neutral part types are the implemented ones, with fields of their own
    for ok in rule.neutral:
        r = post(app, PATHS[endpoint], _body(endpoint, path, ok))
        assert r.status_code == 200, (ok, r.text)
        assert engine.sent[-1] == baseline


def test_best_of_equal_to_n_passes(app, engine):
    assert (
        post(app, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 2}).status_code
        == 200
    )


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_field_in_no_row_is_refused_by_name(app, engine, endpoint):
    r = post(app, PATHS[endpoint], _body(endpoint, "frobnicate", 1))
    refused(r, "frobnicate", "not supported by this server")


def test_the_table_says_what_each_row_does():
    for r in FIELDS:
        assert r.does and r.origin and r.endpoints, r
        if r.policy is not NEUTRAL_ONLY:
            assert not r.neutral and r.same_as is None, r


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_docs_show_the_table_as_it_is(endpoint):
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    assert markdown_table(endpoint) in docs, (
        "run: python -m radixserve.tokenizer.openai_api.fields docs/api.md"
    )
