"""Structured outputs (scheduler/grammar.py): random walks through the allowed tokens always give
valid output, bad constraints give GrammarError, compile is cached and off-thread, the bitmask is
applied exactly, and stop tokens / ids past the tokenizer follow the engine's rules."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from radixserve.common.demo_model import build_tokenizer
from radixserve.common.sampling import Constraint
from radixserve.scheduler import grammar
from radixserve.scheduler.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    fill_masks,
    mask_width,
)

TOK_VOCAB = 2048  # the demo tokenizer's
MODEL_VOCAB = 2100  # wider than the tokenizer, and not a multiple of 32
ENDOFTEXT, IM_END = 0, 4  # the demo tokenizer's <|endoftext|> and <|im_end|> (its eos_token)
EOS = (ENDOFTEXT, IM_END)
CAP = 300  # tokens per sample


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, MODEL_VOCAB, EOS)
    yield b
    b.close()


def _allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    words = bitmask[row].tolist()
    return {32 * w + i for w, word in enumerate(words) for i in range(32) if (word >> i) & 1}


def _generate(
    backend: GrammarBackend, c: Constraint, gen: torch.Generator, tokenizer
) -> tuple[str, GrammarMatcher]:
    """Sample uniformly among the allowed tokens until done (or CAP); the text without stop tokens."""
    m = backend.matcher(backend.compile(c).result(timeout=10))
    bitmask = allocate_bitmask(1, backend.vocab_size)
    out: list[int] = []
    for _ in range(CAP):
        if m.done:
            break
        # A garbage row beforehand: fill_mask must write every word.
        bitmask.random_(generator=gen)
        m.fill_mask(bitmask, 0)
        logits = torch.zeros(1, backend.vocab_size)
        apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        assert m.accept(token), f"the grammar refused a token its own mask allowed: {m.error}"
        out.append(token)
    assert m.done, f"not done after {CAP} tokens: {tokenizer.decode(out)!r}"
    assert m.error is None
    return tokenizer.decode([t for t in out if t not in EOS]), m


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "note": {"type": ["string", "null"], "maxLength": 5},
        },
        "required": ["color"],
        "additionalProperties": False,
    },
    "bounds": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -50, "maximum": 50},
            "k": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9999},
            "code": {"type": "string", "minLength": 2, "maxLength": 3},
        },
        "required": ["n", "k", "code"],
        "additionalProperties": False,
    },
    "list_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["id"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_random_walks_validate(backend, tokenizer, name):
    schema = SCHEMAS[name]
    c = Constraint("json_schema", json.dumps(schema))
    gen = torch.Generator().manual_seed(1234)
    for _ in range(8):
        text, _ = _generate(backend, c, gen, tokenizer)
        jsonschema.validate(json.loads(text), schema)
        # Compact JSON: whitespace only inside strings, so re-serialising compactly gives the text back.
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


def test_json_object_takes_objects_only(backend, tokenizer):
    g = backend.compile(Constraint("json_object")).result(timeout=10)
    m = backend.matcher(g)
    assert not m.accept(tokenizer.encode("[")[0])
    assert m.error
    m = backend.matcher(g)
    for t in tokenizer.encode('{"a":[1,{"b":null}],"c":"d"}'):
        assert m.accept(t)
    assert m.done


@pytest.mark.parametrize(
    "pattern",
    [
        r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)",
        r"[0-9]{3}-[0-9]{4}",
        r"(yes|no)( maybe)?",
        r"\(x[+*]y\)=[0-9]{1,3}",
    ],
)
def test_regex_random_walks_fullmatch(backend, tokenizer, pattern):
    c = Constraint("regex", pattern)
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        text, _ = _generate(backend, c, gen, tokenizer)
        assert re.fullmatch(pattern, text), text


CHOICES = ["red", "green", "ab", "abcd", 'say "hi"', "a|b", "back\\slash", "é\n", "🙂!", ""]


def test_choice_random_walks_are_members(backend, tokenizer):
    c = Constraint("choice", json.dumps(CHOICES))
    gen = torch.Generator().manual_seed(99)
    seen = set()
    for _ in range(60):
        text, _ = _generate(backend, c, gen, tokenizer)
        assert text in CHOICES
        seen.add(text)
    assert len(seen) >= 4  # the walk explores, it is not stuck on one branch


def test_lark_with_embedded_json(backend, tokenizer):
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    c = Constraint("lark", f'start: name "(" %json{json.dumps(schema)} ")"\nname: /[a-z]{{1,5}}/')
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        text, _ = _generate(backend, c, gen, tokenizer)
        match = re.fullmatch(r"([a-z]{1,5})\((.*)\)", text)
        assert match, text
        jsonschema.validate(json.loads(match.group(2)), schema)


INVALID = [
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
    (Constraint("json_schema", '{"type": "foo"}'), "foo"),
    (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'), "no-such-format"),
    (Constraint("regex", "a(b"), "unclosed group"),
    (Constraint("choice", "red, green"), "JSON list of strings"),
    (Constraint("choice", '["red", 2]'), "JSON list of strings"),
    (Constraint("choice", "[]"), "empty"),
    (Constraint("lark", "start: nowhere"), "nowhere"),
    (Constraint("yaml", "a: b"), "unknown constraint kind"),
    (Constraint("regex", "a\ud800"), "Unicode"),
]


@pytest.mark.parametrize(("c", "why"), INVALID, ids=[f"{c.kind}-{i}" for i, (c, _) in enumerate(INVALID)])
def test_invalid_constraints(backend, c, why):
    with pytest.raises(GrammarError, match=re.escape(why)):
        backend.check(c)
    err = backend.compile(c).exception(timeout=10)
    assert isinstance(err, GrammarError)
    assert why in str(err)


def test_valid_constraints_pass_check(backend):
    for c in [
        Constraint("json_object"),
        Constraint("json_schema", json.dumps(SCHEMAS["nested"])),
        Constraint("regex", "[0-9]+"),
        Constraint("choice", json.dumps(CHOICES)),
        Constraint("lark", 'start: "a" | "b"'),
    ]:
        backend.check(c)


def test_compile_is_cached_and_off_thread(tokenizer, monkeypatch):
    threads: list[int] = []
    real = grammar._prepare

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(grammar, "_prepare", spy)
    b = GrammarBackend(tokenizer, MODEL_VOCAB, EOS, cache_size=2)
    try:
        a = Constraint("regex", "[a-c]+")
        fa = b.compile(a)
        ga = fa.result(timeout=10)
        assert b.compile(Constraint("regex", "[a-c]+")) is fa  # an equal constraint, not the same object
        assert fa.done()
        assert threads and threading.get_ident() not in threads
        assert len(threads) == 1

        bad = Constraint("regex", "(")
        fbad = b.compile(bad)
        assert isinstance(fbad.exception(timeout=10), GrammarError)
        assert b.compile(bad) is fbad  # a GrammarError is cached too
        assert len(threads) == 2

        # cache_size 2: a third constraint evicts the least recently used (a: `bad` was used last).
        b.compile(Constraint("regex", "x")).result(timeout=10)
        fa2 = b.compile(a)
        assert fa2 is not fa and fa2.result(timeout=10) is not ga
        assert len(threads) == 4
    finally:
        b.close()


def test_unexpected_compile_failures_are_not_cached(tokenizer, monkeypatch):
    calls = []
    real = grammar._prepare

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return real(*args)

    monkeypatch.setattr(grammar, "_prepare", flaky)
    b = GrammarBackend(tokenizer, MODEL_VOCAB, EOS)
    try:
        c = Constraint("regex", "z+")
        f1 = b.compile(c)
        assert isinstance(f1.exception(timeout=10), RuntimeError)
        f2 = b.compile(c)
        assert f2 is not f1
        assert f2.result(timeout=10).constraint == c
    finally:
        b.close()


def _reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(out.shape[0]):
        words = bitmask[r].tolist()
        for t in range(out.shape[1]):
            w, i = divmod(t, 32)
            if w >= len(words) or not (words[w] >> i) & 1:
                out[r, t] = float("-inf")
    return out


def _random_bitmask(gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (rows, width), generator=gen, dtype=torch.int64).to(torch.int32)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("vocab", "width"), [(1, 1), (31, 1), (33, 2), (100, 4), (257, 9), (90, 2), (2100, 66)]
)
def test_apply_bitmask_matches_reference(device, vocab, width):
    gen = torch.Generator().manual_seed(vocab * 100 + width)
    bitmask = _random_bitmask(gen, 3, width)
    bitmask[1] = -1  # an unconstrained row
    bitmask[2, 0] = 0  # a word with no bits
    logits = torch.randn(3, vocab, generator=gen)
    expected = _reference_apply(logits, bitmask)
    got = logits.to(device)
    apply_bitmask(got, bitmask.to(device))
    assert torch.equal(got.cpu(), expected)
    assert torch.isinf(expected).any()  # the check can see a wrong mask


def test_unpack_big_endian_memory():
    """On a big-endian host llguidance writes the words' bytes the other way round."""
    gen = torch.Generator().manual_seed(5)
    bitmask = _random_bitmask(gen, 2, 5)
    swapped = torch.from_numpy(bitmask.numpy().byteswap())
    expected = grammar._blocked(bitmask, 150, "little")
    assert torch.equal(grammar._blocked(swapped, 150, "big"), expected)
    assert not torch.equal(grammar._blocked(swapped, 150, "little"), expected)


