"""The OpenAI fields real clients use, end to end through real processes with the official openai SDK:
logprobs (completions' legacy object with echo, chat's content list), penalties and logit_bias,
structured output (response_format, guided_*), tools with the demo model's Hermes-style template,
and gRPC Generate's logprobs. Logprobs are held to the in-process Engine's on the same weights."""

from __future__ import annotations

import json
import math
import re

import grpc
import openai
import pytest
import torch

from radixserve import SamplingParams
from radixserve.common.rpc import pb, pb_grpc
from tests.helpers.cluster import MODEL_NAME

PROMPT = "def add(a, b):"
TOL = 1e-3  # float32 over the wire; the same forward on both sides
CITY = {"type": "string", "enum": ["Paris", "Rome"]}  # bounded: a random model's free text never ends
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        # closed: llguidance lets a schema without additionalProperties: false grow keys without end
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


ONES_AND_TWOS = {"type": "array", "items": {"type": "integer", "enum": [1, 2]}, "maxItems": 3}


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """HF transformers' log-softmax of the teacher-forced logits at every position of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def reference(engine, sp: SamplingParams, prompt: str | None = None, ids: list[int] | None = None) -> dict:
    if ids is not None:
        return engine.generate(input_ids=ids, sampling_params=sp)
    return engine.generate(prompt=prompt if prompt is not None else PROMPT, sampling_params=sp)


# ------------------------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_the_engines_and_hf(cluster, engine, hf, stream):
    ref = reference(engine, SamplingParams(max_new_tokens=12, temperature=0, logprobs=3))
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    if stream:
        chunks = [
            ch.choices[0] for ch in client(cluster).completions.create(**kwargs, stream=True) if ch.choices
        ]
        lps = [c.logprobs for c in chunks if c.logprobs is not None]
        tokens = [t for lp in lps for t in lp.tokens]
        values = [v for lp in lps for v in lp.token_logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
        text = "".join(c.text for c in chunks)
    else:
        choice = client(cluster).completions.create(**kwargs).choices[0]
        tokens, values = choice.logprobs.tokens, choice.logprobs.token_logprobs
        tops, offsets, text = choice.logprobs.top_logprobs, choice.logprobs.text_offset, choice.text
    assert text == ref["text"]
    assert len(tokens) == len(ref["token_ids"]) == 12
    for value, top, (want, _, want_top) in zip(values, tops, ref["output_logprobs"], strict=True):
        assert value == pytest.approx(want, abs=TOL)
        # the 3 alternatives and the chosen token; greedy: the chosen one is the most likely
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(value, abs=TOL)
        assert sorted(top.values(), reverse=True)[: len(want_top)] == pytest.approx(
            want_top[: len(top)], abs=TOL
        )
    assert offsets == sorted(offsets) and offsets[0] == 0
    prompt_ids = engine.tokenizer.encode(PROMPT)
    lp = hf_logprobs(hf, prompt_ids + ref["token_ids"])
    want = [lp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(ref["token_ids"])]
    assert values == pytest.approx(want, abs=1e-4)


def test_echo_scores_the_prompt_as_generation_scored_the_output(cluster, engine, hf):
    """Teacher forcing agrees with generation: the prompt + greedy output, echoed with max_tokens 0,
    scores the output's tokens as generating them did."""
    c = client(cluster)
    gen = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    ids = prompt_ids + reference(engine, SamplingParams(max_new_tokens=8, temperature=0))["token_ids"]
    echo = c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = echo.choices[0]
    assert choice.finish_reason == "length" and echo.usage.completion_tokens == 0
    assert choice.text == engine.tokenizer.decode(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored = lp.token_logprobs[len(prompt_ids) :]
    assert scored == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-2)
    ref = hf_logprobs(hf, ids)
    assert lp.token_logprobs[1:] == pytest.approx(
        [ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4
    )
    # echo with generation: the prompt's tokens first, then the output's
    both = c.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0
    )
    assert both.choices[0].text.startswith(PROMPT)
    assert len(both.choices[0].logprobs.tokens) == len(prompt_ids) + 4
    assert (
        c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True).choices[0].text
        == PROMPT
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_bytes_and_the_alternatives(cluster, engine, stream):
    messages = [{"role": "user", "content": "Add two numbers"}]
    kwargs = dict(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    if stream:
        chunks = list(client(cluster).chat.completions.create(**kwargs, stream=True))
        content = [
            x
            for ch in chunks
            if ch.choices and ch.choices[0].logprobs
            for x in ch.choices[0].logprobs.content
        ]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        r = client(cluster).chat.completions.create(**kwargs)
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert content and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.logprob == pytest.approx(x.top_logprobs[0].logprob, abs=TOL) for x in content)  # greedy
    assert b"".join(bytes(x.bytes) for x in content).decode("utf-8", "replace").startswith(text)


