"""ModelConfig: the shapes and switches our layer code needs, read from a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

from radixserve.scheduler.model.hybrid_config import HybridConfig, hybrid_config
from radixserve.scheduler.model.moe_config import MoEConfig, moe_config
from radixserve.scheduler.model.quant.formats import WeightQuant, checkpoint_format, requested

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixture of experts (model/moe_config.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    # hybrids: Gated DeltaNet and gated full-attention layers (model/hybrid_config.py)
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # llama | qwen2 | qwen3 | qwen3_moe | qwen2_moe | mixtral | qwen3_next | qwen3_5 | qwen3_5_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 scaling parameters, or None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    quantization: WeightQuant | None = None  # FP8 weights (model/quant/); None: none
    moe: MoEConfig | None = None  # experts and routing of a mixture-of-experts model; None: dense
    hybrid: HybridConfig | None = None  # linear-attention layers of a hybrid model; None: none

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: str | torch.dtype | None = None, quantization: str = "none"
    ) -> ModelConfig:
        """``quantization``: --quantization (fp8: quantize what the checkpoint holds in high precision)."""
        from transformers import AutoConfig, GenerationConfig

        try:
            hf = AutoConfig.from_pretrained(str(path))
        except (ValueError, TypeError, StrictDataclassError) as e:  # transformers' own checks: a few lines
            raise ValueError(f"config.json: {_last_line(e)}") from e
        arch = next((ARCHITECTURES[a] for a in (hf.architectures or []) if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {hf.architectures}; supported: {sorted(ARCHITECTURES)}"
            )
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        attn_bias = bool(getattr(hf, "attention_bias", False))
        family = "llama" if arch == "mixtral" else arch.removesuffix("_moe")  # attention and norms
        hybrid = hybrid_config(hf, arch, hf.num_hidden_layers, head_dim)
        if hybrid is not None:
            family = "qwen3"  # per-head q/k norms, no q/k/v bias
        eos = getattr(hf, "eos_token_id", None)
        try:
            gen_eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
            eos = gen_eos if gen_eos is not None else eos
        except OSError:
            pass
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        return cls(
            arch=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            qkv_bias=bool(getattr(hf, "qkv_bias", True)) if family == "qwen2" else attn_bias,
            o_bias=False if family == "qwen2" else attn_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            dtype=_resolve_dtype(dtype, hf),
            eos_token_ids=eos_ids,
            quantization=requested(checkpoint_format(getattr(hf, "quantization_config", None)), quantization),
            moe=moe_config(hf, arch, hf.num_hidden_layers),
            hybrid=hybrid,
        )

    def kv_bytes_per_token(self) -> int:
        from radixserve.scheduler.memory.allocator import kv_bytes_per_token

        return kv_bytes_per_token(self.num_kv_layers, self.num_kv_heads, self.head_dim, self.dtype.itemsize)

    @property
    def rotary_dim(self) -> int:
        """Features of each attention head that RoPE turns (a hybrid's ``partial_rotary_factor``)."""
        return self.head_dim if self.hybrid is None else self.hybrid.rotary_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: all of them, but only the full-attention ones of a hybrid."""
        return self.num_layers if self.hybrid is None else len(self.hybrid.full_layers)


def _last_line(e: Exception) -> str:
    """The innermost reason of a (possibly multi-line) transformers config error, on one line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return lines[-1].removeprefix("ValueError: ")


def _resolve_dtype(dtype: str | torch.dtype | None, hf: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (
        dtype
        if dtype not in (None, "auto")
        else (getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None))
    )
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]
