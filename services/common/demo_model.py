"""Build a small random-weight Hugging Face model folder, offline, for tests and CPU benchmarks.

``make_demo_model(path, arch, size, seed)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files, so that ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load it with no network. Nothing is downloaded:

* the tokenizer is a byte-level BPE trained on a fixed list of stdlib ``.py`` files of the running
  Python (so it is identical on every machine with the same Python), with ChatML special tokens and
  a ChatML chat template;
* the model is built from the transformers config class of the chosen architecture with seeded
  random weights (a larger ``initializer_range`` than usual so greedy decoding is not degenerate);
  the mixture-of-experts architectures (Qwen3-MoE, Qwen2-MoE, Mixtral) are in demo_moe.py;
* ``thinking=True`` makes a Qwen3-style thinking model's folder: ``<think>`` and ``</think>`` are
  added tokens, and the chat template takes ``enable_thinking`` (false: an empty think block ends
  the prompt) and renders an assistant's ``reasoning_content`` (for --reasoning-parser qwen3).

The same ``(arch, size, seed)`` gives byte-identical files on the same machine.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from radixserve.common.demo_hybrid import HYBRID_ARCHS, hybrid_model_config, perturb
from radixserve.common.demo_moe import MOE_ARCHS, moe_model_config

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

ARCHS = ("llama", "qwen2", "qwen3")  # dense; demo_moe.MOE_ARCHS and demo_hybrid.HYBRID_ARCHS too
SIZES = ("tiny", "small")

VOCAB_SIZE = 2048
# "<|endoftext|>" is the document end (and what transformers' Qwen2Tokenizer expects as unk/eos).
EOS, BOS, PAD, IM_START, IM_END = "<|endoftext|>", "<|bos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, BOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

# Qwen2's pre-tokenizer split (digits one by one, etc.). transformers loads a folder whose
# model_type is "qwen2" with its own Qwen2Tokenizer, which rebuilds the pipeline from vocab + merges
# as NFC + this split + ByteLevel; every arch uses that same pipeline so they all tokenize alike.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML with Qwen2.5-style (Hermes) tool calling. Without tools every message renders as
# "<|im_start|>{role}\n{content}<|im_end|>\n". With tools, a system turn (holding the first system
# message's text, if any) lists them as JSON inside <tools></tools>; past calls render as
# <tool_call> blocks in the assistant turn (content may be None); consecutive "tool" results render
# as one user turn of <tool_response> blocks. radixserve.tokenizer.text.tool_calls parses the answers.
# Every tag strips the whitespace before it ("{%-", "{{-"), so only the quoted strings are output.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou can call functions to help with the request. Their signatures are listed, one JSON \
object per line, between <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, answer with one block per call, each holding a JSON object with \
the name of the function and its arguments:\n<tool_call>\n{"name": <function-name>, "arguments": \
<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if tools and loop.first and message.role == 'system' %}
        {#- already in the tools system turn #}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

THINK_START, THINK_END = "<think>", "</think>"

# CHAT_TEMPLATE with Qwen3's thinking switch: a past assistant turn shows its reasoning_content in a
# think block; enable_thinking false closes an empty one at the end of the prompt.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    """    {%- elif message.role == 'tool' %}""",
    """    {%- elif message.role == 'assistant' and message.reasoning_content is defined \
and message.reasoning_content %}
        {{- '<|im_start|>assistant\n<think>\n' + message.reasoning_content + '\n</think>\n\n' \
+ message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}""",
).replace(
    """    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""",
    """    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""",
)

# A Llama-3.1-style template with JSON tool calling (not the demo model's default: tests set it to
# exercise the llama3_json parser). The header tokens are plain text to the demo tokenizer. With
# tools, the system turn says "Environment: ipython" and lists them as JSON; past calls render as
# {"name": ..., "parameters": ...} ("; "-separated); "tool"/"ipython" results as ipython turns.
LLAMA3_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- if tools or system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if tools %}
        {{- 'Environment: ipython\n\n' }}
    {%- endif %}
    {{- system_message }}
    {%- if tools %}
        {%- if system_message %}
            {{- '\n\n' }}
        {%- endif %}
        {{- 'Given the following functions, answer with a JSON object that calls the one that best \
serves the request, in the format {"name": function name, "parameters": dictionary of argument names \
and values}. Use literal values, not variables.\n\n' }}
        {%- for tool in tools %}
            {{- (tool | tojson(indent=4)) + '\n\n' }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if not loop.first %}
                {{- '; ' }}
            {%- endif %}
            {{- '{"name": ' + (fn.name | tojson) + ', "parameters": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role in ('tool', 'ipython') %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content | trim) \
+ '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


class Shape(TypedDict):
    """A demo model's shape: keyword arguments of the transformers config."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    initializer_range: float


class _ConfigArgs(Shape):
    """Every arch's config arguments but the special token ids."""

    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    dtype: str


# Shapes per size. "tiny": tests (~0.3M params). "small": CPU benchmarks (~27M params).
# initializer_range is far above the usual 0.02 so a random model's logits are not flat: it gives a
# last-position logit std of ~1.6 (tiny) / ~2.2 (small), greedy decoding that varies with the prompt
# and does not lock onto one repeated token, and clear top-1 margins (stable greedy comparisons).
SHAPES: dict[str, Shape] = {
    "tiny": Shape(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        initializer_range=0.2,
    ),
    "small": Shape(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        initializer_range=0.1,
    ),
}

# Stdlib modules present in every CPython >= 3.10, read in this order; missing ones are skipped.
_CORPUS_FILES = (
    "argparse.py",
    "ast.py",
    "base64.py",
    "calendar.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "json/decoder.py",
    "json/encoder.py",
    "os.py",
    "pathlib.py",
    "random.py",
    "shutil.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)

# A little prose (and non-ASCII) so chat-like text is not all Python.
_EXTRA_TEXT = """\
The quick brown fox jumps over the lazy dog. A user asks a question and the assistant answers it.
You are a helpful assistant. Please summarise the following document in three sentences.
What is the capital of France? The capital of France is Paris. Hello, world! How are you today?
Héllo wörld, ça va? 你好，世界。こんにちは。Привет, мир! 1 + 1 = 2; 3 * 4 = 12; 2 ** 10 = 1024.
"""


def _corpus() -> list[str]:
    stdlib = Path(os.path.dirname(os.__file__))
    texts = []
    for name in _CORPUS_FILES:
        p = stdlib / name
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    texts.append(_EXTRA_TEXT)
    return texts


@functools.cache
def _trained_bpe(vocab_size: int) -> str:
    """The BPE trained on the corpus, as tokenizers' JSON: trained once per process (the same
    corpus and settings give the same tokenizer, and training is most of a demo model's build)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return str(tok.to_str())


def build_tokenizer(vocab_size: int = VOCAB_SIZE, thinking: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens and chat template;
    ``thinking``: plus Qwen3's <think> tokens and thinking template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_bpe(vocab_size))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,  # chat turns end with <|im_end|>; <|endoftext|> also stops (generation_config)
        pad_token=PAD,
        additional_special_tokens=[EOS, IM_START],
        chat_template=THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    if thinking:  # as Qwen3 has them: added, not special (they show in decoded text)
        from tokenizers import AddedToken

        fast.add_tokens([AddedToken(THINK_START, special=False), AddedToken(THINK_END, special=False)])
    return fast


def model_config(
    arch: str, size: str, vocab_size: int, ids: dict[str, Any], dtype: str = "float32"
) -> PretrainedConfig:
    """The transformers config of the demo model ``arch`` / ``size`` (``ids``: special token ids,
    keyword arguments of the config: ``save_random_model`` hands them over)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = _ConfigArgs(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        dtype=dtype,
        **SHAPES[size],
    )
    if arch in MOE_ARCHS:
        return moe_model_config(arch, size, dict(common), ids)
    if arch in HYBRID_ARCHS:
        return hybrid_model_config(arch, size, dict(common), ids)
    if arch == "llama":
        rope: dict[str, str | float] = {"rope_type": "default", "rope_theta": 10000.0}
        if size == "tiny":  # exercise llama3-style rope scaling
            rope = {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        return LlamaConfig(tie_word_embeddings=False, rope_parameters=rope, **common, **ids)
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if arch == "qwen2":  # Qwen2 always has q/k/v bias
        # transformers: Qwen2Config has no head_dim field; it takes it (like any extra attribute)
        # through **kwargs its generated signature does not show.
        return Qwen2Config(tie_word_embeddings=True, rope_parameters=rope, **common, **ids)  # type: ignore[misc]
    if arch == "qwen3":  # Qwen3 has q/k RMSNorm; head_dim is set explicitly by SHAPES
        return Qwen3Config(tie_word_embeddings=True, rope_parameters=rope, **common, **ids)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def make_demo_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    thinking: bool = False,
) -> Path:
    """Write a random-weight HF model folder for ``arch`` / ``size`` to ``path``; return the path.
    ``thinking``: a Qwen3-style thinking model's tokenizer and template (the module's docstring)."""
    if arch not in ARCHS + MOE_ARCHS + HYBRID_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + MOE_ARCHS + HYBRID_ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    adjust = perturb if arch in HYBRID_ARCHS else None
    return save_random_model(
        path, lambda vocab, ids: model_config(arch, size, vocab, ids), "float32", seed, thinking, adjust
    )


def save_random_model(
    path: str | os.PathLike[str],
    make_config: Callable[[int, dict[str, Any]], PretrainedConfig],
    dtype: str = "float32",
    seed: int = 0,
    thinking: bool = False,
    adjust: Callable[[nn.Module], None] | None = None,
) -> Path:
    """Write a random-weight HF folder with the demo tokenizer: ``make_config(vocab_size,
    special_token_ids)`` returns the transformers config (benchmarks pass other shapes, e.g.
    Qwen3-0.6B's); weights seeded with ``seed``, stored in ``dtype``, then changed in place by
    ``adjust`` (seeded too). The ids are the config's keyword arguments (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(thinking=thinking)
    ids: dict[str, int | list[int]] = dict(
        bos_token_id=_token_id(tokenizer, BOS),
        eos_token_id=[_token_id(tokenizer, IM_END), _token_id(tokenizer, EOS)],
        pad_token_id=_token_id(tokenizer, PAD),
    )
    config = make_config(len(tokenizer), ids)

    with torch.random.fork_rng(devices=[]):  # seeded weights, caller's RNG state left untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        if adjust is not None:
            adjust(model)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(tid, int)  # one token in, one id out
    return tid
