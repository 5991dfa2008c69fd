"""Kernels one decode step launches on the CUDA path, counted on a CPU machine.

Under ``FakeTensorMode`` a tensor made on ``cuda`` is shape-only, and every aten op a forward
dispatches on it passes through a ``TorchDispatchMode`` that counts it: that is the eager
path's kernel launches, minus the ops that launch nothing (views, empty allocations). flashinfer's
kernels need a GPU, so a stand-in module (tests/helpers/launch_count.py; it says so) takes their
place: each call counts as one launch and returns a tensor of the right shape. Everything else is
the real code: the runner's ``prepare`` and ``forward``, the model with merged projections and
``FlashInferOps``, the flashinfer attention backend's metadata, the FutureMap and the sampler. The
real kernels are checked in tests/gpu and timed by benchmarks/gpu.py.

The model has Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
vocab 151936, tied embeddings); the target is at most 15 launches per layer per decode step (the
lean engines launch about 12; the unfused torch path launched 59 per layer).

The mixture-of-experts layer is counted on Qwen3-30B-A3B's shapes (hidden 2048, 32 heads, 4 KV
heads, 128 experts, 8 per token, 768 wide, untied embeddings; 4 of its 48 layers: a layer's count
does not depend on how many there are) with the grouped-GEMM experts the device profile picks on
an H100 (model/moe_ops.py). Fake tensors also prove that path capturable: a host read or a
data-dependent shape raises on them, as it does for the torch reference's per-expert counts.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.model.quant.fp8 import ScaleLayout
from radixserve.scheduler.model.quant.grouped import SCALED_GROUPED
from tests.helpers.launch_count import (
    add_requests,
    decode_step_launches,
    fake_cuda_runner,
    moe_block_launches,
)
from tests.helpers.shapes import QWEN3_30B_A3B


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


@pytest.mark.parametrize("batch_size", [1, 8])
def test_an_moe_decode_step_launches_at_most_28_kernels_per_layer(batch_size):
    counts, layers = decode_step_launches(batch_size, 40, cfg=QWEN3_30B_A3B, moe="grouped_mm")
    per_layer = sum(counts.values()) / layers
    block = moe_block_launches(batch_size, "grouped_mm")
    detail = ", ".join(f"{k} {v}" for k, v in counts.most_common())
    print(f"batch {batch_size}: MoE block {sum(block.values())} launches ({dict(block)}); "
          f"{per_layer:.2f} per decoder layer: {detail}")  # fmt: skip
    assert per_layer <= 28, detail
    assert sum(block.values()) <= 15, block
    assert counts["aten._grouped_mm"] == 2 * layers  # gate/up and down: one grouped GEMM each
    assert counts["flashinfer.silu_and_mul"] == layers
    matmuls = sum(v for k, v in counts.items() if k in ("aten.linear", "aten.mm", "aten.addmm"))
    assert matmuls == 3 * layers + 1  # qkv, o, the router; the LM head


def test_fp8_experts_on_the_fp8_grouped_gemm_read_nothing_back_and_pass_its_checks(monkeypatch):
    """FP8 experts on torch's FP8 grouped GEMM (what the profile picks on an H100 for experts scaled
    per row): nothing read on the host, so a CUDA graph can hold it, and the operands (strides,
    scale shapes, offsets) pass the checks of torch's own kernel: its meta function, which is
    ``torch._scaled_grouped_mm``'s (the documented ``F.scaled_grouped_mm`` calls a newer op that
    fake tensors cannot run, so it is set aside here: the same operands). Each projection: the
    activations quantized per token (as for a dense FP8 projection) and one grouped GEMM."""
    monkeypatch.delattr(F, "scaled_grouped_mm")
    block = moe_block_launches(8, SCALED_GROUPED, fp8=ScaleLayout())
    bf16 = moe_block_launches(8, "grouped_mm")
    print(f"FP8 MoE block: {sum(block.values())} launches ({dict(block)}); bf16: {sum(bf16.values())}")
    assert block["aten._scaled_grouped_mm"] == 2 and "aten._grouped_mm" not in block
    assert sum(block.values()) <= sum(bf16.values()) + 2 * 5  # + the activations' quantization twice
    with pytest.raises(DynamicOutputShapeException, match="bincount"):  # blocks: the torch reference
        moe_block_launches(8, "torch", fp8=ScaleLayout((128, 128)))


def test_the_grouped_experts_read_nothing_back_and_the_reference_does():
    """Under fake tensors a value read on the host (``.tolist()``) or a shape that depends on the
    data raises: the grouped path runs through (a CUDA graph can hold it); the torch reference
    reads its per-expert counts, which is why the profile turns graphs off where it runs on CUDA."""
    assert sum(moe_block_launches(4, "grouped_mm").values()) > 0
    with pytest.raises(DynamicOutputShapeException, match="bincount"):
        moe_block_launches(4, "torch")
