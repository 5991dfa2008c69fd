"""IncrementalDetokenizer with the demo model's byte-level BPE: what is streamed adds up to a full
decode, multi-byte characters are never sent half, stop strings cut and end, nothing leaks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.detokenizer.incremental import LOST_START, IncrementalDetokenizer, RequestTokens, TextDelta

FFFD = "\ufffd"
IM_START, IM_END = 3, 4
TEXTS = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld — 日本語 🙂 emoji",
    "   leading spaces\n\n\ttabs and\r\nnewlines\n",
    "🙂🙂🙂 日本 ü ß Ω ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


@pytest.fixture(scope="module")
def tok(demo_model):
    return AutoTokenizer.from_pretrained(demo_model("llama"))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def first(rid: str, ids, stop=(), skip=True, finish="", **kw) -> RequestTokens:
    """A request's first entry: it carries the options (stop is not None)."""
    return RequestTokens(rid, "gw", list(ids), finish, stop=tuple(stop), skip_special_tokens=skip, **kw)


def more(rid: str, ids, finish="", error="") -> RequestTokens:
    return RequestTokens(rid, "gw", list(ids), finish, error)


def stream(detok, rid, chunks, stop=(), skip=True, finish="length") -> list[TextDelta]:
    """One request alone, one process() call per chunk; the last chunk ends it with ``finish``."""
    out = []
    for i, c in enumerate(chunks):
        end = finish if i == len(chunks) - 1 else ""
        u = first(rid, c, stop, skip, end) if i == 0 else more(rid, c, end)
        got = detok.process([u])
        assert len(got) <= 1
        out += got
    return out


def text(deltas) -> str:
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize("s", TEXTS)
def test_token_by_token_text_equals_full_decode_and_never_sends_half_a_character(tok, s):
    ids = enc(tok, s)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, "r", [[i] for i in ids] or [[]])
    assert text(deltas) == tok.decode(ids) == s
    assert not any(FFFD in d.text for d in deltas)
    assert [d.rid for d in deltas] == ["r"] * max(1, len(ids))
    assert [d.completion_tokens for d in deltas] == (list(range(1, len(ids) + 1)) or [0])
    assert deltas[-1].finish_reason == "length" and detok.states == {}


def test_bytes_of_a_character_split_over_tokens_are_held_until_it_is_complete(tok):
    ids = enc(tok, "x 日本語")
    assert any(tok.decode([i]) == FFFD for i in ids)  # the demo BPE does split these characters
    deltas = stream(IncrementalDetokenizer(tok), "r", [[i] for i in ids])
    assert "" in [d.text for d in deltas] and text(deltas) == "x 日本語"  # some tokens sent nothing


@st.composite
def requests(draw, tok):
    """(ids, skip_special_tokens, chunk sizes): encoded text, or any ids at all (specials, bad UTF-8)."""
    if draw(st.booleans()):
        ids = enc(tok, draw(st.one_of(st.sampled_from(TEXTS), st.text(max_size=30))))
    else:
        ids = draw(st.lists(st.integers(0, len(tok) - 1), max_size=25))
    sizes, n = [], len(ids)
    while n > 0:
        sizes.append(draw(st.integers(1, min(n, 5))))
        n -= sizes[-1]
    return ids, draw(st.booleans()), sizes or [0]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_interleaved_requests_in_random_chunks_each_add_up_to_the_full_decode(tok, data):
    reqs = data.draw(st.lists(requests(tok), min_size=1, max_size=4))
    detok = IncrementalDetokenizer(tok)
    pos, got = [0] * len(reqs), [[] for _ in reqs]
    nchunk = [0] * len(reqs)
    while any(nchunk[i] < len(r[2]) for i, r in enumerate(reqs)):
        updates, who = [], []
        for i, (ids, skip, sizes) in enumerate(reqs):
            if nchunk[i] < len(sizes) and not data.draw(st.booleans()):  # or wait a round
                c = ids[pos[i] : pos[i] + sizes[nchunk[i]]]
                end = "length" if nchunk[i] == len(sizes) - 1 else ""
                rid = f"r{i}"
                updates.append(first(rid, c, (), skip, end) if nchunk[i] == 0 else more(rid, c, end))
                who.append(i)
                pos[i] += len(c)
                nchunk[i] += 1
        deltas = detok.process(updates)
        assert [d.rid for d in deltas] == [u.rid for u in updates]  # one per update, in order
        for i, d in zip(who, deltas, strict=True):
            assert d.completion_tokens == pos[i]
            got[i].append(d)
    assert detok.states == {}
    for (ids, skip, _), deltas in zip(reqs, got, strict=True):
        full = tok.decode(ids, skip_special_tokens=skip)
        assert text(deltas) == full
        assert FFFD in full or not any(FFFD in d.text for d in deltas)
        assert [d.finish_reason for d in deltas][-1] == "length"


@pytest.mark.parametrize(("skip", "want"), [(True, "hi there"), (False, "<|im_start|>hi<|im_end|> there")])
def test_special_tokens_in_the_stream_are_skipped_or_kept(tok, skip, want):
    ids = [IM_START, *enc(tok, "hi"), IM_END, *enc(tok, " there")]
    assert text(stream(IncrementalDetokenizer(tok), "r", [[i] for i in ids], skip=skip)) == want


