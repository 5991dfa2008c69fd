"""Mixture-of-experts models (Qwen3-MoE with dense and sparse layers, Qwen2-MoE with its shared
expert, Mixtral) on tiny random-weight folders, HF transformers the reference: the op's two
implementations against each other and against the per-token formula, the config's reading of
each architecture, and the engine's greedy tokens with every engine feature on (the logits and
plain greedy runs are test_engine.py's, whose ``model_dir`` includes these architectures; the
loader's checks are test_loader.py's; tensor parallelism is test_tensor_parallel.py's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from radixserve import Engine, SamplingParams
from radixserve.common.demo_moe import MOE_ARCHS
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.moe_config import MoEConfig, moe_config
from radixserve.scheduler.model.moe_ops import EXPERTS, route
from radixserve.scheduler.model.ops import TorchOps
from radixserve.scheduler.model.quant.fp8 import ScaleLayout
from radixserve.scheduler.model.quant.linear import Fp8Experts, Fp8Linear
from tests.helpers.hf import NEW, PROMPTS, hf_greedy


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_dir(request, demo_model):
    return demo_model(request.param)


@pytest.fixture(scope="module")
def moe_ref(moe_dir):
    return hf_greedy(moe_dir, PROMPTS)


# ------------------------------------------------------------------------------ the op
def per_token_reference(x, logits, gate_up, down, top_k, renormalize):
    """HF's formula, one token and one expert at a time."""
    out = torch.zeros_like(x)
    probs = torch.softmax(logits.float(), dim=-1)
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], top_k)
        w = w / w.sum() if renormalize else w
        for weight, e in zip(w.tolist(), ids.tolist(), strict=True):
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("experts", sorted(EXPERTS))
@pytest.mark.parametrize("renormalize", [False, True])
def test_both_implementations_compute_the_per_token_formula(experts, renormalize):
    g = torch.Generator().manual_seed(0)
    tokens, hidden, width, num = 9, 16, 8, 6
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, num, generator=g)
    logits[:, 5] = -30.0  # an expert no token picks: its group is empty
    gate_up, down = (
        torch.randn(num, 2 * width, hidden, generator=g),
        torch.randn(num, hidden, width, generator=g),
    )
    ops = TorchOps(experts)
    got = ops.moe(x, logits, gate_up, down, 3, renormalize)
    want = per_token_reference(x, logits, gate_up, down, 3, renormalize)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert ops.moe(x[:1], logits[:1], gate_up, down, 3, renormalize).shape == (1, hidden)


def test_routing_weights_are_float32_and_renormalised_on_request():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.bfloat16)
    r = route(logits, 2, renormalize=False)
    assert r.ids.tolist() == [[0, 1]] and r.weights.dtype == torch.float32
    assert r.weights.sum().item() < 1.0
    assert route(logits, 2, renormalize=True).weights.sum().item() == pytest.approx(1.0)
    # the (token, slot) rows sorted by expert: token 0's slots 0 (expert 0) and 1 (expert 1)
    assert r.order.tolist() == [0, 1] and r.token.tolist() == [0, 0] and r.experts.tolist() == [0, 1]


# ------------------------------------------------------------------------------ config
def test_each_architecture_reads_its_experts(moe_dir):
    cfg = ModelConfig.from_pretrained(moe_dir)
    moe = cfg.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 32)
    shape = {  # (sparse layers, shared expert width, renormalised, q/k norm, q/k/v bias)
        "qwen3_moe": ((1,), 0, True, True, False),
        "qwen2_moe": ((0, 1), 64, False, False, True),
        "mixtral": ((0, 1), 0, True, False, False),
    }[cfg.arch]
    assert (
        moe.sparse_layers,
        moe.shared_intermediate_size,
        moe.renormalize,
        cfg.qk_norm,
        cfg.qkv_bias,
    ) == shape


