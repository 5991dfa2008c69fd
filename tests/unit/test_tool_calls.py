"""OpenAI tool calls (radixserve.tokenizer.text.tool_calls): parsing both formats whole and streamed in any
chunking, the demo chat templates' tool rendering, tools validation, and the tool_choice grammars
checked token by token with llguidance."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher

from radixserve.common.demo_model import CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE, build_tokenizer
from radixserve.tokenizer.text.tool_calls import (
    PARSERS,
    ToolCall,
    parser_for_template,
    template_messages,
)
from radixserve.tokenizer.text.tool_grammar import tool_choice_constraint, validate_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: takes none
TOOLS = [WEATHER, CLOCK]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def llama(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


PARIS = '{"city": "Paris"}'
DOUBLE_ENCODED = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
BAD_JSON = '{"name": "get_weather", "parameters": {"city" "Paris"}}'  # a missing colon
TRICKY = '{"city": "Zürich }{ \\"quoted\\" \\\\", "days": 2}'  # braces, escapes, non-ASCII in a string

# (output text, expected content, expected calls as (name, arguments text as the model wrote it))
HERMES_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    (hermes("get_weather", PARIS), None, [("get_weather", PARIS)]),
    (
        hermes("get_weather", PARIS) + "\n" + hermes("get_time", "{}"),
        None,
        [("get_weather", PARIS), ("get_time", "{}")],
    ),
    (
        "Let me look that up.\n" + hermes("get_weather", TRICKY) + "\nDone.",
        "Let me look that up.Done.",
        [("get_weather", TRICKY)],
    ),
    # once the name is known it is a call: malformed arguments are kept as the model wrote them
    ("Try: " + hermes("get_weather", '{"city": }'), "Try:", [("get_weather", '{"city": }')]),
    # no name: the block stays content, nothing is lost
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    (
        hermes("get_time", "{}") + "\n<tool_call>\n[1, 2]\n</tool_call>",
        "<tool_call>\n[1, 2]\n</tool_call>",
        [("get_time", "{}")],
    ),
    # arguments double-encoded as a JSON string (decoded, so not streamed); no arguments at all
    (DOUBLE_ENCODED, None, [("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", "{}")]),
    # the output ended inside a block (stop string / max tokens): a partial call once the name is
    # known; before that the block is dropped (markup, never a call), not shown as content
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P', None, [("get_weather", '{"city": "P')]),
    ('<tool_call>\n{"name": "get_weather", "argu', None, [("get_weather", "")]),
    ('Sure <tool_call>\n{"name": "get_ti', "Sure", []),
    ("a <tool> b < tool_call> </tool_call> <tool_", "a <tool> b < tool_call> </tool_call> <tool_", []),
    ("", None, []),
]

LLAMA_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    (llama("get_weather", PARIS), None, [("get_weather", PARIS)]),
    (
        llama("get_weather", TRICKY) + "; " + llama("get_time", "{}") + ";",
        None,
        [("get_weather", TRICKY), ("get_time", "{}")],
    ),
    ("<|python_tag|>" + llama("get_time", "{}"), None, [("get_time", "{}")]),
    (
        "Checking the weather. <|python_tag|>" + llama("get_weather", PARIS) + "\nDone.",
        "Checking the weather.Done.",
        [("get_weather", PARIS)],
    ),
    # JSON that is not a call (no "parameters" after the name), a bare object after prose: content
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("Use " + llama("get_time", "{}") + " to tell", "Use " + llama("get_time", "{}") + " to tell", []),
    # name and "parameters" make it a call: malformed or cut arguments are kept as written
    (BAD_JSON, None, [("get_weather", '{"city" "Paris"}')]),
    ('  {"name": "get_time", "parameters": {', None, [("get_time", "{")]),
    ('{"name": "get_ti', '{"name": "get_ti', []),  # a bare object cut early may be an answer
    ('<|python_tag|>{"name": "get_ti', None, []),  # after the tag it was a call: dropped
    ("x <|python_tag|> no json", "x <|python_tag|> no json", []),
    ("", None, []),
]

CASES = [("hermes", *c) for c in HERMES_CASES] + [("llama3_json", *c) for c in LLAMA_CASES]
CASE_IDS = [f"hermes-{i}" for i in range(len(HERMES_CASES))] + [f"llama-{i}" for i in range(len(LLAMA_CASES))]


def _calls(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def _decoded(calls: list[ToolCall]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_parse(parser, text, content, calls):
    got_content, got_calls = PARSERS[parser]().parse(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(CALL_ID.fullmatch(c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def _stream(parser: str, chunks: list[str]) -> tuple[str | None, list[dict[str, str]]]:
    """Feed ``chunks``, reassemble the content and the calls as a client would."""
    s = PARSERS[parser]().stream()
    content: list[str] = []
    calls: list[dict[str, str]] = []
    for text, deltas in [*(s.feed(c) for c in chunks), s.finish()]:
        content.append(text)
        for d in deltas:
            if d.index == len(calls):  # a new call: its first delta carries id and name
                assert d.id is not None and CALL_ID.fullmatch(d.id) and d.name
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                calls[d.index]["arguments"] += d.arguments
    return "".join(content) or None, calls


def _chunkings(text: str) -> list[list[str]]:
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)]  # every character boundary
    rng = random.Random(len(text))
    for _ in range(20):
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            chunks.append(text[i : i + n])
            i += n
        splits.append(chunks)
    return [*splits, list(text), [text]]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_stream_matches_parse_in_any_chunking(parser, text, content, calls):
    want_content, want_calls = PARSERS[parser]().parse(text)
    for chunks in _chunkings(text):
        got_content, got_calls = _stream(parser, chunks)
        assert got_content == want_content, chunks
        assert [(c["name"], c["arguments"]) for c in got_calls] == [
            (c.name, c.arguments) for c in want_calls
        ], chunks
        assert len({c["id"] for c in got_calls}) == len(got_calls)


def test_stream_holds_back_only_a_possible_marker():
    s = PARSERS["hermes"]().stream()
    assert s.feed("Hello") == ("Hello", [])  # plain text goes out at once
    assert s.feed(" there <tool_") == (" there", [])  # " <tool_" may open a call
    assert s.feed("s are fun\n") == (" <tool_s are fun", [])  # it did not; the newline still waits
    assert s.feed("<tool_call>\n{") == ("", [])  # a block: the newline before it was markup
    content, deltas = s.feed('"name": "get_weather"')  # the name is known: the call starts
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", "")]
    assert deltas[0].id is not None and CALL_ID.fullmatch(deltas[0].id)
    assert s.feed(', "arguments": ') == ("", [])
    content, deltas = s.feed('{"city": "Pa')  # arguments go out as the model writes them
    assert [(d.index, d.id, d.arguments) for d in deltas] == [(0, None, '{"city": "Pa')]
    content, deltas = s.feed('ris"}}\n</tool_')
    assert [d.arguments for d in deltas] == ['ris"}']  # the call's own closing brace is markup
    assert s.feed("call>") == ("", [])
    assert s.finish() == ("", [])

    s = PARSERS["llama3_json"]().stream()
    assert s.feed("  ") == ("", [])  # leading whitespace: a call may follow
    assert s.feed('{"name": "get_time"') == ("", [])  # a bare JSON answer may have a name too
    content, deltas = s.feed(', "parameters": {')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_time", "{")]
    content, deltas = s.feed("}")
    assert content == "" and [d.arguments for d in deltas] == ["}"]
    assert s.feed("}; All done") == ("All done", [])
    assert s.finish() == ("", [])


def test_stream_ends_a_cut_call_as_a_partial_call():
    s = PARSERS["hermes"]().stream()
    assert s.feed("ok\n<tool_call>\n{") == ("ok", [])
    assert s.finish() == ("", [])  # cut before its name: never a call, and not an answer either
    with pytest.raises(RuntimeError):
        s.feed("more")
    s = PARSERS["hermes"]().stream()
    _, deltas = s.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", '{"ci')]
    assert s.finish() == ("", [])  # what came of the arguments is the call's


# ---------------------------------------------------------------------------------- templates
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _render(tok, template: str, messages, tools=None, gen: bool = True) -> str:
    tok.chat_template = template
    kwargs = {"tools": tools} if tools is not None else {}
    return tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **kwargs)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": TRICKY}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
]
WANT_CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", json.loads(TRICKY))]


def test_chatml_without_tools_renders_as_before(tokenizer):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
    ]
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    assert _render(tokenizer, CHAT_TEMPLATE, msgs, gen=False) == want
    assert _render(tokenizer, CHAT_TEMPLATE, msgs) == want + "<|im_start|>assistant\n"
    assert _render(tokenizer, CHAT_TEMPLATE, msgs, tools=[]) == want + "<|im_start|>assistant\n"


def test_chatml_renders_tools_calls_and_results(tokenizer):
    out = _render(tokenizer, CHAT_TEMPLATE, template_messages(CONVERSATION), tools=TOOLS)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert out.count("Be brief.") == 1  # the system message is merged into the tools turn
    listed = out.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in listed] == TOOLS
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in out
    assert "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n" in out
    # the past calls render in the format the hermes parser reads back
    turn = out.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    content, calls = PARSERS["hermes"]().parse(turn)
    assert content is None and _decoded(calls) == WANT_CALLS
    assert out.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # no system message: the tools turn still comes first
    out = _render(tokenizer, CHAT_TEMPLATE, [{"role": "user", "content": "hi"}], tools=TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert out.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_assistant_content_with_calls(tokenizer):
    msgs = template_messages(
        [
            {"role": "user", "content": "t?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [{"id": "c", "function": {"name": "get_time", "arguments": "{}"}}],
            },
        ]
    )
    out = _render(tokenizer, CHAT_TEMPLATE, msgs, tools=TOOLS, gen=False)
    assert out.endswith("<|im_start|>assistant\nChecking.\n" + hermes("get_time", "{}") + "<|im_end|>\n")


def test_llama3_template_renders_tools_calls_and_results(tokenizer):
    out = _render(tokenizer, LLAMA3_CHAT_TEMPLATE, template_messages(CONVERSATION), tools=TOOLS)
    system = out.split("<|start_header_id|>system<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>", 1)[0]
    assert system.startswith("Environment: ipython\n\nBe brief.\n\nGiven the following functions")
    assert '{"name": function name, "parameters": dictionary' in system
    for tool in TOOLS:
        assert json.dumps(tool, indent=4) in system
    turn = out.split("<|start_header_id|>assistant<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>", 1)[0]
    content, calls = PARSERS["llama3_json"]().parse(turn)
    assert content is None and _decoded(calls) == WANT_CALLS
    assert out.endswith(
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\nrain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    plain = _render(tokenizer, LLAMA3_CHAT_TEMPLATE, [{"role": "user", "content": "hi"}])
    assert plain == (
        "<|bos|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_parser_for_template():
    old_chatml = "{% for m in messages %}{{ '<|im_start|>' + m['role'] }}{% endfor %}"
    assert parser_for_template(CHAT_TEMPLATE) == "hermes"
    assert parser_for_template(LLAMA3_CHAT_TEMPLATE) == "llama3_json"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template(old_chatml) is None
    assert parser_for_template(None) is None
    assert parser_for_template("") is None


def test_template_messages():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
                {"id": "c3", "type": "function", "function": {"name": "get_time", "arguments": "[1]"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "zz", "content": "?"},
    ]
    before = json.dumps(msgs)
    out = template_messages(msgs)
    assert json.dumps(msgs) == before  # inputs untouched
    assert out[0]["content"] == "ab"
    arguments = [c["function"]["arguments"] for c in out[1]["tool_calls"]]
    assert arguments == [{"city": "Paris"}, "not json", "[1]"]
    assert out[1]["content"] is None
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"}
    assert out[3] == msgs[3]


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("get_weather", "tools must be a list"),
        ([WEATHER, "x"], "tools[1] must be an object"),
        ([{"type": "retrieval"}], "tools[0].type must be 'function'"),
        ([{"type": "function"}], "tools[0].function is missing"),
        ([{"type": "function", "function": "f"}], "tools[0].function must be an object"),
        ([WEATHER, {"type": "function", "function": {}}], "tools[1].function.name is missing"),
        ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name must match"),
        ([{"type": "function", "function": {"name": "f" * 65}}], "tools[0].function.name must match"),
        ([{"type": "function", "function": {"name": 7}}], "tools[0].function.name must match"),
        ([WEATHER, CLOCK, WEATHER], "tools[2].function.name 'get_weather' is already used by tools[0]"),
        ([{"type": "function", "function": {"name": "f", "description": 1}}], "description must be a string"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "must be a JSON schema object"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "type 'object'"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "strict must be a boolean"),
    ],
)
def test_validate_tools_rejects(tools, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_tools(tools)


def test_validate_tools_accepts():
    validate_tools(TOOLS)
    validate_tools([])
    validate_tools([{"type": "function", "function": {"name": "a-B_9", "strict": True, "parameters": {}}}])


# ---------------------------------------------------------------------------------- tool_choice
@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


def _accepts(tokenizer, ll_tokenizer, grammar: str, text: str) -> bool:
    """Feed ``text``'s tokens to a matcher of ``grammar``: is it a complete string of the grammar?"""
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting() and not matcher.is_error()