@pytest.mark.parametrize("stop", [("world", "lo"), ("lo", "world"), ("lo",), ("日本",)])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_stop_string_cuts_where_the_earliest_one_starts_and_ends_the_request(tok, stop, chunk):
    s = "hello world 日本語 and more"
    ids = enc(tok, s)
    cut = min(i for i in (s.find(x) for x in stop) if i >= 0)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, "r", [ids[i : i + chunk] for i in range(0, len(ids), chunk)], stop)
    assert text(deltas) == s[:cut]
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].matched_stop == next(x for x in stop if s.startswith(x, cut))
    assert [d.finish_reason for d in deltas[:-1]] == [""] * (len(deltas) - 1)
    assert deltas[-1].completion_tokens == sum(len(d.token_ids) for d in deltas)  # tokens past the stop too
    assert detok.states == {}


def test_after_a_stop_the_requests_later_entries_are_dropped_until_the_schedulers_final_one(tok):
    detok = IncrementalDetokenizer(tok)
    a, b = enc(tok, "one. END two"), enc(tok, "other request")
    deltas = detok.process([first("r", a, ("END",)), first("o", b[:1])])
    assert [(d.rid, d.text, d.finish_reason, d.matched_stop) for d in deltas] == [
        ("r", "one. ", "stop", "END"),
        ("o", tok.decode(b[:1]), "", ""),
    ]
    assert detok.states.keys() == {"o"}
    # the scheduler keeps running "r" until the gateway's abort lands: those entries get no delta
    deltas = detok.process([more("r", enc(tok, " three")), more("o", b[1:])])
    assert [d.rid for d in deltas] == ["o"]
    assert detok.process([more("r", enc(tok, " four"), "abort", "stop string")]) == []
    assert text(detok.process([more("o", [], "length")])) == ""
    assert detok.states == {}
    # "r" is forgotten: the same rid again is a new request
    (d,) = detok.process([first("r", enc(tok, "new"), finish="length")])
    assert (d.text, d.finish_reason) == ("new", "length") and detok.states == {}


def test_partial_stop_match_is_held_back_and_released_when_it_turns_out_no_stop(tok):
    detok = IncrementalDetokenizer(tok)
    d1, d2, d3 = stream(
        detok, "r", [enc(tok, "abc <EN"), enc(tok, "X more <E"), enc(tok, "ND> tail")], ("<END>",)
    )
    assert (d1.text, d2.text) == ("abc ", "<ENX more ")
    assert (d3.text, d3.finish_reason, d3.matched_stop) == ("", "stop", "<END>")
    assert not d3.ended_early  # the scheduler ended it in the same entry
    assert detok.states == {}


def test_stop_string_spanning_two_chunks_is_found(tok):
    deltas = stream(IncrementalDetokenizer(tok), "r", [enc(tok, "foo <EN"), enc(tok, "D> bar")], ("<END>",))
    assert [(d.text, d.finish_reason, d.matched_stop) for d in deltas] == [
        ("foo ", "", ""),
        ("", "stop", "<END>"),
    ]


@pytest.mark.parametrize("finish", ["length", "abort"])
def test_finishing_flushes_a_held_partial_stop_match(tok, finish):
    detok = IncrementalDetokenizer(tok)
    d1, d2 = stream(detok, "r", [enc(tok, "abc"), enc(tok, " <EN")], ("<END>",), finish=finish)
    assert (d1.text, d2.text, d2.finish_reason, d2.matched_stop) == ("abc", " <EN", finish, "")
    assert detok.states == {}


@pytest.mark.parametrize("finish", ["length", "abort"])
def test_finishing_flushes_an_incomplete_utf8_tail(tok, finish):
    ids = enc(tok, "ok 日")[:-1]
    assert tok.decode(ids).endswith(FFFD)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, "r", [[i] for i in ids], finish=finish)
    assert FFFD not in text(deltas[:-1]) and text(deltas) == tok.decode(ids)
    assert deltas[-1].finish_reason == finish and detok.states == {}


