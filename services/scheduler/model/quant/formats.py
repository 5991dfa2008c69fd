"""The quantizations a checkpoint may declare, and which of them radixserve serves.

A checkpoint says how its weights are quantized in config.json's ``quantization_config``; its
``quant_method`` names the tool's format. Served (``checkpoint_format``), all FP8 e4m3 weights with
float32 (or bfloat16) scales beside them:

* ``fp8`` (the official Qwen / DeepSeek FP8 checkpoints): ``weight_block_size: [128, 128]``, a
  ``weight_scale_inv`` per 128x128 block (the multiplier that dequantizes, despite its name);
  without ``weight_block_size``: one ``weight_scale`` per tensor;
* ``compressed-tensors`` (llm-compressor) with ``format: float-quantized`` and one scheme for the
  linear layers: FP8 weights per ``channel`` (FP8_DYNAMIC), per ``tensor`` or per ``block``, each
  with a ``weight_scale``;
* ``fbgemm_fp8``: a ``weight_scale`` per output channel.

Activations are always quantized per token when the matmul runs (dynamic); a checkpoint's static
``input_scale`` tensors are not used (``Fp8Format.static_input_scales``). Everything else (AWQ,
GPTQ, bitsandbytes, MXFP4, NVFP4, int8, FP8 KV caches) fails at load, naming what it is and what
is served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.common.service_config import QUANTIZATIONS

if TYPE_CHECKING:
    from radixserve.scheduler.model.config import ModelConfig

SERVED = (
    "fp8 (128x128 blocks or per tensor)",
    "compressed-tensors float-quantized FP8 (per channel, per tensor or per block)",
    "fbgemm_fp8",
)
SERVED_LINE = (
    f"served: {', '.join(SERVED)}; or an unquantized checkpoint (--quantization fp8 quantizes it at load)"
)


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """How a checkpoint stores its FP8 linear weights."""

    method: str  # quant_method as config.json names it
    granularity: str  # block | channel | tensor: what one scale covers
    scale_suffix: str  # the scale beside each ``*.weight``: weight_scale_inv | weight_scale
    block: tuple[int, int] | None = None  # (rows, columns) per scale: block granularity only
    static_input_scales: bool = False  # it has input_scale tensors, which are skipped

    def describe(self) -> str:
        if self.block is not None:
            return f"{self.method} checkpoint, {self.block[0]}x{self.block[1]} blocks"
        return f"{self.method} checkpoint, per {self.granularity}"


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """The FP8 weights of a model as served: the checkpoint's, and those quantized while loading."""

    stored: Fp8Format | None  # the checkpoint's FP8 linear weights (None: it has none)
    at_load: bool = False  # --quantization fp8: projections stored in high precision are quantized

    def describe(self) -> str:
        if self.stored is None:
            return "quantized at load per output channel, --quantization fp8"
        parts = [self.stored.describe()]
        if self.stored.static_input_scales:
            parts.append("its static input scales unused: activations are scaled per token")
        if self.at_load:
            parts.append("any high-precision projection quantized at load per output channel")
        return "; ".join(parts)


def checkpoint_format(config: Any) -> Fp8Format | None:
    """The FP8 format of a checkpoint's ``quantization_config`` (None: not quantized); ValueError,
    one line, for a quantization radixserve does not serve."""
    if hasattr(config, "to_dict"):  # a transformers quantization config object, not its JSON
        config = config.to_dict()
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fbgemm_fp8":
        return Fp8Format("fbgemm_fp8", "channel", "weight_scale")
    kind = f" {config['quant_algo']}" if config.get("quant_algo") else ""  # modelopt: NVFP4, FP8, ...
    raise ValueError(
        f"unsupported quantization {method or '(no quant_method)'}{kind} (config.json quantization_config);"
        f" {SERVED_LINE}"
    )


def _fp8(config: Mapping[str, Any]) -> Fp8Format:
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"unsupported fp8 activation_scheme {scheme!r}; served: dynamic, static")
    static = scheme == "static"
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Format("fp8", "tensor", "weight_scale", static_input_scales=static)
    return Fp8Format("fp8", "block", "weight_scale_inv", _block(block, "weight_block_size"), static)