def test_mask_geometry():
    assert [mask_width(v) for v in (1, 32, 33, 2048, 2100)] == [1, 1, 2, 64, 66]
    bm = allocate_bitmask(3, 2100)
    assert bm.shape == (3, 66) and bm.dtype == torch.int32 and bm.device.type == "cpu"
    assert bool((bm == -1).all())


def _mask(m: GrammarMatcher, vocab: int) -> set[int]:
    bm = allocate_bitmask(1, vocab)  # all bits set: anything fill_mask leaves would show
    m.fill_mask(bm, 0)
    return _allowed(bm)


@pytest.mark.parametrize("vocab", [MODEL_VOCAB, 2040, 2000])  # wider, narrower (same width, fewer words)
def test_stop_tokens_and_vocab_edges(tokenizer, vocab):
    b = GrammarBackend(tokenizer, vocab, EOS)
    try:
        limit = min(vocab, TOK_VOCAB)
        g = b.compile(Constraint("choice", json.dumps(["ab", "abcd"]))).result(timeout=10)
        m = b.matcher(g)
        start = _mask(m, vocab)
        assert start and max(start) < limit
        assert not start & set(EOS)  # "" is no choice: nothing may end yet

        for t in tokenizer.encode("ab"):
            assert m.accept(t)
        accepting = _mask(m, vocab)  # "ab" is complete, "abcd" goes on
        assert set(EOS) <= accepting and accepting - set(EOS)
        assert max(accepting) < limit
        assert not m.done

        for t in tokenizer.encode("cd"):
            assert m.accept(t)
        assert m.done  # nothing can follow "abcd": done without a stop token
        assert _mask(m, vocab) == set(EOS)
        assert m.accept(IM_END)  # a stop token after the end is fine
        assert not m.accept(tokenizer.encode("x")[0])

        # Any text: every allowed id is a real token of both the tokenizer and the model.
        m = b.matcher(b.compile(Constraint("regex", "(?s:.*)")).result(timeout=10))
        anything = _mask(m, vocab)
        assert max(anything) < limit
        # Nearly the whole vocab: not the special tokens, nor the bytes that cannot start a character.
        assert len(anything) > limit - 100
        assert set(EOS) <= anything
    finally:
        b.close()


