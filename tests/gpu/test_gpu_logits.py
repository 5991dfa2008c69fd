"""CUDA tests: what runs between the model and the sampler (model/logits.py, penalties.py, the grammar
bitmask) gives on the GPU what it gives on CPU, and logprobs/penalties/grammar work end to end on CUDA.

Skipped without CUDA; the CPU tests (tests/unit/test_logits_extras.py, test_constrained_engine.py) hold
the semantics against HF transformers.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.common.demo_model import make_demo_model
from radixserve.common.sampling import Constraint
from radixserve.scheduler.grammar import apply_bitmask, mask_width
from radixserve.scheduler.model.penalties import PenaltyState, PenaltyStep
from tests.gpu.agreement import assert_equal_but_near_ties

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu  # per-test time limits: pyproject's default, or scripts/gpu-check's
DEV = torch.device("cuda")


def test_bitmask_and_penalties_equal_the_cpu_results():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 1000, 6
    logits = torch.randn(rows, vocab, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, mask_width(vocab)), dtype=torch.int32, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        x = logits.to(dev).clone()
        apply_bitmask(x, mask.to(dev))
        state = PenaltyState(8, vocab, torch.device(dev))
        step = PenaltyStep(
            rows=torch.tensor([0, 3, 5], device=dev),
            slots=torch.tensor([2, 7, 4], device=dev),
            params=torch.tensor([[0.5, 0.3, 1.2], [0.0, 1.0, 1.0], [1.0, 0.0, 0.8]], device=dev),
            resets=[
                (
                    s,
                    torch.randint(0, vocab, (40,), generator=g).to(dev),
                    torch.randint(0, vocab, (9,), generator=g).to(dev),
                )
                for s in (2, 7, 4)
            ],
        )
        y = logits.to(dev).clone()
        state.apply(y, step)
        state.count(step, torch.tensor([1, 2, 3, 4, 5, 6], device=dev))
        out[dev] = (x.cpu(), y.cpu(), state.counts.cpu())
    for a, b in zip(out["cpu"], out["cuda"], strict=True):
        torch.testing.assert_close(a, b)


def test_logprobs_penalties_and_json_schema_on_cuda(tmp_path):
    path = make_demo_model(tmp_path / "m", arch="qwen3", size="tiny")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"enum": ["x", "y"]}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    results = {}
    for device in ("cpu", "cuda"):
        with Engine(path, device=device, dtype="float32", max_total_tokens=4096) as engine:
            results[device] = engine.generate(
                prompt=["hello", "def f(x):", "json:"],
                sampling_params=[
                    SamplingParams(
                        max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3
                    ),
                    SamplingParams(
                        max_new_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.5, logprobs=2
                    ),
                    SamplingParams(
                        max_new_tokens=64,
                        temperature=1.0,
                        seed=1,
                        constraint=Constraint("json_schema", json.dumps(schema)),
                    ),
                ],
            )
    cpu, cuda = results["cpu"], results["cuda"]
    # float32 on both, but other kernels: log-probabilities close, tokens equal but at near-ties
    assert_equal_but_near_ties(cuda[:1], cpu[:1], 1e-3, "cuda vs cpu, float32")
    # The penalized request's log-probabilities are the model's, not the penalized scores its tokens
    # were chosen by, so they cannot show a near-tie: its tokens stay equal (a flip would need two
    # penalized scores within float32 rounding), its log-probabilities close.
    assert cuda[1]["token_ids"] == cpu[1]["token_ids"]
    for a, b in zip(cpu[1]["output_logprobs"], cuda[1]["output_logprobs"], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-3)
    for a, b in zip(cpu[0]["prompt_logprobs"][1:], cuda[0]["prompt_logprobs"][1:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-3)  # the prompt is the same on both: every position
    jsonschema.validate(json.loads(cuda[2]["text"]), schema)
