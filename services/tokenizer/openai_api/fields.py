"""What the OpenAI endpoints do with each request field: the one table, and the check it drives.

Every field a client may send is in ``FIELDS``, with one of three policies:

- ``IMPLEMENTED``: it does what OpenAI (or vLLM / SGLang, for their extensions) documents;
- ``IGNORED``: accepted and ignored, because ignoring it cannot change what the client gets
  (``user`` labels requests for a provider's abuse monitoring, ``metadata`` only tags stored ones);
- ``NEUTRAL_ONLY``: not implemented, so accepted only at a value that asks for nothing (routers
  re-serialise requests with every field at its default: ``return_hidden_states: false``) and
  refused by name at any other value, since ignoring it would change the result.

A field in no row is refused by name too: the request schemas (requests.py) forbid unknown fields,
and tests/unit/test_request_fields.py holds the schemas and this table to the same set of fields,
and the table to every field of the OpenAI SDK's own request types. docs/api.md shows the table.

Paths name fields as a client writes them: ``stream_options.include_usage``; ``messages[].name`` is
the ``name`` of any message; a row marked ``whole`` covers everything below it (``tools`` is
implemented down to its leaves, checked by tool_grammar.validate_tools).
"""

from __future__ import annotations

from pydantic import BaseModel

from radixserve.tokenizer.openai_api.field_policy import (
    BOTH,
    CHAT,
    COMPLETIONS,
    IGNORED,
    IMPLEMENTED,
    NEUTRAL_ONLY,
    RESPONSES,
    FieldRule,
    markdown,
    refused_by,
    row,
)

__all__ = ["CHAT", "COMPLETIONS", "FIELDS", "IGNORED", "IMPLEMENTED", "NEUTRAL_ONLY", "RESPONSES", "rules"]

_TEXT_ONLY = "refused: this server serves text-only models"
_NOT_HERE = "refused: not available on this server"

