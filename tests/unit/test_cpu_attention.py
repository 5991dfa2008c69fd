"""The cpu attention backend: its C decode kernel equals the torch reference, and ``auto`` picks it
only where it is meant to run (CPU, fp32, one torch thread, a kernel that built)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention import TorchAttention, make_backend
from radixserve.scheduler.model.attention import cpu as cpu_attention
from radixserve.scheduler.model.attention.cpu import CpuAttention
from radixserve.scheduler.model.forward_batch import ForwardBatch

why = cpu_attention.unavailable_reason(torch.device("cpu"), torch.float32)
needs_kernel = pytest.mark.skipif(why is not None, reason=f"no decode kernel here: {why}")


def decode_batch(table: ReqToTokenPool, lens: list[int], num_slots: int, heads: int, dim: int, seed: int):
    """One decode step of len(lens) requests whose contexts sit on scattered, shuffled pool slots."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(num_slots)[: sum(lens)]
    rows, at = [], 0
    for i, n in enumerate(lens):
        table.host[i, :n] = slots[at : at + n]
        rows.append(i)
        at += n
    b = len(lens)
    last = torch.from_numpy(table.host[np.arange(b), np.array(lens) - 1].astype(np.int64))
    fb = ForwardBatch.for_attention(ForwardMode.DECODE, np.array(lens) - 1, np.ones(b), last)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, dim, generator=g)
    return fb, np.array(rows), q


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (8, 2, 64), (6, 1, 32)])
def test_decode_kernel_equals_gather_and_sdpa(heads: int, kv_heads: int, dim: int) -> None:
    num_slots, layers = 4096, 2
    pool = KVPool(num_slots, layers, kv_heads, dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=g) * 3)  # large logits: the softmax must be stable
    table = ReqToTokenPool(16, 1024)
    ref, ours = TorchAttention(pool, table, heads, dim), CpuAttention(pool, table, heads, dim)
    lens = [1, 2, 17, 300, 1000, 64, 5]
    for seed in range(3):
        fb, rows, q = decode_batch(table, lens, num_slots, heads, dim, seed)
        k_new = pool.k[1][fb.out_slots].clone()  # rewrite what is there: both see the same pool
        v_new = pool.v[1][fb.out_slots].clone()
        ref.prepare(fb, rows)
        want = ref.forward(1, q, k_new, v_new, fb)
        ours.prepare(fb, rows)
        got = ours.forward(1, q, k_new, v_new, fb)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_prefill_batches_take_the_torch_path() -> None:
    pool = KVPool(64, 1, 2, 16, torch.float32, "cpu")
    table = ReqToTokenPool(2, 32)
    ours = CpuAttention(pool, table, 2, 16)
    table.host[0, :5] = [9, 3, 7, 1, 20]
    fb = ForwardBatch.for_attention(ForwardMode.EXTEND, [0], [5], [9, 3, 7, 1, 20])
    ours.prepare(fb, np.array([0]))
    assert fb.attn.starts is None  # no kernel metadata for an extend
    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    out = ours.forward(0, q, k, v, fb)
    want = (
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=16**-0.5,
        )[0]
        .transpose(0, 1)
        .reshape(5, -1)
    )
    torch.testing.assert_close(out, want)


@needs_kernel
def test_auto_picks_the_kernel_only_with_one_torch_thread() -> None:
    pool = KVPool(64, 1, 2, 16, torch.float32, "cpu")
    table = ReqToTokenPool(2, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert make_backend("auto", pool, table, 2, 16).name == "cpu"
        torch.set_num_threads(2)
        assert make_backend("auto", pool, table, 2, 16).name == "torch"
        assert make_backend("cpu", pool, table, 2, 16).name == "cpu"  # asked for: always
    finally:
        torch.set_num_threads(threads)
    half = KVPool(64, 1, 2, 16, torch.bfloat16, "cpu")
    assert make_backend("auto", half, table, 2, 16).name == "torch"
    with pytest.raises(RuntimeError, match="fp32 only"):
        make_backend("cpu", half, table, 2, 16)


def test_without_a_compiler_auto_keeps_the_torch_backend(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    cpu_attention._library.cache_clear()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reason = cpu_attention.unavailable_reason(torch.device("cpu"), torch.float32)
        assert reason is not None and "failed" in reason
        pool = KVPool(64, 1, 2, 16, torch.float32, "cpu")
        assert make_backend("auto", pool, ReqToTokenPool(2, 32), 2, 16).name == "torch"
    finally:
        torch.set_num_threads(threads)
        cpu_attention._library.cache_clear()
