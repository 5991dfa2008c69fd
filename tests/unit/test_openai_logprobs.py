"""Logprobs bodies at the gateway: OpenAI's legacy completions object (echo included) and the chat
object (bytes, alternatives), streamed and not, and gRPC Generate's pass-through; token texts and
bytes from the vocabulary. Hand-made deliveries through the real app (tests/helpers/gateway.py's
scripted schedulers), and the pure pieces directly. Also the work done once per request (tool validation, the
constraint, its compilation through the grammar cache) and gRPC's checks before a compile."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from radixserve.common.rpc import pb
from radixserve.common.sampling import SamplingParams
from radixserve.tokenizer.openai_api import bodies as resp
from radixserve.tokenizer.text.token_pieces import TokenPieces, shown
from tests.helpers.gateway import (
    WEATHER,
    chat,
    complete,
    events,
    logprobs,
    refused,
    strict_json,
    text,
)


# ---------------------------------------------------------------------------- logprobs bodies
class FakePieces:
    """Token i is the letter chr(ord('a') + i); 100 and 101 the two halves of "é"."""

    def piece(self, token_id: int) -> tuple[str, bytes]:
        raw = {100: b"\xc3", 101: b"\xa9"}.get(token_id, bytes([ord("a") + token_id % 26]))
        return shown(raw), raw


def test_completion_logprobs_body_nulls_nan_and_keeps_the_chosen_token_in_top():
    lp = logprobs([math.nan, -0.5, -math.inf], [[], [(3, -0.1), (1, -0.5)], [(0, -0.01)]])
    tokens = resp.scored([0, 1, 2], lp)
    out = resp.completion_logprobs(tokens, FakePieces(), resp.TextOffsets())
    assert out == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -0.5, resp.IMPOSSIBLE],
        "top_logprobs": [
            None,
            {"d": pytest.approx(-0.1), "b": -0.5},
            {"a": pytest.approx(-0.01), "c": resp.IMPOSSIBLE},
        ],
        "text_offset": [0, 1, 2],
    }
    strict_json(json.dumps(out))


def test_text_offsets_count_a_split_character_once():
    offsets = resp.TextOffsets(start=5)
    assert [offsets.take(b) for b in (b"x", b"\xc3", b"\xa9", b"y")] == [5, 6, 6, 7]


def test_chat_logprobs_body_has_bytes_and_exactly_the_alternatives():
    lp = logprobs([-0.2, -1.0], [[(100, -0.2), (3, -2.0)], [(101, -1.0), (4, -3.0)]])
    out = resp.chat_logprobs(resp.scored([100, 101], lp), FakePieces())
    assert out[0] == {
        "token": "bytes:\\xc3",
        "logprob": pytest.approx(-0.2),
        "bytes": [0xC3],
        "top_logprobs": [
            {"token": "bytes:\\xc3", "logprob": pytest.approx(-0.2), "bytes": [0xC3]},
            {"token": "d", "logprob": -2.0, "bytes": [ord("d")]},
        ],
    }
    assert bytes(out[0]["bytes"] + out[1]["bytes"]).decode() == "é"


def test_token_pieces_give_each_tokens_true_bytes(gw):
    pieces = TokenPieces(gw.tokenizer)
    s = "héllo wörld, 你好 <|im_end|>"
    ids = gw.tokenizer.encode(s)
    assert b"".join(pieces.piece(i)[1] for i in ids) == s.encode()
    assert any(pieces.piece(i)[0].startswith("bytes:") for i in ids)  # a CJK character split in two
    im_end = gw.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert pieces.piece(im_end) == ("<|im_end|>", b"<|im_end|>")


def prompt_scores(ids: list[int]) -> pb.Logprobs:
    return logprobs([math.nan] + [-1.5] * (len(ids) - 1), [[]] + [[(5, -0.25)]] * (len(ids) - 1))


def test_completion_echo_with_logprobs_scores_prompt_then_completion(app, gw, engine):
    engine.script = lambda k, ids, sp: [
        text(
            " wor",
            [10, 11],
            lp=logprobs([-0.1, -0.2], [[(10, -0.1)], [(12, -0.05)]]),
            prompt=prompt_scores(ids),
        ),
        text("ld", [13], "length", lp=logprobs([-0.3], [[(13, -0.3)]])),
    ]
    r = complete(app, prompt="héllo", echo=True, logprobs=1, max_tokens=3)
    body = strict_json(r.text)
    choice = body["choices"][0]
    assert choice["text"] == "héllo wor" + "ld"
    lp = choice["logprobs"]
    n_prompt = len(gw.encode("héllo"))
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n_prompt] == [-1.5] * (n_prompt - 1)
    assert lp["text_offset"][:n_prompt][0] == 0
    assert lp["text_offset"][n_prompt:] == [
        5,
        5 + len(lp["tokens"][n_prompt]),
        5 + len(lp["tokens"][n_prompt]) + len(lp["tokens"][n_prompt + 1]),
    ]
    assert set(lp["top_logprobs"][n_prompt + 1]) == {gw.text.pieces.piece(12)[0], gw.text.pieces.piece(11)[0]}


def test_streamed_completion_logprobs_continue_their_offsets(app, gw, engine):
    engine.script = lambda k, ids, sp: [
        text("ab", [40, 41], lp=logprobs([-0.1, -0.2])),
        text("c", [42], lp=logprobs([-0.3])),
        text("", [], "stop"),
    ]
    chunks = events(complete(app, logprobs=0, stream=True))
    lps = [c["choices"][0]["logprobs"] for c in chunks]
    a, b = (len(gw.text.pieces.piece(i)[0]) for i in (40, 41))
    assert [lp["text_offset"] for lp in lps if lp] == [[0, a], [a + b]]
    assert lps[-1] is None and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs_non_streamed_and_streamed(app, gw, engine):
    engine.script = lambda k, ids, sp: [
        text("ab", [40, 41], lp=logprobs([-0.1, -0.2], [[(40, -0.1), (42, -3.0)], [(41, -0.2), (43, -4.0)]])),
        text("", [], "stop", lp=logprobs([])),
    ]
    choice = chat(app, logprobs=True, top_logprobs=2).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [gw.text.pieces.piece(40)[0], gw.text.pieces.piece(41)[0]]
    assert content[0]["bytes"] == list(gw.text.pieces.piece(40)[1])
    assert [len(c["top_logprobs"]) for c in content] == [2, 2]
    chunks = events(chat(app, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    assert chat(app).json()["choices"][0]["logprobs"] is None


def test_grpc_generate_passes_logprobs_through():
    from radixserve.tokenizer.grpc_api import _response
    from radixserve.tokenizer.session import Output, Usage

    class Session:
        rid = "r"

        def usage(self) -> Usage:
            return Usage(3, 2, 0)

    whole = pb.GenerateResponse()
    first = Output(0, "a", [1], None, logprobs([-0.5], [[(1, -0.5)]]), prompt_scores([1, 2, 3]))
    _response(Session(), first, whole)  # type: ignore[arg-type]
    done = _response(Session(), Output(0, "b", [2], "stop", logprobs([-0.25])), whole)  # type: ignore[arg-type]
    assert (list(done.token_ids), done.finish_reason) == ([1, 2], "stop")
    assert list(done.logprobs.logprob) == [-0.5, -0.25]
    assert list(done.logprobs.top[0].token_ids) == [1]
    assert math.isnan(done.prompt_logprobs.logprob[0]) and len(done.prompt_logprobs.logprob) == 3
    assert done.usage.completion_tokens == 2
    plain = _response(Session(), Output(0, "a", [1], "stop"), pb.GenerateResponse())  # type: ignore[arg-type]
    assert not plain.HasField("logprobs") and not plain.HasField("prompt_logprobs")


# ----------------------------------------------------------------------- once per request
def test_validation_and_the_constraint_run_once_per_request(app, engine, monkeypatch):
    from radixserve.tokenizer.openai_api import app as http_app
    from radixserve.tokenizer.openai_api import chat_request
    from radixserve.tokenizer.openai_api import requests as openai_api
    from radixserve.tokenizer.text import tool_grammar

    calls = {"validate_tools": 0, "constraint": 0}
    real_validate, real_constraint = tool_grammar.validate_tools, openai_api._Sampling.constraint

    def validate(tools: list[dict[str, Any]]) -> None:
        calls["validate_tools"] += 1
        real_validate(tools)

    def constraint(self: openai_api._Sampling) -> Any:
        calls["constraint"] += 1
        return real_constraint(self)

    for module in (http_app, openai_api, chat_request, tool_grammar):
        monkeypatch.setattr(module, "validate_tools", validate, raising=False)
    monkeypatch.setattr(openai_api._Sampling, "constraint", constraint)
    assert chat(app, tools=[WEATHER], tool_choice="required").status_code == 200
    assert complete(app, guided_regex="[a-z]{2}").status_code == 200
    assert calls == {"validate_tools": 1, "constraint": 2}  # one each: the chat's and the completion's


def test_a_repeated_constraint_is_compiled_once(app, engine, monkeypatch):
    """The gateway's check goes through the grammar backend's cache: the second request with the same
    schema costs a lookup, not llguidance's work again."""
    from radixserve.scheduler import grammar

    prepared: list[str] = []
    real = grammar._prepare

    def prepare(tokenizer: Any, width: int, c: Any) -> Any:
        prepared.append(c.spec)
        return real(tokenizer, width, c)

    monkeypatch.setattr(grammar, "_prepare", prepare)
    for _ in range(3):
        assert complete(app, guided_regex="(once)+[0-9]").status_code == 200
    assert prepared == ["(once)+[0-9]"]
    refused(complete(app, guided_regex="(bad"), "guided_regex", "regex")  # llguidance's reason, still


def test_grpc_generate_validates_before_the_constraint_is_compiled(gw, monkeypatch):
    """The spec's size limit (and every other range) holds before llguidance sees the spec."""
    from radixserve.common.sampling import MAX_CONSTRAINT_CHARS, Constraint
    from radixserve.tokenizer.errors import ApiError
    from radixserve.tokenizer.grpc_api import GatewayService

    async def compiled(c: Constraint, param: str) -> None:
        raise AssertionError("the constraint reached llguidance")

    monkeypatch.setattr(gw.text, "check_constraint", compiled)
    service = GatewayService(gw)
    huge = Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))
    for sp, param in [
        (SamplingParams(max_new_tokens=4, constraint=huge), "constraint"),
        (
            SamplingParams(max_new_tokens=4, ignore_eos=True, constraint=Constraint("regex", "a")),
            "ignore_eos",
        ),
        (SamplingParams(max_new_tokens=4, logit_bias=((2048, 1.0),)), "logit_bias"),
    ]:
        with pytest.raises(ApiError) as e:
            asyncio.run(service._check_sampling(sp))
        assert (e.value.status, e.value.param) == (400, param)
