"""CUDA tests of the fast path: fused ops against the torch reference, graph replay against eager
decode, the device profile's dtype choice, warm-up, staging and the table's device mirror.

Skipped without CUDA (and the flashinfer parts without flashinfer). The CPU side of the same
code (padding, buckets, static buffers, launch counts) is tested in tests/unit/test_decode_graphs.py
and tests/unit/test_launch_count.py.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.common.demo_model import make_demo_model
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.ops import FlashInferOps, TorchOps, cos_sin_table
from radixserve.scheduler.model.rope import inv_frequencies
from radixserve.scheduler.model.staging import Staging
from tests.gpu.agreement import graph_and_eager_logits, logits_agree

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

# Per-test time limits: pyproject's default, or scripts/gpu-check's per group (after its JIT step).
pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def flashinfer():
    try:
        import flashinfer as fi
    except Exception as e:
        pytest.skip(f"flashinfer does not import: {e!r}")
    return fi


@pytest.fixture(scope="module")
def small_qwen3(demo_model):
    # head_dim 64: inside flashinfer's kernels (the tiny model's 16 is not)
    return demo_model("qwen3", "small")


# ------------------------------------------------------------------ fused ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ops_match_the_torch_reference(flashinfer, dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    fused, ref = FlashInferOps(flashinfer), TorchOps()
    t, heads, kv_heads, d = 37, 8, 4, 128
    tol = dict(atol=2e-2, rtol=2e-2)

    x = torch.randn(t, 1024, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(1024, device=DEV, dtype=dtype, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **tol)

    res = torch.randn_like(x)
    want_norm, want_res = ref.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    got_norm, got_res = fused.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    torch.testing.assert_close(got_res, want_res, **tol)
    torch.testing.assert_close(got_norm, want_norm, **tol)

    # per-head norm on strided views of a merged qkv output, as the model calls it
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=DEV, dtype=dtype, generator=g)
    q = qkv[:, : heads * d].view(t, heads, d)
    hw = torch.randn(d, device=DEV, dtype=dtype, generator=g)
    torch.testing.assert_close(fused.rms_norm(q, hw, 1e-6), ref.rms_norm(q, hw, 1e-6), **tol)

    gu = torch.randn(t, 2 * 3072, device=DEV, dtype=dtype, generator=g)
    torch.testing.assert_close(fused.silu_and_mul(gu), ref.silu_and_mul(gu), **tol)

    table = cos_sin_table(inv_frequencies(d, 1e6, None).to(DEV), 4096)
    pos = torch.randint(0, 4096, (t,), device=DEV, generator=g)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    want_q, want_k = ref.rope(q.clone(), k.clone(), ref.rope_inputs(pos, table, dtype))
    qkv2 = qkv.clone()
    q2 = qkv2[:, : heads * d].view(t, heads, d)
    k2 = qkv2[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    got_q, got_k = fused.rope(q2, k2, fused.rope_inputs(pos, table, dtype))
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    # in place on the strided views: v, the rest of the merged buffer, is untouched
    torch.testing.assert_close(qkv2[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])


# ------------------------------------------------------------------ graphs
PROMPTS = [f"def f{i}(x):\n    return x * {i} + " + "y " * (i % 7) for i in range(24)]
NEW_TOKENS = [24 - i % 9 for i in range(24)]  # the batch shrinks: sizes 24 (eager), then 15 .. 3 (padded)
# A replayed graph runs the batch padded to its bucket, eager decode unpadded: the matmuls see other
# shapes and round differently in bf16, so greedy continuations part at near-ties (too often for a
# token count to mean anything). The relative difference allowed per row sits above what bf16
# rounding costs this model against float32 and well under what a wrong page table, position or
# stale static buffer gives (docs/gpu.md has the measurements).
LOGITS_REL_TOL = 0.08


def test_graph_replay_gives_the_eager_logits(flashinfer, small_qwen3):
    with Engine(
        small_qwen3, device="cuda", dtype="bfloat16", max_total_tokens=16384, max_running_requests=32,
        cuda_graph_max_bs=16,
    ) as e:  # fmt: skip
        assert e.profile.cuda_graph
        replays = e.runner.graphs.replays
        steps = graph_and_eager_logits(e, [e.tokenizer.encode(p) for p in PROMPTS], NEW_TOKENS)
        assert e.runner.graphs.replays - replays == len(steps)  # every compared step was a replay
        assert any(size not in e.runner.graphs.buckets for size, _, _ in steps)  # some were padded
        for size, replayed, eager in steps:
            why = logits_agree(replayed, eager, LOGITS_REL_TOL)
            assert why is None, f"batch of {size}: {why}"
        kv = e.scheduler.kv
        assert kv.available() == kv.capacity


def test_graph_replay_with_overlap_and_seeded_sampling(flashinfer, small_qwen3):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    outs = []
    for overlap in (False, True):
        with Engine(small_qwen3, device="cuda", dtype="bfloat16", disable_overlap=not overlap) as e:
            outs.append([o["token_ids"] for o in e.generate(prompt=PROMPTS[:8], sampling_params=params)])
            assert e.runner.graphs.replays > 0
    same = sum(a == b for a, b in zip(*outs, strict=True))
    assert same >= 6, f"{same}/8 identical"


# ------------------------------------------------------------------ profile, warm-up, cuda:N
def test_float32_checkpoint_serves_in_bf16_and_float32_is_honoured(tmp_path):
    path = make_demo_model(tmp_path / "fp32", arch="llama", size="small")  # saved in float32
    with Engine(path, device="cuda", max_total_tokens=4096) as e:
        assert e.profile.dtype == torch.bfloat16
        assert any("bfloat16" in n for n in e.profile.notes)
        assert e.runner.kv_pool.k[0].dtype == torch.bfloat16
    with Engine(path, device="cuda", dtype="float32", max_total_tokens=4096) as e:
        assert e.profile.dtype == torch.float32
        assert e.runner.backend.name == "torch" and not e.profile.cuda_graph
        assert any("graphs off" in n for n in e.profile.notes)


def test_warm_up_runs_before_ready_and_leaves_an_empty_cache(flashinfer, small_qwen3):
    with Engine(small_qwen3, device="cuda", dtype="bfloat16", max_total_tokens=4096) as e:
        assert e.startup["graphs_s"] > 0 and e.startup["warmup_s"] > 0
        kv = e.scheduler.kv
        assert kv.available() == kv.capacity and kv.cache.evictable_size == 0


def test_capture_freezes_the_collector_and_thaws_it_after(flashinfer, small_qwen3):
    """Collections during the capture see the objects alive before it frozen (out of their scan),
    and the freeze ends with the capture."""
    if gc.get_freeze_count():
        pytest.skip("something froze the collector before this test")
    during: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            during.append(gc.get_freeze_count())

    gc.callbacks.append(note)
    try:
        with Engine(small_qwen3, device="cuda", dtype="bfloat16", max_total_tokens=4096, warmup=False) as e:
            assert e.startup["graphs_s"] > 0
    finally:
        gc.callbacks.remove(note)
    assert any(during), "no collection ran while the objects were frozen"
    assert gc.get_freeze_count() == 0


def test_cuda_n_is_honoured(small_qwen3):
    index = torch.cuda.device_count() - 1
    with Engine(small_qwen3, device=f"cuda:{index}", max_total_tokens=4096, warmup=False) as e:
        assert e.profile.device == torch.device("cuda", index)
        assert e.runner.kv_pool.k[0].device == torch.device("cuda", index)
        out = e.generate(prompt="hello", sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out["token_ids"]) == 4


# ------------------------------------------------------------------ staging and the mirror
def test_staging_sends_a_steps_arrays_in_one_pinned_copy():
    st = Staging(DEV)
    arrays = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int64) * 7, np.zeros(0, dtype=np.int64)]
    for _ in range(10):  # pinned blocks are recycled by torch only after their copy has run
        out = st.send(arrays)
        assert [t.device.type for t in out] == ["cuda"] * 3
        assert [t.tolist() for t in out] == [a.tolist() for a in arrays]
    assert st.copies == 10


def test_device_mirror_and_page_indices_on_cuda():
    table = ReqToTokenPool(4, 64)
    table.attach_device(DEV)
    table.write(1, 0, np.arange(32, 32 + 40))
    table.write_tokens(np.array([1]), np.array([40]), np.array([72]))
    packed = table.take_pending()
    table.apply_pending(torch.from_numpy(packed).to(DEV))
    assert np.array_equal(table.device_table.cpu().numpy(), table.host)
    rows = torch.tensor([1, table.scratch_row], device=DEV)
    indptr = torch.tensor([0, 11, 12], device=DEV)
    got = table.page_indices(rows, indptr, 12, 4).cpu().tolist()
    assert got == [*range(8, 19), 0]
