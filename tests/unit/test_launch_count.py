"""Kernels one decode step launches on the CUDA path, counted on a CPU machine.

Under ``FakeTensorMode`` a tensor made on ``cuda`` is shape-only, and every aten op a forward
dispatches on it passes through a ``TorchDispatchMode`` that counts it: that is the eager
path's kernel launches, minus the ops that launch nothing (views, empty allocations). flashinfer's
kernels need a GPU, so a stand-in module (below; it says so) takes their place: each call counts as
one launch and returns a tensor of the right shape. Everything else is the real code: the runner's
``prepare`` and ``forward``, the model with merged projections and ``FlashInferOps``, the flashinfer
attention backend's metadata, the FutureMap and the sampler. The real kernels are checked in
tests/gpu and timed by benchmarks/gpu.py.

The model has Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
vocab 151936, tied embeddings); the target is at most 15 launches per layer per decode step (the
lean engines launch about 12; the unfused torch path launched 59 per layer).
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.model.device import DeviceProfile
from radixserve.scheduler.model.llama import CausalLM
from radixserve.scheduler.model.quant.fp8 import ScaleLayout
from radixserve.scheduler.model.quant.gemm import SCALED_MM, Fp8Gemms
from radixserve.scheduler.model.quant.linear import quantize_modules
from radixserve.scheduler.model.runner import ModelRunner
from radixserve.scheduler.model.staging import Staging
from radixserve.scheduler.req import Req
from tests.helpers.shapes import QWEN3_06B

# ops that launch nothing: allocations and metadata queries (views are skipped by their schema)
NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "lift_fresh", "device",
}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


class StandInFlashInfer:
    """A stand-in for the flashinfer package (a GPU library): same call signatures as flashinfer
    0.6, shape-only results, one counted launch per kernel call. Not a reimplementation."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        count = self.calls

        def rmsnorm(x, w, eps=1e-6, out=None, enable_pdl=None):
            count["flashinfer.rmsnorm"] += 1
            return torch.empty_like(x) if out is None else out

        def fused_add_rmsnorm(x, residual, w, eps=1e-6, enable_pdl=None):
            count["flashinfer.fused_add_rmsnorm"] += 1

        def silu_and_mul(x, out=None, enable_pdl=None):
            count["flashinfer.silu_and_mul"] += 1
            return torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)

        def rope_inplace(positions, q, k, head_size, cos_sin_cache, is_neox=True):
            assert cos_sin_cache.dtype == torch.float32 and q.shape[-1] % head_size == 0
            count["flashinfer.rope"] += 1

        class Wrapper:
            def __init__(self, workspace, layout, **kw) -> None:
                self.kw = kw

            def plan(self, *args, **kw) -> None:  # host work + copies of its own metadata
                count["flashinfer.plan (host)"] += 1

            def run(self, q, paged):
                count["flashinfer.attention"] += 1
                return torch.empty_like(q)

        self.norm = types.SimpleNamespace(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm)
        self.activation = types.SimpleNamespace(silu_and_mul=silu_and_mul)
        self.rope = types.SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=rope_inplace)
        self.BatchPrefillWithPagedKVCacheWrapper = Wrapper
        self.BatchDecodeWithPagedKVCacheWrapper = Wrapper
        self.__version__ = "stand-in"


class FakeCudaStaging(Staging):
    """The step's one host->device copy (pinned memory needs a real GPU): the arrays are packed as
    on CUDA, then moved to the fake device in one op."""

    def send(self, arrays):
        flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64)).to(self.device)
        self.copies += 1
        return list(flat.split([len(a) for a in arrays]))


@contextlib.contextmanager
def fake_cuda_runner(
    fp8: ScaleLayout | None = None,
) -> Iterator[tuple[StandInFlashInfer, BatchScheduler, ModelRunner]]:
    """The real scheduler and runner of a Qwen3-0.6B-shaped model on fake CUDA tensors, flashinfer's
    kernels stood in for; the runner is used inside the fake mode only. ``fp8``: its projections
    FP8 with this scale layout, on the FP8 tensor-core GEMM (model/quant/gemm.py)."""
    fi = StandInFlashInfer()
    cuda = torch.device("cuda", 0)
    gemms = None if fp8 is None else Fp8Gemms(SCALED_MM, SCALED_MM)
    profile = DeviceProfile(cuda, torch.bfloat16, "flashinfer", "flashinfer", 0, False, fp8_gemms=gemms)
    page = 16
    mem = MemoryConfig(max_total_tokens=8192, page_size=page, max_running_requests=64, max_context_len=2048)
    sched = BatchScheduler(SchedulerConfig(memory=mem, chunked_prefill_size=None), eos_token_ids=[0])
    with torch.device("meta"):
        model = CausalLM(QWEN3_06B).to(torch.bfloat16)
    if fp8 is not None:
        projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        names = [n for n, _ in model.named_modules() if n.rpartition(".")[2] in projections]
        quantize_modules(model, dict.fromkeys(names, fp8), torch.bfloat16)
    model.requires_grad_(False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=cuda)
        model.init_rope()
        runner = ModelRunner(
            model, sched.kv.req_to_token, sched.kv.allocator.pool_slots, 64, profile, page, flashinfer=fi
        )
        runner.staging = FakeCudaStaging(cuda)
        yield fi, sched, runner


