"""Structured outputs through the real server and the official openai SDK: 50 different JSON schemas
(nested objects, arrays, enums, required fields), streamed and not, sent at once together with free
requests, so constrained and unconstrained requests share batches. A random-weight model's output
must still parse and validate every time: the grammar, not the model, guarantees it."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import openai

from tests.helpers.cluster import MODEL_NAME

N_SCHEMAS = 50


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["int", "enum", "str", "bool", "num"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, True, None], rng.randint(1, 4))}
    if kind == "str":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "num":
        return {"type": "number", "minimum": 0, "maximum": 1}
    return {"type": "boolean"}


def schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 fields: leaves, nested objects, bounded arrays; some fields required."""
    props = {}
    for i in range(rng.randint(1, 4)):
        pick = rng.random()
        if pick < 0.2 and depth < 2:
            props[f"obj{i}"] = schema(rng, depth + 1)
        elif pick < 0.4:
            props[f"list{i}"] = {"type": "array", "items": leaf(rng), "maxItems": rng.randint(1, 3)}
        else:
            props[f"f{i}"] = leaf(rng)
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


async def constrained(client: openai.AsyncOpenAI, s: dict, i: int, stream: bool) -> str:
    args = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"Give me object number {i} as JSON."}],
        max_tokens=256,
        temperature=1.0,
        seed=i,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": s, "strict": True},
        },
    )
    if not stream:
        r = await client.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content or ""
    parts, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    return "".join(parts)


async def free(client: openai.AsyncOpenAI, i: int) -> str:
    r = await client.completions.create(
        model=MODEL_NAME, prompt=f"free text {i}", max_tokens=40, temperature=1.0
    )
    return r.choices[0].text


def test_fifty_json_schemas_validate_streamed_and_not_beside_free_requests(cluster):
    rng = random.Random(23)
    distinct: dict[str, dict] = {}
    while len(distinct) < N_SCHEMAS:
        s = schema(rng)
        distinct.setdefault(json.dumps(s, sort_keys=True), s)
    schemas = list(distinct.values())

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0
        ) as client:
            jobs = [constrained(client, s, i, stream=i % 2 == 1) for i, s in enumerate(schemas)]
            frees = [free(client, i) for i in range(20)]
            results = await asyncio.gather(*jobs, *frees)
        return list(results[:N_SCHEMAS]), list(results[N_SCHEMAS:])

    texts, free_texts = asyncio.run(run())
    for s, text in zip(schemas, texts, strict=True):
        jsonschema.validate(json.loads(text), s)
    assert any(not t.lstrip().startswith("{") for t in free_texts)  # free requests stayed free
