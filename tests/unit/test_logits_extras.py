"""Logprobs, penalties and logit bias in the engine, against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve import Engine, SamplingParams

PROMPTS = [
    "You are a helpful assistant. Answer briefly.\ndef add(a, b):",
    "import os\nimport sys",
    "The quick brown fox",
]
NEW = 10
K = 4


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("qwen3")


@pytest.fixture(scope="module")
def hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits at every position of ``ids``: [len, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_generate(hf, **kwargs) -> list[list[int]]:
    """HF greedy ``generate`` of NEW tokens per prompt (no EOS stop)."""
    model, tok = hf
    out = []
    for p in PROMPTS:
        ids = tok.encode(p)
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


def check_entry(entry, lp_row: torch.Tensor, token: int, k: int) -> None:
    logprob, top_ids, top = entry
    assert logprob == pytest.approx(lp_row[token].item(), abs=1e-4)
    ref = torch.topk(lp_row, k)
    assert top == pytest.approx(ref.values.tolist(), abs=1e-4)
    # ids agree wherever the reference's values are not (near) tied
    for i, (a, b) in enumerate(zip(top_ids, ref.indices.tolist(), strict=True)):
        near = [j for j in range(k) if abs(ref.values[j] - ref.values[i]) < 1e-4]
        assert a == b or any(top_ids[i] == ref.indices[j] for j in near)


@pytest.mark.parametrize(("overlap", "chunk"), [(False, 0), (True, 8)])
def test_logprobs_equal_hf_log_softmax_for_outputs_and_prompt(model_dir, hf, overlap, chunk):
    model, tok = hf
    sp = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    with Engine(
        model_dir, max_total_tokens=2048, disable_overlap=not overlap, cpu_overlap_thread_min_ms=0,
        chunked_prefill_size=chunk,
    ) as engine:  # fmt: skip
        plain = engine.generate(
            prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
        for _ in range(2):  # the second round's prompts are cached: the scores must still all be there
            outs = engine.generate(prompt=PROMPTS, sampling_params=sp)
            for p, o in zip(PROMPTS, outs, strict=True):
                ids = tok.encode(p)
                lp = teacher_forced(model, ids + o["token_ids"])
                assert len(o["output_logprobs"]) == NEW
                for j, entry in enumerate(o["output_logprobs"]):
                    check_entry(entry, lp[len(ids) - 1 + j], o["token_ids"][j], K)
                prompt = o["prompt_logprobs"]
                assert len(prompt) == len(ids) and prompt[0] is None
                for i in range(1, len(ids)):
                    check_entry(prompt[i], lp[i - 1], ids[i], K)
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain]  # scoring changes no token


def test_max_tokens_zero_scores_the_prompt_only(model_dir, hf):
    model, tok = hf
    with Engine(model_dir, max_total_tokens=2048) as engine:
        out = engine.generate(
            prompt=PROMPTS[0], sampling_params=SamplingParams(max_new_tokens=0, prompt_logprobs=1)
        )
        assert out["token_ids"] == [] and out["finish_reason"] == "length"
        ids = tok.encode(PROMPTS[0])
        lp = teacher_forced(model, ids)
        assert [e[0] for e in out["prompt_logprobs"][1:]] == pytest.approx(
            [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4
        )
        with pytest.raises(ValueError, match="max_new_tokens"):  # 0 only when the prompt is scored
            engine.generate(prompt=PROMPTS[0], sampling_params=SamplingParams(max_new_tokens=0))
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


@pytest.mark.parametrize("overlap", [False, True])
def test_repetition_penalty_equals_hf_generate(model_dir, hf, overlap):
    ref, plain = hf_generate(hf, repetition_penalty=1.5), hf_generate(hf)
    assert ref != plain  # the penalty changes what greedy picks: the comparison below can fail
    with Engine(
        model_dir, max_total_tokens=2048, disable_overlap=not overlap, cpu_overlap_thread_min_ms=0
    ) as engine:
        # penalised and plain requests in the same batches
        params = [
            SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, repetition_penalty=1.5)
        ] * 3
        params += [SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)] * 3
        outs = engine.generate(prompt=PROMPTS * 2, sampling_params=params)
    assert [o["token_ids"] for o in outs] == ref + plain


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_and_logprobs_survive_retraction(model_dir, hf, overlap):
    """Retracted requests drop tokens the device already counted: their rows are rebuilt when they
    sample again, and their logprobs (prompt and output) are whole and right."""
    ref = hf_generate(hf, repetition_penalty=1.5)
    _, tok = hf
    with Engine(
        model_dir,
        disable_overlap=not overlap,
        cpu_overlap_thread_min_ms=0,
        max_total_tokens=64,
        init_new_token_ratio=0.0,
        chunked_prefill_size=0,
        max_running_requests=8,
    ) as engine:
        sp = SamplingParams(
            max_new_tokens=NEW,
            temperature=0,
            ignore_eos=True,
            repetition_penalty=1.5,
            logprobs=2,
            prompt_logprobs=2,
        )
        outs = engine.generate(prompt=PROMPTS, sampling_params=sp)
        assert engine.scheduler.num_retractions > 0
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
    assert [o["token_ids"] for o in outs] == ref
    model = hf[0]
    for p, o in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(p)
        lp = teacher_forced(model, ids + o["token_ids"])
        assert [e[0] for e in o["output_logprobs"]] == pytest.approx(
            [lp[len(ids) - 1 + j, t].item() for j, t in enumerate(o["token_ids"])], abs=1e-4
        )
        assert [e[0] for e in o["prompt_logprobs"][1:]] == pytest.approx(
            [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4
        )


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.8), (-0.5, 1.0)])
def test_presence_and_frequency_penalties_follow_openais_formula(model_dir, hf, presence, frequency):
    """Every greedy step picks the argmax of raw logits - frequency * count - presence * (count > 0),
    counts over the generated tokens, the raw logits from HF on the same sequence."""
    model, tok = hf
    sp = SamplingParams(
        max_new_tokens=16,
        temperature=0,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    with Engine(model_dir, max_total_tokens=2048) as engine:
        outs = engine.generate(prompt=PROMPTS, sampling_params=sp)
    changed = False
    for p, o in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(p)
        lp = teacher_forced(model, ids + o["token_ids"])
        counts = torch.zeros(lp.shape[1])
        for j, t in enumerate(o["token_ids"]):
            row = lp[len(ids) - 1 + j] - frequency * counts - presence * (counts > 0).float()
            assert t == int(row.argmax()), f"step {j}"
            changed |= t != int(lp[len(ids) - 1 + j].argmax())
            counts[t] += 1
    assert changed  # some step picked another token than plain greedy


def test_logit_bias_moves_the_chosen_token(model_dir):
    with Engine(model_dir, max_total_tokens=2048) as engine:
        free = engine.generate(
            prompt=PROMPTS[1], sampling_params=SamplingParams(max_new_tokens=6, temperature=0)
        )
        banned = free["token_ids"][0]
        out = engine.generate(
            prompt=PROMPTS[1],
            sampling_params=SamplingParams(
                max_new_tokens=6, temperature=0, logit_bias=((banned, -100.0), (42, 0.0))
            ),
        )
        assert banned not in out["token_ids"]
        forced = engine.generate(
            prompt=PROMPTS[1],
            sampling_params=SamplingParams(
                max_new_tokens=6, temperature=0.8, seed=3, logit_bias=((42, 100.0),)
            ),
        )
        assert forced["token_ids"] == [42] * 6
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
