"""Kernels a forward launches on the CUDA path, counted on a CPU machine (tests/unit/test_launch_count.py
says how, and holds the counts; benchmarks/moe.py reports them).

Under ``FakeTensorMode`` a tensor made on ``cuda`` is shape-only; ``LaunchCounter`` counts every aten
op dispatched on it (not views, allocations or, under inference_mode, casts), ``StandInFlashInfer``
takes flashinfer's place (one counted launch a kernel call, shape-only results), and the rest is the
real code: the scheduler, the runner, the model.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.device import DeviceProfile
from radixserve.scheduler.model.llama import CausalLM
from radixserve.scheduler.model.moe import SparseMoE
from radixserve.scheduler.model.ops import FlashInferOps
from radixserve.scheduler.model.quant.fp8 import ScaleLayout
from radixserve.scheduler.model.quant.gemm import SCALED_MM, Fp8Gemms
from radixserve.scheduler.model.quant.linear import quantize_experts, quantize_modules
from radixserve.scheduler.model.runner import ModelRunner
from radixserve.scheduler.model.staging import Staging
from radixserve.scheduler.req import Req
from tests.helpers.shapes import QWEN3_06B, QWEN3_30B_A3B

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
    fp8: ScaleLayout | None = None, cfg: ModelConfig = QWEN3_06B, moe: str = "torch"
) -> Iterator[tuple[StandInFlashInfer, BatchScheduler, ModelRunner]]:
    """The real scheduler and runner of a ``cfg``-shaped model (Qwen3-0.6B's by default) on fake CUDA
    tensors, flashinfer's kernels stood in for; the runner is used inside the fake mode only.
    ``fp8``: its projections FP8 with this scale layout, on the FP8 tensor-core GEMM
    (model/quant/gemm.py); ``moe``: an MoE model's experts (model/moe_ops.py)."""
    fi = StandInFlashInfer()
    cuda = torch.device("cuda", 0)
    gemms = None if fp8 is None else Fp8Gemms(SCALED_MM, SCALED_MM)
    profile = DeviceProfile(
        cuda, torch.bfloat16, "flashinfer", "flashinfer", 0, False, fp8_gemms=gemms, moe=moe
    )
    page = 16
    mem = MemoryConfig(max_total_tokens=8192, page_size=page, max_running_requests=64, max_context_len=2048)
    sched = BatchScheduler(SchedulerConfig(memory=mem, chunked_prefill_size=None), eos_token_ids=[0])
    with torch.device("meta"):
        model = CausalLM(cfg).to(torch.bfloat16)
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
    batch_size: int,
    context: int,
    fp8: ScaleLayout | None = None,
    cfg: ModelConfig = QWEN3_06B,
    moe: str = "torch",
) -> tuple[Counter[str], int]:
    """The launches of one decode step of ``batch_size`` requests of ``context`` tokens, and the
    model's layer count."""
    with fake_cuda_runner(fp8, cfg, moe) as (fi, sched, runner):
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
                return counts, cfg.num_layers
            runner.forward(fb)
            sched.process(batch, [7] * batch.size)


def moe_block_launches(tokens: int, experts: str, fp8: ScaleLayout | None = None) -> Counter[str]:
    """One Qwen3-30B-A3B MoE block's launches on ``tokens`` tokens, fake CUDA tensors; ``fp8``: its
    experts FP8 with this scale layout."""
    fi = StandInFlashInfer()
    with torch.device("meta"):
        block = SparseMoE(QWEN3_30B_A3B.hidden_size, QWEN3_30B_A3B.moe).to(torch.bfloat16)
    if fp8 is not None:
        quantize_experts(block, {"experts": fp8})
    block.requires_grad_(False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        block.to_empty(device="cuda")
        x = torch.empty(tokens, QWEN3_30B_A3B.hidden_size, dtype=torch.bfloat16, device="cuda")
        with torch.inference_mode(), LaunchCounter() as counter:  # as CausalLM.forward runs it
            block(x, FlashInferOps(fi, experts))
    return counter.ops + fi.calls
