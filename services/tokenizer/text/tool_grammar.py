"""Tool definitions and the grammars that force a tool call.

``validate_tools`` checks a request's ``tools`` against OpenAI's shape; ``tool_choice_constraint``
turns ``tool_choice: "required"`` or a named function into an llguidance Lark grammar
(``Constraint(kind="lark")``) whose strings are exactly the well-formed calls of the model's format
(tool_calls.py parses them back), with arguments valid against the tool's JSON schema (Lark's
embedded ``%json``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from radixserve.common.sampling import Constraint
from radixserve.tokenizer.text.tool_calls import PARSERS

# OpenAI's function names (also the request schemas' pattern); they go into grammars verbatim.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
NAME_RE = re.compile(FUNCTION_NAME)


def validate_tools(tools: list[dict[str, Any]]) -> None:
    """Raise ValueError naming the field when ``tools`` is not OpenAI's shape."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function'")
        fn = tool.get("function")
        if fn is None:
            raise ValueError(f"{where}.function is missing")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object")
        name = fn.get("name")
        if name is None:
            raise ValueError(f"{where}.function.name is missing")
        # The name goes into grammars and templates verbatim: OpenAI's character set keeps it safe.
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ValueError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is already used by tools[{seen[name]}]")
        seen[name] = i
        if "description" in fn and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if "parameters" in fn:
            params = fn["parameters"]
            if not isinstance(params, dict):
                raise ValueError(f"{where}.function.parameters must be a JSON schema object")
            if params.get("type", "object") != "object":
                raise ValueError(f"{where}.function.parameters must have type 'object'")
        if "strict" in fn and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict must be a boolean")


def _arguments_schema(fn: Mapping[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    # Fixed whitespace: an embedded %json does not get the backend's defaults (scheduler/grammar.py),
    # and free whitespace lets a weak model spend its whole budget on newlines. The separators are
    # json.dumps' (", " and ": "), which is how chat templates render past calls to the model.
    compact = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    if params is None:  # OpenAI: no parameters means a function that takes none
        return {"type": "object", "properties": {}, "additionalProperties": False, **compact}
    # Arguments are always an object, even where the schema leaves "type" out.
    return {**params, "type": "object", **compact}


def tool_choice_constraint(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, parser: str, parallel: bool = True
) -> Constraint | None:
    """The grammar that forces a call for ``tool_choice``: None for None / "auto" / "none"; for
    "required", one or more calls (hermes without ``parallel``, and llama3_json: one) of any tool; for
    ``{"type": "function", "function": {"name": N}}``, exactly one call of N. Every string of the
    grammar is a call in ``parser``'s format whose arguments match the tool's ``parameters``.
    ``tools`` must have passed validate_tools: the caller checks them once per request."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if parser not in PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}; expected one of {sorted(PARSERS)}")
    functions = [t["function"] for t in tools]
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        chosen, many = functions, parser == "hermes" and parallel
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be {"type": "function", "function": {"name": ...}}')
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        many = False
    else:
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function; got {tool_choice!r}")

    if parser == "hermes":
        head, args_key, tail = '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"
    else:
        head, args_key, tail = '{"name": "', '", "parameters": ', "}"
    # Lark string literals take JSON's escapes, so json.dumps writes them; %json takes a schema.
    rules = [
        f"call_{i}: {json.dumps(head + f['name'] + args_key)} "
        f"%json {json.dumps(_arguments_schema(f))} {json.dumps(tail)}"
        for i, f in enumerate(chosen)
    ]
    start = 'start: call ("\\n" call)*' if many else "start: call"
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    return Constraint(kind="lark", spec="\n".join([start, f"call: {alternatives}", *rules]) + "\n")
