"""CUDA tests of the hybrid models (Gated DeltaNet + gated full attention): the engine on the GPU
gives the CPU engine's greedy tokens, with decode graphs capturing the state updates and the
flashinfer ops' offset RMSNorm; and where the device profile picks flash-linear-attention's kernels
(``fla`` installed, bfloat16), they agree with the torch gated delta rule on the same GPU.

Skipped without CUDA. Written without a GPU and not yet run on one (docs/models.md says so); the
CPU side (HF agreement, chunking, snapshots, the fla call held to its API by a stand-in) is
tests/unit/test_hybrid_model.py and test_hybrid_prefix.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.device import resolve_profile
from radixserve.scheduler.model.linear_kernels import make_delta_rule
from tests.gpu.agreement import assert_equal_but_near_ties
from tests.helpers.hf import PROMPTS

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
LONG = [p * 12 for p in PROMPTS[:3]]  # past the 64-token delta-rule chunks


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_cuda_engine_with_decode_graphs_equals_the_cpu_engine(demo_model, arch):
    path = demo_model(arch, "small")
    outs = {}
    for dev in ("cpu", "cuda"):
        with Engine(path, device=dev, dtype="float32", max_total_tokens=8192, chunked_prefill_size=48) as e:
            for _ in range(2):  # the second round resumes from snapshots
                outs[dev] = e.generate(prompt=PROMPTS + LONG, sampling_params=GREEDY)
            print(dev, e.profile.linear_attention, e.profile.notes)
            if dev == "cuda":
                assert e.runner.graphs.replays > 0
            assert e.scheduler.kv.available() == e.scheduler.kv.capacity
    assert_equal_but_near_ties(outs["cuda"], outs["cpu"], 0.05, f"{arch} cuda vs cpu")


def test_fla_kernels_agree_with_the_torch_delta_rule_in_bfloat16(demo_model):
    cfg = dataclasses.replace(ModelConfig.from_pretrained(demo_model("qwen3_5")), dtype=torch.bfloat16)
    profile = resolve_profile(cfg, device="cuda")
    (note,) = [n for n in profile.notes if n.startswith("linear attention")]
    print(note)
    if profile.linear_attention != "fla":
        pytest.skip(note)
    g = torch.Generator().manual_seed(0)
    t, h, dk, dv, lens = 300, 8, 128, 128, [37, 200, 63]
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v, gate = torch.randn(t, h, dv, generator=g), -torch.rand(t, h, generator=g)
    beta, states = torch.rand(t, h, generator=g), torch.randn(3, h, dk, dv, generator=g) * 0.1
    args = [x.cuda() for x in (q, k, v, gate, beta)]
    fla, ref = make_delta_rule("fla", torch.bfloat16), make_delta_rule("torch", torch.bfloat16)
    got = fla.extend(*args, lens, states.cuda())
    want = ref.extend(*args, lens, states.cuda())
    for a, b in zip(got, want, strict=True):
        err = ((a - b).abs().max() / b.abs().max()).item()
        print(f"fla vs torch: max error {err:.4f} of the largest value")
        assert err < 0.03  # bfloat16 inputs to the kernels
    rows = [x[:3] for x in args]
    for a, b in zip(fla.decode(*rows, states.cuda()), ref.decode(*rows, states.cuda()), strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() < 0.03