FORMATS = {"hermes": hermes, "llama3_json": llama}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_named_tool_grammar(tokenizer, ll_tokenizer, parser):
    call = FORMATS[parser]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    constraint = tool_choice_constraint(TOOLS, choice, parser)
    assert constraint is not None and constraint.kind == "lark"
    grammar = LLMatcher.grammar_from_lark(constraint.spec)
    assert LLMatcher.validate_grammar(grammar) == ""

    def accepts(text: str) -> bool:
        return _accepts(tokenizer, ll_tokenizer, grammar, text)

    good = call("get_weather", TRICKY)
    assert accepts(good)
    assert accepts(call("get_weather", PARIS))
    assert _decoded(PARSERS[parser]().parse(good)[1]) == [("get_weather", json.loads(TRICKY))]
    assert not accepts(call("get_time", PARIS))  # another tool
    assert not accepts(call("get_weather", '{"city": 3}'))  # wrong type
    assert not accepts(call("get_weather", "{}"))  # a required property missing
    assert not accepts(call("get_weather", '{"city": "Paris", "days": 0}'))  # below the minimum
    assert not accepts(call("get_weather", '{"city": "Paris", "wind": true}'))  # no additional properties
    assert not accepts("Sure! " + good)  # nothing but the call
    assert not accepts(good + "\n" + good)  # exactly one call
    assert not accepts(good[:-1])  # incomplete


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_required_grammar(tokenizer, ll_tokenizer, parser):
    call = FORMATS[parser]
    constraint = tool_choice_constraint(TOOLS, "required", parser)
    assert constraint is not None and constraint.kind == "lark"
    grammar = LLMatcher.grammar_from_lark(constraint.spec)
    assert LLMatcher.validate_grammar(grammar) == ""

    def accepts(text: str) -> bool:
        return _accepts(tokenizer, ll_tokenizer, grammar, text)

    assert accepts(call("get_weather", PARIS))
    assert accepts(call("get_time", "{}"))
    assert not accepts(call("get_time", '{"tz": "UTC"}'))  # a function without parameters takes none
    assert not accepts(call("get_date", "{}"))  # not a tool
    assert not accepts("It is sunny.")
    assert not accepts("")  # at least one call
    # hermes: one or more blocks, newline-separated, as the template renders them
    two = call("get_weather", PARIS) + "\n" + call("get_time", "{}")
    assert accepts(two) == (parser == "hermes")
    # parallel_tool_calls: false -> exactly one call in every format
    single = tool_choice_constraint(TOOLS, "required", parser, parallel=False)
    assert single is not None
    one_call = LLMatcher.grammar_from_lark(single.spec)
    assert _accepts(tokenizer, ll_tokenizer, one_call, call("get_weather", PARIS))
    assert not _accepts(tokenizer, ll_tokenizer, one_call, two)


