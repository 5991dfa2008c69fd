"""vLLM's min_tokens and include_stop_str_in_output in the offline Engine (the served path's
detokenizer side is tests/unit/test_detokenizer.py's): stop tokens are masked on the device until
min_new_tokens, stop strings are not looked for before them, and a matched stop string can stay in
the text; under both loops, the pool returned whole."""

from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams

PROMPT = "def fibonacci(n):\n    "
NEW = 24


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("llama")


@pytest.mark.parametrize("overlap", [False, True])
def test_min_new_tokens_and_include_stop_str(model_dir, overlap):
    kw = {"disable_overlap": not overlap, "cpu_overlap_thread_min_ms": 0}
    with Engine(model_dir, max_total_tokens=2048, **kw) as engine:
        greedy = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        first = engine.generate(prompt=PROMPT, sampling_params=greedy)["token_ids"]
        banned = first[0]  # greedy's first token: as a stop token it ends the output at once, unless held
        sp = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(banned,), min_new_tokens=4)
        out = engine.generate(prompt=PROMPT, sampling_params=sp)
        assert len(out["token_ids"]) >= 4 and banned not in out["token_ids"][:4], out
        full = engine.tokenizer.decode(first, skip_special_tokens=True)
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop.strip(), "the reference text must offer a visible stop string"
        sp = SamplingParams(
            max_new_tokens=NEW, temperature=0, stop=(stop,), ignore_eos=True, include_stop_str=True
        )
        out = engine.generate(prompt=PROMPT, sampling_params=sp)
        assert out["finish_reason"] == "stop" and out["text"].endswith(stop) and full.startswith(out["text"])
        sp = SamplingParams(
            max_new_tokens=NEW, temperature=0, stop=(stop,), ignore_eos=True, min_new_tokens=NEW
        )
        out = engine.generate(prompt=PROMPT, sampling_params=sp)
        assert out["finish_reason"] == "length" and out["token_ids"] == first  # never looked for
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