def test_abort_with_an_error_carries_the_error(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.process([first("r", enc(tok, "par"))])[0].error == ""
    (d,) = detok.process([more("r", enc(tok, "tial"), "abort", "scheduler died")])
    assert (d.text, d.finish_reason, d.error) == ("tial", "abort", "scheduler died")
    assert detok.states == {}


def test_a_request_whose_start_this_detokenizer_never_saw_ends_with_an_error(tok):
    """After a detokenizer restart, a running request's next entries carry no options (only its first
    does): its text so far is gone, so it ends with an error the client sees instead of half a text."""
    detok = IncrementalDetokenizer(tok)
    (d,) = detok.process([more("ghost", enc(tok, "lo"))])
    assert (d.text, d.finish_reason, d.error, d.ended_early) == ("", "abort", LOST_START, True)
    assert detok.process([more("ghost", enc(tok, " more"))]) == []  # the rest is dropped ...
    assert detok.process([more("ghost", [], "length")]) == []  # ... up to the scheduler's final entry
    assert detok.states == {} and not detok._stopped
    (d,) = detok.process([more("ghost2", enc(tok, "hi"), "length")])  # its final entry: lost, too
    assert (d.text, d.finish_reason, d.error) == ("", "abort", LOST_START) and not detok._stopped
    assert not d.ended_early  # the scheduler ended it: nothing to abort there
    (d,) = detok.process([first("r", enc(tok, "hi"), finish="abort", error="queue full")])  # a real first
    assert (d.text, d.finish_reason, d.error) == ("hi", "abort", "queue full")
    u = RequestTokens(
        "x", "gw", [IM_START, *enc(tok, "x")], "length", skip_special_tokens=False, prompt_tokens=5
    )
    assert detok.process([u])[0].error == LOST_START  # stop is None: not a first entry, whatever else it says
    assert detok.states == {}


def test_usage_comes_from_the_first_entry_and_completion_tokens_count_every_token(tok):
    detok = IncrementalDetokenizer(tok)
    ids = [IM_START, *enc(tok, "count me"), IM_END]
    deltas = detok.process([first("r", ids[:2], prompt_tokens=7, cached_tokens=3)])
    later = RequestTokens("r", "gw", ids[2:], "length", prompt_tokens=99, cached_tokens=99)  # no options
    deltas += detok.process([later])
    assert [(d.prompt_tokens, d.cached_tokens, d.completion_tokens) for d in deltas] == [
        (7, 3, 2),
        (7, 3, len(ids)),
    ]
    assert text(deltas) == "count me"  # special tokens counted, not shown


def test_same_rid_twice_in_one_call_is_taken_in_order_as_if_in_two_calls(tok):
    detok = IncrementalDetokenizer(tok)
    deltas = detok.process(
        [first("r", enc(tok, "a b")), first("o", enc(tok, "o")), more("r", enc(tok, " c"), "length")]
    )
    assert [(d.rid, d.text, d.completion_tokens) for d in deltas] == [
        ("r", "a b", 2),
        ("o", "o", 1),
        ("r", " c", 3),
    ]
    deltas = detok.process(
        [first("s", enc(tok, "x"), ("END",)), more("s", enc(tok, " END")), more("s", [5], "length")]
    )
    assert [(d.text, d.finish_reason) for d in deltas] == [("x", ""), (" ", "stop")]  # final entry dropped
    assert deltas[-1].ended_early  # stopped here before the scheduler ended it: the gateway aborts it
    assert detok.process([more("o", [], "length")])[0].finish_reason == "length" and detok.states == {}
    assert detok.process([first("s", enc(tok, "new"), finish="length")])[0].text == "new"


def test_include_stop_keeps_the_stop_string_and_min_tokens_delays_stop_strings(tok):
    ids = enc(tok, "one. two. three. four.")
    kept = IncrementalDetokenizer(tok).process([first("r", ids, stop=(".",), include_stop=True)])
    assert kept[0].text == "one." and kept[0].finish_reason == "stop" and kept[0].matched_stop == "."
    # stop strings are looked for only once the output has more tokens than min_tokens (vLLM's rule)
    d = IncrementalDetokenizer(tok)
    n = len(enc(tok, "one. two"))
    out = [*d.process([first("r", ids[:n], stop=(".",), min_tokens=n)]), *d.process([more("r", ids[n:])])]
    assert text(out) == "one. two" and out[-1].finish_reason == "stop"  # the first "." let through


@pytest.mark.parametrize(
    ("s", "stop"),
    [
        (TEXTS[0], ()),
        (TEXTS[1], ()),
        (TEXTS[3], ()),
        (TEXTS[0], ("return y",)),
        (TEXTS[1], ("wörld — 日本x",)),
    ],
)
def test_a_request_continued_on_another_detokenizer_sends_every_character_once(tok, s, stop):
    """Failover (issue 44): whatever token the first detokenizer died after, a second one rebuilt
    from the tokens and characters the client has sends on with nothing repeated or lost, held-back
    text (an unfinished character, a partial stop string) included."""
    ids = enc(tok, s)
    whole = text(stream(IncrementalDetokenizer(tok), "r", [[i] for i in ids], stop))
    for k in range(1, len(ids)):
        before = stream(IncrementalDetokenizer(tok), "r", [[i] for i in ids[:k]], stop, finish="")
        if any(d.finish_reason for d in before):
            continue  # ended by the stop string before the failover
        sent = text(before)
        detok = IncrementalDetokenizer(tok)
        rest = [first("r.f", ids[k : k + 1], stop, continued_ids=ids[:k], continued_chars=len(sent))]
        rest += [more("r.f", [i]) for i in ids[k + 1 :]]
        rest[-1].finish_reason = "length" if len(rest) > 1 else rest[-1].finish_reason
        after = [d for u in rest for d in detok.process([u])]
        if len(rest) == 1:
            after += detok.process([more("r.f", [], "length")])
        assert sent + text(after) == whole, (k, sent)
        assert after[-1].completion_tokens == len(ids)  # usage counts every token once