def test_template_rendered_call_is_accepted(tokenizer, ll_tokenizer):
    """The template's rendering of a call, the grammar and the parser agree on the format."""
    out = _render(tokenizer, CHAT_TEMPLATE, template_messages(CONVERSATION[:3]), tools=TOOLS, gen=False)
    turn = out.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    spec = tool_choice_constraint(TOOLS, "required", "hermes").spec  # type: ignore[union-attr]
    assert _accepts(tokenizer, ll_tokenizer, LLMatcher.grammar_from_lark(spec), turn)


def test_tool_choice_constraint_none_and_errors():
    for choice in (None, "auto", "none"):
        assert tool_choice_constraint(TOOLS, choice, "hermes") is None
    with pytest.raises(ValueError, match="'get_date', which is not in tools"):
        tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "get_date"}}, "hermes")
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_choice_constraint(TOOLS, "always", "hermes")
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_choice_constraint(TOOLS, {"type": "function"}, "hermes")
    with pytest.raises(ValueError, match="needs at least one tool"):
        tool_choice_constraint([], "required", "hermes")
    with pytest.raises(ValueError, match="unknown tool parser"):
        tool_choice_constraint(TOOLS, "required", "mistral")
    # The tools are not validated again here: the request's tools pass validate_tools once, before.
    with pytest.raises(ValueError, match=re.escape("tools[0].function.name is missing")):
        validate_tools([{"type": "function", "function": {}}])
