"""The device profile: the one place that decides how the model runs on this device.

From the engine's arguments and what the device and checkpoint are, ``resolve_profile`` picks:

* the device (``auto``: the current CUDA device if there is one, else CPU; ``cuda:N`` is honoured);
* the dtype: ``auto`` serves the checkpoint's dtype, except a float32 checkpoint on CUDA, which
  serves in bfloat16 (what users of other engines expect: fp32 halves the speed and doubles the
  memory, and flashinfer has no fp32 kernels). An explicit ``float32`` on CUDA is honoured on the
  torch attention backend, and said so;
* the attention backend (``auto``: model/attention/``choose_backend``);
* the fused ops (model/ops.py): flashinfer's on CUDA in fp16/bf16 when it imports, else torch;
* the decode path: CUDA graphs over padded static buffers (CUDA with the flashinfer backend, unless
  ``disable_cuda_graph``), the same padded path run eagerly (CPU with ``cpu_static_decode``: tests),
  or plain eager decode;
* FP8 weights' GEMMs (model/quant/gemm.py): FP8 tensor cores where the GPU and torch have them,
  the weights dequantized per matmul elsewhere (always a note: what runs, and why);
* a mixture-of-experts model's experts (model/moe_ops.py): ``grouped_mm`` where torch has grouped
  GEMM kernels for the device and dtype (CUDA SM90 / SM100, bfloat16), else the torch reference,
  whose host read of the expert counts turns CUDA graphs off. FP8 experts (a model with FP8
  weights: model/quant/grouped.py): ``scaled_grouped_mm`` where torch's FP8 grouped GEMM runs
  (SM90, bfloat16, experts scaled per row, a probe call passing), else the torch reference, each
  routed expert dequantized per matmul. Always a note, so the log says which;
* a hybrid model's gated delta rule (model/linear_kernels.py): flash-linear-attention's kernels on
  CUDA in fp16/bf16 when ``fla`` imports, else the torch implementation. Always a note.

Every choice that differs from what was asked, or that a user may not expect, is a line in
``notes``, which the engine logs at start: never a silent fallback per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.scheduler.model.attention import BACKENDS, choose_backend
from radixserve.scheduler.model.attention.flashinfer_backend import unsupported_reason
from radixserve.scheduler.model.config import DTYPES, ModelConfig
from radixserve.scheduler.model.linear_kernels import fla_unavailable
from radixserve.scheduler.model.moe_ops import grouped_mm_unsupported
from radixserve.scheduler.model.quant.gemm import Fp8Gemms, device_gemms, projection_shapes
from radixserve.scheduler.model.quant.grouped import choose_experts, probe_scaled_grouped_mm


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # torch | cpu | flashinfer
    ops: str  # torch | flashinfer
    graph_max_bs: int  # decode batches up to this size run padded through static buffers; 0: none
    cuda_graph: bool  # ... and replay captured CUDA graphs
    notes: tuple[str, ...] = field(default=())
    fp8_gemms: Fp8Gemms | None = None  # the model's FP8 weights' GEMM paths; None: no FP8 weights
    moe: str = "torch"  # torch | grouped_mm | scaled_grouped_mm: an MoE model's experts (model/moe_ops.py)
    # torch | fla: a hybrid model's gated delta rule (model/linear_kernels.py)
    linear_attention: str = "torch"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # not a device torch knows: refused below
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {name!r}; choose auto, cpu, cuda or cuda:N")
    return device


def resolve_profile(
    model: ModelConfig,
    *,
    device: str = "auto",
    dtype: str = "auto",
    attention_backend: str = "auto",
    disable_cuda_graph: bool = False,
    cuda_graph_max_bs: int = 160,
    cpu_static_decode: bool = False,
    max_running_requests: int = 64,
) -> DeviceProfile:
    """``model`` is the checkpoint's config (its ``dtype`` the checkpoint's, or the one asked for)."""
    dev = resolve_device(device)
    notes: list[str] = []
    if dtype == "auto":
        chosen = model.dtype
        if dev.type == "cuda" and chosen == torch.float32:
            chosen = torch.bfloat16
            notes.append(
                "float32 checkpoint served in bfloat16 on CUDA (--dtype auto); --dtype float32 keeps fp32"
            )
    elif dtype in DTYPES:
        chosen = DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")

    if attention_backend not in ("auto", *BACKENDS):
        raise ValueError(
            f"unknown attention backend {attention_backend!r}; choose auto, {', '.join(BACKENDS)}"
        )
    backend = attention_backend
    if backend == "auto":
        backend = choose_backend(dev, chosen, model.num_heads, model.num_kv_heads, model.head_dim)
        if dev.type == "cuda" and backend != "flashinfer":
            notes.append(f"attention on the torch backend on CUDA ({chosen}, head_dim {model.head_dim})")
    elif backend == "flashinfer" and dev.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    elif backend == "flashinfer" and chosen == torch.float32:
        raise ValueError("the flashinfer attention backend has no float32 kernels: --dtype bfloat16 or torch")

    # flashinfer's fused ops run where its attention can: CUDA, fp16/bf16, its head sizes, importable
    ops_reason = unsupported_reason(dev, chosen, model.num_heads, model.num_kv_heads, model.head_dim)
    ops = "flashinfer" if ops_reason is None else "torch"
    if dev.type == "cuda" and ops_reason is not None:
        notes.append(f"unfused torch ops on CUDA: {ops_reason}")

    graph_bs = min(cuda_graph_max_bs, max_running_requests)
    cuda_graph = False
    if dev.type == "cuda":
        if disable_cuda_graph:
            graph_bs = 0
            notes.append("CUDA graphs off (--disable-cuda-graph): every decode step launched eagerly")
        elif backend != "flashinfer":
            graph_bs = 0
            notes.append(f"CUDA graphs off: the {backend} attention backend cannot be captured")
        else:
            cuda_graph = graph_bs > 0
    elif not cpu_static_decode:
        graph_bs = 0
    gemms = None
    if model.quantization is not None:  # FP8 weights: their GEMM, said in a note
        gemms, said = device_gemms(dev, chosen, model.quantization, projection_shapes(model))
        notes += said
    moe, moe_note = moe_experts(model, dev, chosen)
    if moe_note is not None:
        notes.append(moe_note)
    if cuda_graph and model.moe is not None and moe == "torch":
        graph_bs, cuda_graph = 0, False
        notes.append("CUDA graphs off: the torch MoE experts read their row counts on the host")
    linear, linear_note = linear_kernels(model, dev, chosen)
    if linear_note is not None:
        notes.append(linear_note)
    return DeviceProfile(
        dev, chosen, backend, ops, max(graph_bs, 0), cuda_graph, tuple(notes), gemms, moe, linear
    )


def cuda_capability(dev: torch.device) -> tuple[int, int] | None:
    """``dev``'s CUDA compute capability (major, minor); None off CUDA."""
    return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None