def test_sparse_layers_follow_the_sparse_step_and_the_dense_only_list():
    hf = Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=8)
    assert moe_config(hf, "qwen3_moe", 6) == MoEConfig(8, 8, 768, False, 0, (1, 5))
    assert moe_config(Qwen2MoeConfig(num_experts=0), "qwen2_moe", 4) is None  # no experts: dense
    assert moe_config(hf, "qwen3", 6) is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is not between 1 and the 4 experts"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok 0 is not between 1 and the 4 experts"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
    ],
    ids=["top-k-above-experts", "top-k-zero", "sliding-window"],
)
def test_an_unservable_routing_is_refused_at_load_in_one_line(change, error):
    hf = Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, **change)
    with pytest.raises(ValueError, match=error) as e:
        moe_config(hf, "qwen3_moe", 2)
    assert "\n" not in str(e.value)


def test_experts_split_over_ranks_only_where_their_width_divides():
    moe = MoEConfig(4, 2, 32, True, 48, (0, 1))
    assert moe.tp_problem(2) is None and moe.split(2).intermediate_size == 16
    assert moe.split(2).shared_intermediate_size == 24
    assert moe.tp_problem(3) == "tp_size 3 does not divide the experts' MLP size 32"
    assert "shared expert's MLP size 48" in (MoEConfig(4, 2, 32, True, 48, (0,)).tp_problem(32) or "")


# ------------------------------------------------------------------------------ the engine
def test_greedy_equals_hf_with_chunking_radix_cache_overlap_and_the_padded_static_decode(moe_dir, moe_ref):
    # Graph buckets 1, 2, 4: six requests of different lengths decode eagerly, then padded (3 -> 4).
    greedy = [SamplingParams(max_new_tokens=NEW - i, temperature=0, ignore_eos=True) for i in range(6)]
    with Engine(
        moe_dir, max_total_tokens=2048, page_size=16, chunked_prefill_size=16, disable_overlap=False,
        cpu_overlap_thread_min_ms=0, max_running_requests=8, cpu_static_decode=True, cuda_graph_max_bs=4,
    ) as engine:  # fmt: skip
        assert engine.profile.moe == "torch"  # the CPU's: grouped GEMM kernels need CUDA
        for _ in range(2):  # the second round hits what the first cached
            outs = engine.generate(prompt=PROMPTS, sampling_params=greedy)
            assert [o["token_ids"] for o in outs] == [ref[: NEW - i] for i, ref in enumerate(moe_ref)]
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        graphs = engine.runner.graphs
        assert graphs.eager_static > 0 and graphs.padded > 0
        kv = engine.scheduler.kv
        assert kv.available() == kv.capacity


def test_greedy_equals_hf_under_decode_retraction(moe_dir, moe_ref):
    with Engine(
        moe_dir, max_total_tokens=96, init_new_token_ratio=0.0, page_size=1, chunked_prefill_size=0,
        disable_overlap=True, max_running_requests=8, cpu_static_decode=True, cuda_graph_max_bs=8,
    ) as engine:  # fmt: skip
        outs = engine.generate(
            prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
        assert engine.scheduler.num_retractions > 0
        assert [o["token_ids"] for o in outs] == moe_ref
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


def test_quantization_fp8_quantizes_every_projection_and_the_experts_but_not_the_routers(moe_dir):
    """``--quantization fp8`` on an MoE model: attention, the dense layers' MLPs, Qwen2-MoE's shared
    expert and every layer's experts become FP8 (per output row); the routers (and Qwen2-MoE's
    shared-expert gate) stay in the checkpoint's precision. test_fp8_moe.py holds the numbers."""
    cfg = ModelConfig.from_pretrained(moe_dir, quantization="fp8")
    model = load_model(moe_dir, cfg, "cpu")
    sparse = model.model.layers[cfg.moe.sparse_layers[0]]
    assert isinstance(sparse.self_attn.qkv_proj, Fp8Linear)
    experts = sparse.mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.down_proj.layout == ScaleLayout()
    assert experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert sparse.mlp.gate.weight.dtype == cfg.dtype
    if cfg.moe.shared_intermediate_size:
        assert isinstance(sparse.mlp.shared_expert.gate_up_proj, Fp8Linear)
        assert sparse.mlp.shared_expert_gate.weight.dtype == cfg.dtype
    with Engine(moe_dir, max_total_tokens=1024, quantization="fp8") as engine:
        outs = engine.generate(
            prompt=PROMPTS[:2], sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True)
        )
    assert [len(o["token_ids"]) for o in outs] == [4, 4]