# ---------------------------------------------------------------------------- penalties, bias
def test_logit_bias_forces_and_forbids_tokens(cluster, engine):
    c = client(cluster)
    forced = engine.tokenizer.encode(" x")[-1]
    r = c.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == engine.tokenizer.decode([forced] * 5)
    first = reference(engine, SamplingParams(max_new_tokens=1, temperature=0))["token_ids"][0]
    r = c.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
        logprobs=0,
    )
    assert r.choices[0].logprobs.tokens[0] != engine.tokenizer.decode([first])


def test_penalties_change_a_repetitive_greedy_output(cluster):
    c = client(cluster)
    base = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
    )
    plain = c.completions.create(**base).choices[0].text
    assert c.completions.create(**base, frequency_penalty=2.0).choices[0].text != plain
    assert c.completions.create(**base, presence_penalty=2.0).choices[0].text != plain
    assert (
        c.completions.create(**{**base, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.8}})
        .choices[0]
        .text
        != plain
    )


# -------------------------------------------------------------------------- structured output
def test_response_format_json_schema_is_followed(cluster):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    c = client(cluster)
    r = c.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "ok?"}], max_tokens=40, response_format=rf
    )
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    assert r.choices[0].finish_reason == "stop"
    r = c.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, extra_body={"response_format": rf}
    )
    assert set(json.loads(r.choices[0].text)) == {"ok"}


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": "[0-9]{3}-[a-c]"}, lambda t: re.fullmatch("[0-9]{3}-[a-c]", t) is not None),
        ({"guided_json": ONES_AND_TWOS}, lambda t: set(json.loads(t)) <= {1, 2}),
    ],
)
def test_guided_fields_constrain_the_output(cluster, extra, check):
    for seed in range(3):
        r = client(cluster).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=40, seed=seed, extra_body=extra
        )
        assert check(r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"


def test_bad_constraints_are_typed_400s(cluster):
    c = client(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"guided_regex": "(unclosed"})
    assert e.value.param == "guided_regex"
    with pytest.raises(openai.BadRequestError) as e:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], response_format=rf
        )
    assert e.value.param == "response_format"


# ------------------------------------------------------------------------------------- tools
def test_a_forced_tool_call_comes_back_and_round_trips(cluster):
    c = client(cluster)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=60
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # the SDK's own message object goes back as history, with the tool's answer
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def streamed_calls(chunks: list) -> dict[int, dict]:
    """The tool calls of a streamed choice, from their deltas (id and name in a call's first)."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
    return calls


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_stream_as_deltas(cluster, tool_choice):
    chunks = list(
        client(cluster).chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            tool_choice=tool_choice,
            max_tokens=120,
            stream=True,
        )
    )
    calls = streamed_calls(chunks)
    assert calls and all(c["name"] == "get_weather" and c["id"] for c in calls.values())
    assert all(json.loads(c["arguments"])["city"] in ("Paris", "Rome") for c in calls.values())
    reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    # named: exactly one call, then the grammar ends the output; required allows several (hermes), and
    # a random model may go on calling until max_tokens
    assert reason == "tool_calls" if isinstance(tool_choice, dict) else reason in ("tool_calls", "length")


# -------------------------------------------------------------------------------------- gRPC
def test_grpc_generate_carries_logprobs(cluster, engine):
    ref = reference(engine, SamplingParams(max_new_tokens=6, temperature=0, logprobs=2))
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        req = pb.GenerateRequest(
            text=PROMPT,
            sampling=pb.SamplingParams(max_new_tokens=6, temperature=0, logprobs=2, prompt_logprobs=0),
        )
        (msg,) = list(pb_grpc.GatewayStub(ch).Generate(req, timeout=60))
    assert list(msg.token_ids) == ref["token_ids"]
    assert list(msg.logprobs.logprob) == pytest.approx([x[0] for x in ref["output_logprobs"]], abs=TOL)
    assert [list(t.token_ids) for t in msg.logprobs.top] == [x[1] for x in ref["output_logprobs"]]
    assert len(msg.prompt_logprobs.logprob) == len(engine.tokenizer.encode(PROMPT))
    assert math.isnan(msg.prompt_logprobs.logprob[0])