def add_requests(sched: BatchScheduler, batch_size: int, context: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(batch_size):
        ids = rng.integers(5, 1000, context).tolist()
        sched.add(Req(f"r{i}", ids, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)))


def decode_step_launches(
    batch_size: int, context: int, fp8: ScaleLayout | None = None
) -> tuple[Counter[str], int]:
    with fake_cuda_runner(fp8) as (fi, sched, runner):
        add_requests(sched, batch_size, context)
        counts: Counter[str] = Counter()
        while True:
            batch = sched.schedule()
            assert batch is not None
            fb = runner.prepare(batch)
            if batch.mode is ForwardMode.DECODE:
                fi.calls.clear()
                with LaunchCounter() as counter:
                    runner.forward(fb)
                counts = counter.ops + fi.calls
                del counts["flashinfer.plan (host)"]
                return counts, QWEN3_06B.num_layers
            runner.forward(fb)
            sched.process(batch, [7] * batch.size)


def test_serving_stages_every_step_so_prepare_never_takes_its_fallback():
    """The flashinfer backend's ``prepare`` has a fallback for batches nobody staged (kernel tests,
    benchmarks): it replaces the table's device mirror whole, with blocking copies. What serving
    calls, ``ModelRunner.prepare``, stages every step (the page offsets and the table's pending
    writes in its one copy), so the fallback never runs there: the mirror stays the same tensor,
    updated in place, through prefill and decode."""
    with fake_cuda_runner() as (_, sched, runner):
        mirror = runner.req_to_token.device_table
        assert mirror.device.type == "cuda"
        add_requests(sched, 3, context=40)
        modes = []
        while not sched.idle:
            batch = sched.schedule()
            assert batch is not None
            fb = runner.prepare(batch)
            assert {"rows", "kv_indptr"} <= set(fb.staged)
            assert runner.req_to_token.device_table is mirror
            modes.append(batch.mode)
            runner.forward(fb)
            sched.process(batch, [7] * batch.size)
        assert set(modes) == {ForwardMode.EXTEND, ForwardMode.DECODE}
        assert runner.staging.copies == len(modes)  # one host->device copy a step


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_decode_step_launches_at_most_15_kernels_per_layer(batch_size):
    counts, layers = decode_step_launches(batch_size, context=40)
    total = sum(counts.values())
    per_layer = total / layers
    detail = ", ".join(f"{k} {v}" for k, v in counts.most_common())
    print(f"batch {batch_size}: {total} launches per decode step, {per_layer:.2f} per layer: {detail}")
    assert per_layer <= 15, detail
    # the fused ops ran once per layer each (2 norms + q/k norms, rope, activation, attention)
    assert counts["flashinfer.fused_add_rmsnorm"] == 2 * layers  # + the final norm - the first layer's
    assert counts["flashinfer.rmsnorm"] == 1 + 2 * layers
    assert counts["flashinfer.rope"] == counts["flashinfer.silu_and_mul"] == layers
    matmuls = sum(v for k, v in counts.items() if k in ("aten.linear", "aten.mm", "aten.addmm"))
    assert matmuls == 4 * layers + 1  # qkv, o, gate_up, down (merged weights); the LM head
    assert counts["aten.index_put_"] == 2 * layers + 1  # K and V into the pool; the FutureMap


@pytest.mark.parametrize(
    "fp8", [ScaleLayout(), ScaleLayout((128, 128))], ids=["per-channel", "128x128-blocks"]
)
def test_an_fp8_decode_step_quantizes_activations_around_each_fp8_gemm(fp8):
    """FP8 projections on the tensor-core path: each is one scaled_mm plus the per-token activation
    quantization before it: the rows' (or their 128-column groups') largest magnitude, the scale
    (divide, clamp) and the divide. The cast of the quotient to FP8 is a launch too, which
    this counter does not see (under inference_mode a cast reaches no TorchDispatchMode; nor do the
    model's other casts, e.g. the logits' to float32): one more per projection on the device."""
    counts, layers = decode_step_launches(8, context=40, fp8=fp8)
    bf16, _ = decode_step_launches(8, context=40)
    total, base = sum(counts.values()), sum(bf16.values())
    detail = ", ".join(f"{k} {v}" for k, v in (counts - bf16).most_common())
    print(f"FP8 {fp8}: {total} launches per decode step, {total / layers:.2f} per layer ({detail})")
    assert counts["aten._scaled_mm_v2"] == 4 * layers
    assert sum(v for k, v in counts.items() if k in ("aten.linear", "aten.mm", "aten.addmm")) == 1  # LM head
    per_gemm = (total - base) / (4 * layers) + 1  # the launches of one FP8 projection
    assert per_gemm == 5, detail
