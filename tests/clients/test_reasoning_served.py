"""--reasoning-parser qwen3 on the served cluster: a thinking model's <think> block comes back as
reasoning_content (whole and streamed, before the answer) while a JSON schema constrains the answer
only. The random-weight model is steered into and out of its reasoning with logit_bias on the two
think tokens (a strong bias on <think>, a mild one on </think>), sampled with fixed seeds."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.helpers.cluster import MODEL_NAME

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


def body(seed: int, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "The weather?"}],
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        "logit_bias": {"2048": 100, "2049": 6},  # <think>, </think> (the demo's added tokens)
        **extra,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reasoning_is_split_off_and_the_schema_binds_the_answer(served, seed):
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body(seed), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    assert message["reasoning_content"], "the model was steered into reasoning first"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    # the same text with the reasoning left in place (SGLang's separate_reasoning: false)
    whole = httpx.post(
        f"{served.url}/v1/chat/completions", json=body(seed, separate_reasoning=False), timeout=120
    )
    text = whole.json()["choices"][0]["message"]["content"]
    assert text.startswith("<think>" + message["reasoning_content"] + "</think>")
    assert text.endswith(message["content"])


def test_streamed_reasoning_comes_before_the_answer(served):
    deltas = []
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json=body(1, stream=True), timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"])
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds[0] == "reasoning_content" and kinds[-1] == "content"
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "reasoning and answer interleaved"
    jsonschema.validate(json.loads("".join(d.get("content", "") for d in deltas)), SCHEMA)
