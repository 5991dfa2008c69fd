"""Structured outputs in the engine: constrained and free requests share batches, with the overlap
loop, chunked prefill, the radix cache and retraction; every constrained output validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve import Engine, SamplingParams
from radixserve.common.sampling import Constraint

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"enum": ["left", "right"]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
]
PROMPT = "Answer in JSON: "


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("qwen2")


def constrained(schema: dict, seed: int) -> SamplingParams:
    c = Constraint("json_schema", json.dumps(schema))
    return SamplingParams(max_new_tokens=100, temperature=1.0, seed=seed, constraint=c)


@pytest.mark.parametrize(
    ("overlap", "pool", "chunk"),
    [(False, 4096, 0), (True, 4096, 8), (True, 128, 0)],
    ids=["normal", "overlap-chunked", "retracting"],
)
def test_constrained_outputs_validate_in_mixed_batches(model_dir, overlap, pool, chunk):
    params, prompts = [], []
    for i in range(12):
        params.append(constrained(SCHEMAS[i % len(SCHEMAS)], seed=i))
        prompts.append(PROMPT + str(i))
        params.append(
            SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        )  # free, in the same batches
        prompts.append(PROMPT)
    with Engine(
        model_dir, max_total_tokens=pool, init_new_token_ratio=0.0 if pool < 1000 else 0.7,
        max_running_requests=8, disable_overlap=not overlap, cpu_overlap_thread_min_ms=0,
        chunked_prefill_size=chunk,
    ) as engine:  # fmt: skip
        free_alone = engine.generate(prompt=PROMPT, sampling_params=params[1])
        outs = engine.generate(prompt=prompts, sampling_params=params)
        if pool < 1000:
            assert engine.scheduler.num_retractions > 0
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
    for i, o in enumerate(outs[0::2]):
        assert o["finish_reason"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), SCHEMAS[i % len(SCHEMAS)])
    assert all(o["token_ids"] == free_alone["token_ids"] for o in outs[1::2])  # unaffected by the masks


def test_regex_and_choice_constraints(model_dir):
    with Engine(model_dir, max_total_tokens=4096) as engine:
        outs = engine.generate(
            prompt=[PROMPT] * 6,
            sampling_params=[
                SamplingParams(
                    max_new_tokens=40,
                    temperature=1.0,
                    seed=s,
                    constraint=Constraint("regex", r"[a-c]{2,5}-\d{3}"),
                )
                for s in range(3)
            ]
            + [
                SamplingParams(
                    max_new_tokens=40,
                    temperature=1.0,
                    seed=s,
                    constraint=Constraint("choice", '["yes", "no", "maybe so"]'),
                )
                for s in range(3)
            ],
        )
    for o in outs[:3]:
        assert re.fullmatch(r"[a-c]{2,5}-\d{3}", o["text"]), o["text"]
    for o in outs[3:]:
        assert o["text"] in ("yes", "no", "maybe so")


def test_an_invalid_constraint_is_refused_and_the_engine_keeps_serving(model_dir):
    with Engine(model_dir, max_total_tokens=4096) as engine:
        with pytest.raises(ValueError, match=r"(?i)schema|json|type"):
            engine.generate(
                prompt=PROMPT,
                sampling_params=SamplingParams(
                    constraint=Constraint("json_schema", '{"type": "no-such-type"}')
                ),
            )
        with pytest.raises(ValueError, match="ignore_eos"):
            engine.generate(
                prompt=PROMPT,
                sampling_params=SamplingParams(ignore_eos=True, constraint=Constraint("json_object")),
            )
        with pytest.raises(ValueError, match="max_new_tokens"):  # scoring a prompt has nothing to constrain
            engine.generate(
                prompt=PROMPT,
                sampling_params=SamplingParams(
                    max_new_tokens=0, prompt_logprobs=1, constraint=Constraint("json_object")
                ),
            )
        out = engine.generate(prompt=PROMPT, sampling_params=SamplingParams(max_new_tokens=4))
        assert len(out["token_ids"]) >= 1
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


def test_a_token_the_grammar_refuses_ends_the_request_without_it(model_dir, monkeypatch):
    """The mask makes this impossible; should the grammar still refuse a token (a bug), the request
    ends aborted without it rather than run on unconstrained."""
    from radixserve.scheduler.grammar import GrammarMatcher

    accept = GrammarMatcher.accept
    calls = {"n": 0}

    def refuse_the_third(self, token):
        calls["n"] += 1
        return False if calls["n"] == 3 else accept(self, token)

    monkeypatch.setattr(GrammarMatcher, "accept", refuse_the_third)
    with Engine(model_dir, max_total_tokens=4096) as engine:
        out = engine.generate(
            prompt=PROMPT,
            sampling_params=SamplingParams(
                max_new_tokens=50, temperature=1.0, seed=0, constraint=Constraint("regex", "[a-z]{10,20}")
            ),
        )
        assert out["finish_reason"] == "abort" and len(out["token_ids"]) == 2
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