def moe_experts(model: ModelConfig, dev: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """The MoE experts' implementation for ``model`` on ``dev`` in ``dtype``, and the note that says
    so (None for a dense model)."""
    if model.moe is None:
        return "torch", None
    widths = (model.hidden_size, model.moe.intermediate_size, model.moe.shared_intermediate_size)
    if model.quantization is not None:  # the experts are FP8 with the rest
        return choose_experts(
            dev, dtype, model.quantization, widths[:2], cuda_capability(dev),
            lambda: probe_scaled_grouped_mm(dev),
        )  # fmt: skip
    reason = grouped_mm_unsupported(dev, dtype, cuda_capability(dev), widths)
    if reason is None:
        return "grouped_mm", "MoE experts: grouped GEMMs (torch.nn.functional.grouped_mm), CUDA-graph safe"
    return "torch", f"MoE experts: the torch reference, one matmul pair per expert ({reason})"


def linear_kernels(model: ModelConfig, dev: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """A hybrid model's gated delta rule kernels on ``dev`` in ``dtype``, and the note that says so
    (None for a model without linear-attention layers)."""
    if model.hybrid is None:
        return "torch", None
    reason = fla_unavailable(dev, dtype)
    if reason is None:
        return "fla", "linear attention: flash-linear-attention's Triton kernels (fla-core)"
    return "torch", f"linear attention: the torch gated delta rule ({reason})"