def test_engine_stop_tokens_replace_the_tokenizers_eos(tokenizer):
    """The tokenizer's eos_token is <|im_end|>; an engine that stops at <|endoftext|> alone must see
    only that one allowed at the end."""
    b = GrammarBackend(tokenizer, MODEL_VOCAB, [ENDOFTEXT, 99999])  # 99999: past the vocab, ignored
    try:
        assert b.eos_token_ids == (ENDOFTEXT,)
        m = b.matcher(b.compile(Constraint("regex", "a+")).result(timeout=10))
        assert m.accept(tokenizer.encode("a")[0])
        allowed = _mask(m, MODEL_VOCAB)
        assert ENDOFTEXT in allowed and IM_END not in allowed
        assert not m.accept(IM_END)
        assert m.error and not m.done
        assert _mask(m, MODEL_VOCAB) == {ENDOFTEXT}  # failed: only the stop token can follow
    finally:
        b.close()


def test_stop_token_ends_when_accepting(backend, tokenizer):
    g = backend.compile(Constraint("regex", "a+")).result(timeout=10)
    m = backend.matcher(g)
    assert not m.accept(ENDOFTEXT)  # nothing yet: "" does not match a+
    m = backend.matcher(g)
    assert m.accept(tokenizer.encode("a")[0]) and not m.done
    assert m.accept(ENDOFTEXT) and m.done and m.error is None


