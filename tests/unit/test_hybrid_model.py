"""The hybrid models (Qwen3.5, Qwen3-Next, Qwen3.5-MoE: Gated DeltaNet and gated full attention) on
tiny random-weight folders, HF transformers the reference: the gated delta rule and the convolution
against their step-by-step definitions and HF's functions, each architecture's config, the logits of
prefill, extend, decode and of a request resumed from a snapshot, and the engine's greedy tokens with
every engine feature on. The prefix cache's snapshots are test_hybrid_prefix.py's, the loader's
errors test_hybrid_loader.py's, tensor parallelism tests/integration/test_tensor_parallel.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from radixserve import Engine, SamplingParams
from radixserve.common.demo_hybrid import HYBRID_ARCHS
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.state_pool import StatePool
from radixserve.scheduler.model import gated_delta
from radixserve.scheduler.model.attention import TorchAttention
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.linear_attention import LinearStep
from radixserve.scheduler.model.linear_kernels import FlaDeltaRule, TorchDeltaRule, fla_unavailable
from radixserve.scheduler.model.loader import load_model
from tests.helpers.hf import NEW, PROMPTS, SYSTEM, hf_greedy, one_thread

# Two prompts longer than the delta rule's 64-token chunks, so prefill chunks of 48 cut through them.
LONG = [SYSTEM * 3 + "def mean(xs):", SYSTEM * 4 + "while True:"]


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid_dir(request, demo_model):
    return demo_model(request.param)


@pytest.fixture(scope="module")
def hybrid_ref(hybrid_dir):
    with one_thread():
        return hf_greedy(hybrid_dir, PROMPTS + LONG)


# ------------------------------------------------------------------------------ the kernels
def random_inputs(t: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = gated_delta.l2_normalize(torch.randn(t, heads, dk, generator=g)) * dk**-0.5
    k = gated_delta.l2_normalize(torch.randn(t, heads, dk, generator=g))
    v = torch.randn(t, heads, dv, generator=g)
    decay = -torch.rand(t, heads, generator=g) * 2  # log space, <= 0
    beta = torch.rand(t, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


def test_chunked_delta_rule_equals_its_token_by_token_definition_and_resumes_anywhere():
    q, k, v, g, beta, state = random_inputs(150)
    want, s = [], state[None]
    for t in range(150):
        o, s = gated_delta.recurrent_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s
        )
        want.append(o)
    out, final = gated_delta.chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(out, torch.cat(want), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, s[0], atol=1e-4, rtol=1e-4)
    # cut at 37 and 100 (neither a chunk boundary): the pieces chain through their states
    pieces, s = [], state
    for a, b in ((0, 37), (37, 100), (100, 150)):
        o, s = gated_delta.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        pieces.append(o)
    torch.testing.assert_close(torch.cat(pieces), out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, final, atol=1e-4, rtol=1e-4)


def test_delta_rule_matches_hf_chunked_and_recurrent_functions():
    q, k, v, g, beta, state = random_inputs(90, heads=4, dk=16, dv=16, seed=1)
    unscaled = q * 16**0.5  # HF scales the queries itself
    for fn in (hf_next.torch_chunk_gated_delta_rule, hf_next.torch_recurrent_gated_delta_rule):
        ref, ref_state = fn(
            unscaled[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            initial_state=state[None],
            output_final_state=True,
        )
        out, final = gated_delta.chunked(q, k, v, g, beta, state)
        torch.testing.assert_close(out, ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, ref_state[0], atol=1e-4, rtol=1e-4)


def test_causal_conv_in_one_go_equals_token_by_token_and_gives_the_state_at_any_point():
    g = torch.Generator().manual_seed(2)
    x, weight, state = (
        torch.randn(20, 6, generator=g),
        torch.randn(6, 4, generator=g),
        torch.randn(6, 3, generator=g),
    )
    out, padded = gated_delta.conv_extend(x, state, weight)
    s, steps = state[None], []
    for t in range(20):
        if t == 7:
            torch.testing.assert_close(padded[:, 7:10], s[0])  # the state after 7 tokens is a window
        y, s = gated_delta.conv_step(x[t : t + 1], s, weight)
        steps.append(y)
    torch.testing.assert_close(out, torch.cat(steps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:, -3:], s[0])
    hf = hf_next.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T  # from a zero state
    torch.testing.assert_close(
        gated_delta.conv_extend(x, torch.zeros(6, 3), weight)[0], hf, atol=1e-5, rtol=1e-5
    )


class FlaStandIn:
    """flash-linear-attention's two entry points as its documentation gives them (q, k, v
    ``[B, T, H, K|V]``, g and beta ``[B, T, H]``, ``scale``, ``initial_state`` ``[N, H, K, V]``,
    ``output_final_state``, ``cu_seqlens`` for packed sequences with B 1), computed by HF's torch
    functions: a stand-in for the Triton kernels, which need a GPU, to hold our calls to it."""

    @staticmethod
    def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        assert q.shape[0] == 1 and output_final_state and len(cu_seqlens) == len(initial_state) + 1
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
            o, s = hf_next.torch_chunk_gated_delta_rule(
                q[:, a:b] * scale * q.shape[-1] ** 0.5, k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                initial_state=initial_state[i : i + 1], output_final_state=True,
            )  # fmt: skip
            outs.append(o)
            finals.append(s)
        return torch.cat(outs, dim=1), torch.cat(finals)

    @staticmethod
    def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state):
        assert q.shape[1] == 1 and output_final_state
        return hf_next.torch_recurrent_gated_delta_rule(
            q * scale * q.shape[-1] ** 0.5,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=True,
        )


def test_fla_path_passes_packed_sequences_and_states_as_its_api_documents():
    """Our FlaDeltaRule over the stand-in equals the torch path: three packed sequences (one longer
    than a chunk) from their own states, then a decode step of three rows."""
    q, k, v, g, beta, _ = random_inputs(106, heads=4, dk=16, dv=16, seed=3)
    states = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    fla, ref = FlaDeltaRule(torch.float32, FlaStandIn), TorchDeltaRule()
    lens = [37, 64, 5]
    packed = (q, k, v, g, beta, lens, states)
    for got, want in zip(fla.extend(*packed), ref.extend(*packed), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    rows = [x[:3] for x in (q, k, v, g, beta)]
    for got, want in zip(fla.decode(*rows, states), ref.decode(*rows, states), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert fla_unavailable(torch.device("cpu"), torch.float32) == "flash-linear-attention needs CUDA"


# ------------------------------------------------------------------------------ config
def test_each_architecture_reads_its_layers_heads_and_partial_rotary(hybrid_dir):
    cfg = ModelConfig.from_pretrained(hybrid_dir)
    h = cfg.hybrid
    assert h is not None and h.linear_layers == (0, 1, 2) and h.full_layers == (3,)
    assert (h.num_k_heads, h.num_v_heads, h.k_head_dim, h.v_head_dim, h.conv_kernel) == (2, 4, 16, 16, 4)
    assert h.rotary_dim == cfg.rotary_dim == 4 and cfg.qk_norm and not cfg.qkv_bias  # 16 x 0.25
    assert cfg.num_kv_layers == 1 and cfg.kv_bytes_per_token() == 2 * 2 * 16 * 4  # the full layer only
    assert h.interleaved_qkvz == (cfg.arch == "qwen3_next")
    moe = cfg.moe
    if cfg.arch == "qwen3_5":
        assert moe is None
    else:  # Qwen3-Next keeps layer 0 dense; every Qwen3.5-MoE layer is sparse, renormalised
        assert moe is not None and moe.shared_intermediate_size == 64 and moe.renormalize
        assert moe.sparse_layers == ((1, 2, 3) if cfg.arch == "qwen3_next" else (0, 1, 2, 3))


# ------------------------------------------------------------------------------ logits
def test_logits_match_hf_for_prefill_extend_decode_and_a_request_resumed_from_a_snapshot(hybrid_dir):
    with one_thread():
        hf = AutoModelForCausalLM.from_pretrained(str(hybrid_dir)).eval()
        cfg = ModelConfig.from_pretrained(hybrid_dir)
        model = load_model(hybrid_dir, cfg, "cpu")
        pool = KVPool(256, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, "cpu")
        table = ReqToTokenPool(2, 128)
        states = StatePool(cfg.hybrid.state_shape(), 2, 1, cfg.dtype, torch.device("cpu"))  # snapshot slot 4
        backend = TorchAttention(pool, table, cfg.num_heads, cfg.head_dim)
        ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]

        def run(row, start, n, mode, cuts=()):
            slots = np.arange(start, start + n) * 3 + 5  # the same token, the same KV slot, in both rows
            table.host[row, start : start + n] = slots
            step = LinearStep(states, TorchDeltaRule(), torch.tensor([row]), [row], [list(cuts)])
            fb = ForwardBatch(
                mode, ids[start : start + n], torch.arange(start, start + n), torch.from_numpy(slots),
                np.array([start]), np.array([n]), None, None, all_logits=True, linear=step,
            )  # fmt: skip
            backend.prepare(fb, np.array([row]))
            return model(fb.input_ids, fb.positions, fb, backend).logits

        first = run(0, 0, 25, ForwardMode.EXTEND, cuts=[(16, 4)])  # a snapshot after 16 tokens, in slot 4
        ours = torch.cat(
            [first, run(0, 25, 11, ForwardMode.EXTEND)]
            + [run(0, i, 1, ForwardMode.DECODE) for i in range(36, 40)]
        )
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        # row 1 resumes the same prompt after token 16: the cached KV, and the snapshot's state
        table.host[1, :16] = table.host[0, :16]
        states.copy(torch.tensor([4]), torch.tensor([1]))
        torch.testing.assert_close(run(1, 16, 24, ForwardMode.EXTEND), ref[16:], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ the engine
@pytest.mark.slow  # HF's references: three architectures, eight prompts each (~20 s)
@pytest.mark.parametrize("page", [1, 16])
def test_greedy_equals_hf_with_chunking_radix_cache_overlap_and_the_padded_static_decode(
    hybrid_dir, hybrid_ref, page
):
    """Prefill chunks of 48 cut through the delta rule's 64-token chunks; decode buckets 1, 2, 4, 8
    pad the batches of 5 to 7 that the requests' staggered ends leave; the second and third rounds
    resume from the snapshots the first left."""
    prompts = PROMPTS + LONG
    greedy = [
        SamplingParams(max_new_tokens=NEW - i % 6, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = [ref[: NEW - i % 6] for i, ref in enumerate(hybrid_ref)]
    with Engine(
        hybrid_dir, max_total_tokens=4096, page_size=page, chunked_prefill_size=48, disable_overlap=False,
        cpu_overlap_thread_min_ms=0, max_running_requests=8, cpu_static_decode=True, cuda_graph_max_bs=8,
    ) as engine:  # fmt: skip
        assert engine.profile.linear_attention == "torch"  # CPU: flash-linear-attention needs CUDA
        for _ in range(3):
            outs = engine.generate(prompt=prompts, sampling_params=greedy)
            assert [o["token_ids"] for o in outs] == want
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        graphs = engine.runner.graphs
        assert graphs.eager_static > 0 and graphs.padded > 0
        kv = engine.scheduler.kv
        kv.check([])
        assert kv.available() == kv.capacity and kv.req_to_token.num_free == 8


@pytest.mark.slow  # HF's references (~20 s)
@pytest.mark.parametrize("radix", [False, True])
def test_greedy_equals_hf_under_decode_retraction(hybrid_dir, hybrid_ref, radix):
    with Engine(
        hybrid_dir, max_total_tokens=144, init_new_token_ratio=0.0, page_size=1, chunked_prefill_size=0,
        disable_radix_cache=not radix, max_running_requests=8, max_state_snapshots=4,
    ) as engine:  # fmt: skip
        outs = engine.generate(
            prompt=PROMPTS + LONG,
            sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True),
        )
        assert engine.scheduler.num_retractions > 0
        assert [o["token_ids"] for o in outs] == hybrid_ref
        kv = engine.scheduler.kv
        kv.check([])
        assert kv.available() == kv.capacity