def _block(block: Any, field: str) -> tuple[int, int]:
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"quantization_config {field} {block!r}: expected [rows, columns]")
    return int(block[0]), int(block[1])


def _compressed_tensors(config: Mapping[str, Any]) -> Fp8Format:
    fmt = config.get("format")
    what = f"compressed-tensors format {fmt!r}"
    if fmt != "float-quantized":  # pack-quantized (int4, GPTQ/AWQ-like), int-quantized, nvfp4-pack-quantized
        raise ValueError(f"unsupported quantization {what}; {SERVED_LINE}")
    if config.get("kv_cache_scheme"):
        raise ValueError(
            f"unsupported quantization {what} with a kv_cache_scheme (FP8 KV cache); {SERVED_LINE}"
        )
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1 or "Linear" not in (groups[0].get("targets") or []):
        raise ValueError(
            f"unsupported quantization {what} with {len(groups)} config_groups: one scheme for the Linear"
            f" layers is served; {SERVED_LINE}"
        )
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8 or not weights.get("symmetric", True):
        bits = f"{weights.get('type')} {weights.get('num_bits')}-bit"
        raise ValueError(f"unsupported quantization {what} with {bits} weights; {SERVED_LINE}")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise ValueError(f"unsupported quantization {what} with weight strategy {strategy!r}; {SERVED_LINE}")
    block = _block(weights.get("block_structure"), "block_structure") if strategy == "block" else None
    acts = groups[0].get("input_activations")
    static = acts is not None and not acts.get("dynamic", False)
    return Fp8Format("compressed-tensors", strategy, "weight_scale", block, static)


def requested(stored: Fp8Format | None, quantization: str) -> WeightQuant | None:
    """The FP8 weights served for a checkpoint stored as ``stored`` under ``--quantization``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose {' or '.join(QUANTIZATIONS)}")
    at_load = quantization == "fp8"
    return WeightQuant(stored, at_load) if stored is not None or at_load else None


def block_problem(cfg: ModelConfig, size: int) -> str | None:
    """Why a checkpoint's FP8 blocks cannot be held ``size`` ways (None: they can). A rank holds
    whole blocks: its rows of q/k/v and gate/up, and its columns of o_proj and down_proj, must be
    whole blocks (size 1: q, k, v and gate, up are merged, so each starts on a block); so must an
    MoE model's experts' and shared expert's (their gate/up rows are merged too)."""
    quant = cfg.quantization
    fmt = quant.stored if quant is not None else None
    if fmt is None or fmt.block is None:
        return None
    bn, bk = fmt.block
    kv_heads = cfg.num_kv_heads // size if cfg.num_kv_heads >= size else 1
    q_rows = cfg.num_heads // size * cfg.head_dim
    mlps = [("", cfg.intermediate_size)]  # (what, width) of each kind of MLP the model has
    if cfg.moe is not None:
        moe = cfg.moe
        dense = mlps if len(moe.sparse_layers) < cfg.num_layers else []
        shared = [("shared expert ", moe.shared_intermediate_size)] if moe.shared_intermediate_size else []
        mlps = [*dense, ("expert ", moe.intermediate_size), *shared]
    checks = [("q_proj rows", q_rows, bn), ("k_proj/v_proj rows", kv_heads * cfg.head_dim, bn)]
    checks += [(f"{what}gate_proj/up_proj rows", width // size, bn) for what, width in mlps]
    if size > 1:
        checks.append(("o_proj columns", q_rows, bk))
        checks += [(f"{what}down_proj columns", width // size, bk) for what, width in mlps]
    for what, n, block in checks:
        if n % block:
            if size > 1:
                return (
                    f"tp_size {size} cuts the checkpoint's {bn}x{bk} FP8 blocks: {n} {what} per rank"
                    f" (a multiple of {block} is needed)"
                )
            return f"{bn}x{bk} FP8 blocks: {n} {what} are not whole blocks (merged projections need them)"
    return None