def test_fill_masks_equals_fill_mask(backend, tokenizer):
    constraints = [
        Constraint("json_schema", json.dumps(SCHEMAS["nested"])),
        Constraint("regex", "[0-9]{2,4}"),
        Constraint("choice", json.dumps(["ab", "abcd"])),
        Constraint("json_object"),
    ]
    prefixes = ['{"user":{"na', "12", "ab", ""]
    pairs = []
    for c, p in zip(constraints, prefixes, strict=True):
        m1 = backend.matcher(backend.compile(c).result(timeout=10))
        m2 = backend.matcher(backend.compile(c).result(timeout=10))
        for t in tokenizer.encode(p) if p else []:
            assert m1.accept(t) and m2.accept(t)
        pairs.append((m1, m2))
    rows = [4, 0, 2, 5]
    batch = allocate_bitmask(6, MODEL_VOCAB)
    fill_masks([(r, m1) for r, (m1, _) in zip(rows, pairs, strict=True)], batch)
    single = allocate_bitmask(6, MODEL_VOCAB)
    for r, (_, m2) in zip(rows, pairs, strict=True):
        m2.fill_mask(single, r)
    assert torch.equal(batch, single)
    assert bool((batch[1] == -1).all()) and bool((batch[3] == -1).all())  # other rows untouched
    assert len({tuple(batch[r].tolist()) for r in rows}) == 4


def test_bad_bitmask_is_refused(backend):
    m = backend.matcher(backend.compile(Constraint("regex", "a")).result(timeout=10))
    with pytest.raises(ValueError):
        m.fill_mask(allocate_bitmask(1, TOK_VOCAB), 0)  # the tokenizer's width, not the model's
    with pytest.raises(ValueError):
        m.fill_mask(torch.zeros(1, mask_width(MODEL_VOCAB), dtype=torch.int64), 0)
    with pytest.raises(IndexError):
        m.fill_mask(allocate_bitmask(1, MODEL_VOCAB), 1)


def test_from_model_dir(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    b = GrammarBackend.from_model_dir(tmp_path, MODEL_VOCAB, EOS)
    try:
        m = b.matcher(b.compile(Constraint("choice", '["yes"]')).result(timeout=10))
        for t in tokenizer.encode("yes"):
            assert m.accept(t)
        assert m.done
    finally:
        b.close()