FIELDS: tuple[FieldRule, ...] = (
    # ------------------------------------------------------------------ OpenAI, both endpoints
    row("model", BOTH, "OpenAI", IMPLEMENTED, "must name the served model (404 otherwise)"),
    row("max_tokens", BOTH, "OpenAI", IMPLEMENTED, "output bound (chat: up to the context when unset)"),
    row("temperature", BOTH, "OpenAI", IMPLEMENTED, "in [0, 2]; 0 is greedy"),
    row("top_p", BOTH, "OpenAI", IMPLEMENTED, "in (0, 1]"),
    row("n", BOTH, "OpenAI", IMPLEMENTED, "1 to 16 choices"),
    row("stop", BOTH, "OpenAI", IMPLEMENTED, "up to 16 strings, cut from the output"),
    row("seed", BOTH, "OpenAI", IMPLEMENTED, "64-bit; reproducible sampling per choice"),
    row("stream", BOTH, "OpenAI", IMPLEMENTED, "server-sent events ending in [DONE]"),
    row("stream_options", BOTH, "OpenAI", IMPLEMENTED, "only with stream: true"),
    row("stream_options.include_usage", BOTH, "OpenAI", IMPLEMENTED, "a last chunk with usage"),
    row(
        "stream_options.continuous_usage_stats",
        BOTH,
        "vLLM",
        IMPLEMENTED,
        "every chunk carries the usage so far",
    ),
    row(
        "stream_options.include_obfuscation",
        BOTH,
        "OpenAI",
        IGNORED,
        "OpenAI pads chunks against length side channels; the text is the same without",
    ),
    row("frequency_penalty", BOTH, "OpenAI", IMPLEMENTED, "in [-2, 2], over generated tokens"),
    row("presence_penalty", BOTH, "OpenAI", IMPLEMENTED, "in [-2, 2], over generated tokens"),
    row("logit_bias", BOTH, "OpenAI", IMPLEMENTED, "token id -> [-100, 100]", whole=True),
    row("user", BOTH, "OpenAI", IGNORED, "labels requests for a provider's abuse monitoring"),
    # ------------------------------------------------------------------ OpenAI, completions
    row("prompt", COMPLETIONS, "OpenAI", IMPLEMENTED, "text, token ids, or up to 256 of either"),
    row("echo", COMPLETIONS, "OpenAI", IMPLEMENTED, "the prompt first (with its logprobs when asked)"),
    row("logprobs", COMPLETIONS, "OpenAI", IMPLEMENTED, "0 to 20 alternatives per token"),
    row("best_of", COMPLETIONS, "OpenAI", NEUTRAL_ONLY, "only equal to n", same_as="n"),
    row("suffix", COMPLETIONS, "OpenAI", NEUTRAL_ONLY, "refused: no fill-in-the-middle", neutral=("",)),
    # ------------------------------------------------------------------ OpenAI, chat
    row("messages", CHAT, "OpenAI", IMPLEMENTED, "rendered by the model's chat template"),
    row(
        "messages[].role", CHAT, "OpenAI", IMPLEMENTED, "system, developer (as system), user, assistant, tool"
    ),
    row("messages[].content", CHAT, "OpenAI", IMPLEMENTED, "text, or a list of text parts"),
    row(
        "messages[].content[].type",
        CHAT,
        "OpenAI",
        NEUTRAL_ONLY,
        "text and refusal parts (as text) only: this server serves text-only models",
        neutral=("text", "refusal"),
    ),
    row("messages[].content[].text", CHAT, "OpenAI", IMPLEMENTED, "a text part's text"),
    row("messages[].content[].refusal", CHAT, "OpenAI", IMPLEMENTED, "an assistant's refusal part, as text"),
    row("messages[].name", CHAT, "OpenAI", IMPLEMENTED, "passed to the chat template (most show it)"),
    row(
        "messages[].refusal",
        CHAT,
        "OpenAI",
        IMPLEMENTED,
        "an assistant's past refusal: its text stands in for empty content",
    ),
    row("messages[].tool_calls", CHAT, "OpenAI", IMPLEMENTED, "an assistant's past calls", whole=True),
    row("messages[].tool_call_id", CHAT, "OpenAI", IMPLEMENTED, "the call a tool message answers"),
    row("messages[].audio", CHAT, "OpenAI", NEUTRAL_ONLY, _TEXT_ONLY, whole=True),
    row(
        "messages[].function_call",
        CHAT,
        "OpenAI",
        NEUTRAL_ONLY,
        "refused: deprecated by OpenAI, use tool_calls",
        whole=True,
    ),
    row(
        "messages[].annotations",
        CHAT,
        "OpenAI",
        IGNORED,
        "an assistant's past citations (the SDK's message.model_dump() resends them): not for the template",
        whole=True,
    ),
    row(
        "messages[].reasoning_content",
        CHAT,
        "vLLM, SGLang",
        IMPLEMENTED,
        "an assistant's past reasoning, passed to the chat template",
    ),
    row("max_completion_tokens", CHAT, "OpenAI", IMPLEMENTED, "output bound (wins over max_tokens)"),
    row("logprobs", CHAT, "OpenAI", IMPLEMENTED, "each output token's logprob"),
    row("top_logprobs", CHAT, "OpenAI", IMPLEMENTED, "0 to 20 alternatives per token"),
    row("tools", CHAT, "OpenAI", IMPLEMENTED, "function tools, through the chat template", whole=True),
    row("tool_choice", CHAT, "OpenAI", IMPLEMENTED, "none, auto, required, a named function", whole=True),
    row("parallel_tool_calls", CHAT, "OpenAI", IMPLEMENTED, "false keeps one call"),
    row(
        "response_format",
        BOTH,
        "OpenAI",
        IMPLEMENTED,
        "text, json_object, json_schema: enforced by a grammar",
        whole=True,
    ),
    row(
        "reasoning_effort",
        CHAT,
        "OpenAI",
        IMPLEMENTED,
        "to the chat template; none turns a thinking switch (enable_thinking, thinking) off",
    ),
    row("metadata", CHAT, "OpenAI", IGNORED, "tags for stored completions (none are stored)", whole=True),
    row(
        "store",
        CHAT,
        "OpenAI",
        NEUTRAL_ONLY,
        "refused when true: completions are not stored",
        neutral=(False,),
    ),
    row(
        "service_tier",
        CHAT,
        "OpenAI",
        NEUTRAL_ONLY,
        "auto and default only: one tier",
        neutral=("auto", "default"),
    ),
    row("safety_identifier", CHAT, "OpenAI", IGNORED, "labels requests for a provider's abuse monitoring"),
    row(
        "prompt_cache_key",
        CHAT,
        "OpenAI",
        IGNORED,
        "a caching hint: the prefix cache and its routing match prompts themselves",
    ),
    row("prompt_cache_options", CHAT, "OpenAI", IGNORED, "a caching hint (see prompt_cache_key)", whole=True),
    row("prompt_cache_retention", CHAT, "OpenAI", IGNORED, "a caching hint (see prompt_cache_key)"),
    row(
        "prediction",
        CHAT,
        "OpenAI",
        IGNORED,
        "predicted output only speeds OpenAI's decoding up; the output is the same",
        whole=True,
    ),
    row("modalities", CHAT, "OpenAI", NEUTRAL_ONLY, 'only ["text"]', neutral=(["text"],)),
    row("audio", CHAT, "OpenAI", NEUTRAL_ONLY, _TEXT_ONLY, whole=True),
    row("verbosity", CHAT, "OpenAI", NEUTRAL_ONLY, "medium only: no verbosity control", neutral=("medium",)),
    row("web_search_options", CHAT, "OpenAI", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("moderation", CHAT, "OpenAI", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("functions", CHAT, "OpenAI", NEUTRAL_ONLY, "refused: deprecated by OpenAI, use tools", whole=True),
    row(
        "function_call",
        CHAT,
        "OpenAI",
        NEUTRAL_ONLY,
        "refused: deprecated by OpenAI, use tool_choice",
        whole=True,
    ),
    # ------------------------------------------------------------------ vLLM / SGLang, both
    row("top_k", BOTH, "vLLM, SGLang", IMPLEMENTED, "-1 (off) or >= 1"),
    row("min_p", BOTH, "vLLM, SGLang", IMPLEMENTED, "in [0, 1]"),
    row("repetition_penalty", BOTH, "vLLM, SGLang", IMPLEMENTED, "HF's, in (0, 2]"),
    row(
        "min_tokens", BOTH, "vLLM, SGLang", IMPLEMENTED, "no EOS, stop token or stop string before this many"
    ),
    row("ignore_eos", BOTH, "vLLM, SGLang", IMPLEMENTED, "generate to max_tokens"),
    row("stop_token_ids", BOTH, "vLLM, SGLang", IMPLEMENTED, "token ids that end the output"),
    row("skip_special_tokens", BOTH, "vLLM, SGLang", IMPLEMENTED, "false shows special tokens in the text"),
    row(
        "spaces_between_special_tokens",
        BOTH,
        "vLLM",
        IGNORED,
        "fast tokenizers (the only kind served) never put spaces there: both values give the same text",
    ),
    row("include_stop_str_in_output", BOTH, "vLLM", IMPLEMENTED, "the matched stop string stays in the text"),
    row("no_stop_trim", BOTH, "SGLang", IMPLEMENTED, "as include_stop_str_in_output"),
    row("guided_json", BOTH, "vLLM", IMPLEMENTED, "a JSON schema the output follows", whole=True),
    row("guided_regex", BOTH, "vLLM", IMPLEMENTED, "a regex the output matches"),
    row("guided_choice", BOTH, "vLLM", IMPLEMENTED, "the output is one of these strings"),
    row("json_schema", BOTH, "SGLang", IMPLEMENTED, "as guided_json (the schema as JSON text)"),
    row("regex", BOTH, "SGLang", IMPLEMENTED, "as guided_regex"),
    row(
        "guided_decoding_backend",
        BOTH,
        "vLLM",
        IGNORED,
        "which engine enforces a constraint (here always llguidance) does not change what it allows",
    ),
    row("guided_grammar", BOTH, "vLLM", NEUTRAL_ONLY, "refused: EBNF grammars are not taken"),
    row("guided_whitespace_pattern", BOTH, "vLLM", NEUTRAL_ONLY, "refused: JSON output is compact"),
    row("ebnf", BOTH, "SGLang", NEUTRAL_ONLY, "refused: EBNF grammars are not taken"),
    row(
        "structured_outputs",
        BOTH,
        "vLLM",
        NEUTRAL_ONLY,
        "refused: use response_format or guided_*",
        whole=True,
    ),
    row("truncate_prompt_tokens", BOTH, "vLLM", IMPLEMENTED, "keeps the prompt's last k tokens"),
    row(
        "add_special_tokens",
        BOTH,
        "vLLM",
        IMPLEMENTED,
        "the tokenizer's BOS etc. (completions: on; chat: off)",
    ),
    row("priority", BOTH, "vLLM, SGLang", IGNORED, "queue order only: the output is the same"),
    row(
        "routed_dp_rank",
        BOTH,
        "SGLang",
        IGNORED,
        "a data-parallel routing hint: one engine per pod here",
    ),
    row("data_parallel_rank", BOTH, "SGLang", IGNORED, "as routed_dp_rank"),
    row("disagg_prefill_dp_rank", BOTH, "SGLang", IGNORED, "as routed_dp_rank"),
    row("extra_key", BOTH, "SGLang", IGNORED, "a caller's classification label"),
    row("custom_labels", BOTH, "SGLang", IGNORED, "metric labels", whole=True),
    row("request_id", BOTH, "vLLM", NEUTRAL_ONLY, "refused: response ids are the server's"),
    row("rid", BOTH, "SGLang", NEUTRAL_ONLY, "refused: response ids are the server's", whole=True),
    row("cache_salt", BOTH, "vLLM, SGLang", NEUTRAL_ONLY, "refused: one prefix cache per model", whole=True),
    row("prompt_logprobs", BOTH, "vLLM", NEUTRAL_ONLY, "refused: use echo with logprobs (completions)"),
    row("return_tokens_as_token_ids", BOTH, "vLLM", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("allowed_token_ids", BOTH, "vLLM", NEUTRAL_ONLY, _NOT_HERE),
    row("bad_words", BOTH, "vLLM", NEUTRAL_ONLY, _NOT_HERE, neutral=([],)),
    row("use_beam_search", BOTH, "vLLM", NEUTRAL_ONLY, "refused: no beam search", neutral=(False,)),
    row("length_penalty", BOTH, "vLLM", NEUTRAL_ONLY, "beam search only: 1.0", neutral=(1.0, 1)),
    row("kv_transfer_params", BOTH, "vLLM", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("vllm_xargs", BOTH, "vLLM", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("mm_processor_kwargs", BOTH, "vLLM", NEUTRAL_ONLY, _TEXT_ONLY, whole=True),
    row("lora_path", BOTH, "SGLang", NEUTRAL_ONLY, "refused: no LoRA adapters", whole=True),
    row("session_id", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE),
    row("session_params", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("custom_logit_processor", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("custom_params", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("stop_regex", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("return_hidden_states", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("return_routed_experts", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("routed_experts_start_len", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(0,)),
    row("return_cached_tokens_details", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("return_token_ids", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("images_config", BOTH, "SGLang", NEUTRAL_ONLY, _TEXT_ONLY, whole=True),
    row("ngram_corpus_id", BOTH, "SGLang", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("bootstrap_host", BOTH, "SGLang", NEUTRAL_ONLY, "refused: no prefill/decode split", whole=True),
    row("bootstrap_port", BOTH, "SGLang", NEUTRAL_ONLY, "refused: no prefill/decode split", whole=True),
    row("bootstrap_room", BOTH, "SGLang", NEUTRAL_ONLY, "refused: no prefill/decode split", whole=True),
    # ------------------------------------------------------------------ vLLM / SGLang, chat
    row(
        "chat_template_kwargs",
        CHAT,
        "vLLM, SGLang",
        IMPLEMENTED,
        "extra variables for the chat template (Qwen3's enable_thinking)",
        whole=True,
    ),
    row("add_generation_prompt", CHAT, "vLLM", IMPLEMENTED, "the assistant turn's opening (default true)"),
    row(
        "continue_final_message",
        CHAT,
        "vLLM, SGLang",
        IMPLEMENTED,
        "the last (assistant) message is continued, not closed",
    ),
    row(
        "separate_reasoning",
        CHAT,
        "SGLang",
        IMPLEMENTED,
        "false leaves the reasoning in content (with --reasoning-parser)",
    ),
    row(
        "stream_reasoning",
        CHAT,
        "SGLang",
        NEUTRAL_ONLY,
        "true only: reasoning streams as it comes",
        neutral=(True,),
    ),
    row("echo", CHAT, "vLLM", NEUTRAL_ONLY, "refused: the last message is not echoed", neutral=(False,)),
    row("documents", CHAT, "vLLM", NEUTRAL_ONLY, "refused: no retrieval documents", whole=True),
    row("chat_template", CHAT, "vLLM", NEUTRAL_ONLY, "refused: the server's template (--chat-template)"),
    row("tool_parser", CHAT, "vLLM", NEUTRAL_ONLY, "refused: the server's parser (--tool-call-parser)"),
    row("input_ids", CHAT, "SGLang", NEUTRAL_ONLY, "refused: send token ids to /v1/completions", whole=True),
    row("return_prompt_token_ids", CHAT, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("return_meta_info", CHAT, "SGLang", NEUTRAL_ONLY, _NOT_HERE, neutral=(False,)),
    row("max_dynamic_patch", CHAT, "SGLang", NEUTRAL_ONLY, _TEXT_ONLY),
    row("min_dynamic_patch", CHAT, "SGLang", NEUTRAL_ONLY, _TEXT_ONLY),
    row("use_audio_in_video", CHAT, "SGLang", NEUTRAL_ONLY, _TEXT_ONLY, neutral=(False,)),
    row("task", CHAT, "SGLang", NEUTRAL_ONLY, _NOT_HERE),
    # ------------------------------------------------------------------ OpenAI, responses
    row("model", RESPONSES, "OpenAI", IMPLEMENTED, "must name the served model (404 otherwise)"),
    row(
        "input",
        RESPONSES,
        "OpenAI",
        IMPLEMENTED,
        "text, or message, function_call, function_call_output and reasoning items",
        whole=True,
    ),
    row(
        "input[].content[].type",
        RESPONSES,
        "OpenAI",
        NEUTRAL_ONLY,
        "input_text, output_text and refusal parts only: this server serves text-only models",
        neutral=("input_text", "output_text", "refusal"),
    ),
    row("instructions", RESPONSES, "OpenAI", IMPLEMENTED, "a first system message (not carried over)"),
    row(
        "previous_response_id",
        RESPONSES,
        "OpenAI",
        IMPLEMENTED,
        "continues a stored response's conversation (per API key, --response-ttl)",
    ),
    row("tools", RESPONSES, "OpenAI", IMPLEMENTED, "function tools (other types: 400)", whole=True),
    row("tool_choice", RESPONSES, "OpenAI", IMPLEMENTED, "none, auto, required, a function", whole=True),
    row("parallel_tool_calls", RESPONSES, "OpenAI", IMPLEMENTED, "false keeps one call"),
    row("text", RESPONSES, "OpenAI", IMPLEMENTED, "the output's format"),
    row(
        "text.format",
        RESPONSES,
        "OpenAI",
        IMPLEMENTED,
        "text, json_object, json_schema: enforced by a grammar",
        whole=True,
    ),
    row("text.verbosity", RESPONSES, "OpenAI", NEUTRAL_ONLY, "medium only", neutral=("medium",)),
    row("reasoning", RESPONSES, "OpenAI", IMPLEMENTED, "reasoning options"),
    row("reasoning.effort", RESPONSES, "OpenAI", IMPLEMENTED, "as chat's reasoning_effort"),
    row(
        "reasoning.summary",
        RESPONSES,
        "OpenAI",
        IGNORED,
        "the reasoning comes whole as reasoning_text (with --reasoning-parser), not summarised",
    ),
    row("reasoning.generate_summary", RESPONSES, "OpenAI", IGNORED, "deprecated name of reasoning.summary"),
    row("max_output_tokens", RESPONSES, "OpenAI", IMPLEMENTED, "output bound; cut: status incomplete"),
    row("temperature", RESPONSES, "OpenAI", IMPLEMENTED, "in [0, 2]"),
    row("top_p", RESPONSES, "OpenAI", IMPLEMENTED, "in (0, 1]"),
    row("stream", RESPONSES, "OpenAI", IMPLEMENTED, "OpenAI's response events"),
    row("stream_options", RESPONSES, "OpenAI", IMPLEMENTED, "only with stream: true"),
    row(
        "stream_options.include_obfuscation",
        RESPONSES,
        "OpenAI",
        IGNORED,
        "OpenAI pads events against length side channels; the text is the same without",
    ),
    row("ignore_eos", RESPONSES, "vLLM", IMPLEMENTED, "generate to max_output_tokens (benchmarks send it)"),
    row("store", RESPONSES, "OpenAI", IMPLEMENTED, "true (default): kept for GET and previous_response_id"),
    row("metadata", RESPONSES, "OpenAI", IMPLEMENTED, "kept with the response and shown in it", whole=True),
    row("user", RESPONSES, "OpenAI", IGNORED, "labels requests for a provider's abuse monitoring"),
    row(
        "safety_identifier", RESPONSES, "OpenAI", IGNORED, "labels requests for a provider's abuse monitoring"
    ),
    row("prompt_cache_key", RESPONSES, "OpenAI", IGNORED, "a caching hint (see chat)"),
    row("prompt_cache_options", RESPONSES, "OpenAI", IGNORED, "a caching hint (see chat)", whole=True),
    row("prompt_cache_retention", RESPONSES, "OpenAI", IGNORED, "a caching hint (see chat)"),
    row("max_tool_calls", RESPONSES, "OpenAI", IGNORED, "bounds built-in tool calls: there are none here"),
    row(
        "include",
        RESPONSES,
        "OpenAI",
        NEUTRAL_ONLY,
        "nothing extra to include (reasoning comes whole, never encrypted)",
        neutral=([], ["reasoning.encrypted_content"]),
    ),
    row("top_logprobs", RESPONSES, "OpenAI", NEUTRAL_ONLY, "0 only: use chat for logprobs", neutral=(0,)),
    row(
        "truncation",
        RESPONSES,
        "OpenAI",
        NEUTRAL_ONLY,
        "disabled only: an input over the context is a 400",
        neutral=("disabled",),
    ),
    row(
        "background",
        RESPONSES,
        "OpenAI",
        NEUTRAL_ONLY,
        "false only: no background responses",
        neutral=(False,),
    ),
    row("background_options", RESPONSES, "OpenAI", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("conversation", RESPONSES, "OpenAI", NEUTRAL_ONLY, "refused: use previous_response_id", whole=True),
    row("prompt", RESPONSES, "OpenAI", NEUTRAL_ONLY, "refused: no stored prompt templates", whole=True),
    row("context_management", RESPONSES, "OpenAI", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row("image", RESPONSES, "OpenAI", NEUTRAL_ONLY, _TEXT_ONLY, whole=True),
    row("moderation", RESPONSES, "OpenAI", NEUTRAL_ONLY, _NOT_HERE, whole=True),
    row(
        "service_tier",
        RESPONSES,
        "OpenAI",
        NEUTRAL_ONLY,
        "auto and default only",
        neutral=("auto", "default"),
    ),
    row("access_programs", RESPONSES, "OpenAI", NEUTRAL_ONLY, _NOT_HERE, whole=True),
)


def rules(endpoint: str) -> dict[str, FieldRule]:
    """The endpoint's rows by path."""
    return {r.path: r for r in FIELDS if endpoint in r.endpoints}


def refused(body: BaseModel, endpoint: str) -> tuple[str, str] | None:
    """The first field of ``body`` set to a value this server does not serve: (where, message)."""
    return refused_by(body, rules(endpoint).values())


def markdown_table(endpoint: str) -> str:
    """The endpoint's rows as the Markdown table docs/api.md shows (a test holds the two equal)."""
    return markdown(rules(endpoint).values())


def write_docs(path: str) -> None:
    """Rewrite the tables between ``<!-- fields:ENDPOINT -->`` markers of ``path`` (docs/api.md):
    ``python -m radixserve.tokenizer.openai_api.fields docs/api.md`` after changing a row."""
    from pathlib import Path

    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    for endpoint in (CHAT, COMPLETIONS, RESPONSES):
        marks = (f"<!-- fields:{endpoint} -->\n", f"<!-- /fields:{endpoint} -->")
        start, end = text.index(marks[0]), text.index(marks[1])
        text = text[:start] + marks[0] + markdown_table(endpoint) + text[end:]
    doc.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    import sys

    write_docs(sys.argv[1])
