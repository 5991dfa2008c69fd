"""MoEConfig: a mixture-of-experts model's routing and expert shapes, read from a HF config.

Three architectures, three spellings of the same few facts:

* Qwen3-MoE (``Qwen3MoeForCausalLM``): ``num_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size`` (each expert's width; ``intermediate_size`` is the dense layers'),
  ``norm_topk_prob``; layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
  ``(i + 1) % decoder_sparse_step`` is not 0 (HF's rule), so dense and sparse layers mix.
* Qwen2-MoE (``Qwen2MoeForCausalLM``): the same, plus a shared expert of
  ``shared_expert_intermediate_size`` on every sparse layer, scaled by a sigmoid gate.
* Mixtral (``MixtralForCausalLM``): ``num_local_experts``, every layer sparse, each expert
  ``intermediate_size`` wide, the top-k weights always renormalised.
* The hybrids' MoE layers (model/hybrid_config.py): Qwen3-Next spells them as Qwen3-MoE does, with
  Qwen2-MoE's shared expert; Qwen3.5-MoE has no ``decoder_sparse_step`` / ``norm_topk_prob``:
  every layer sparse, the top-k weights always renormalised, a shared expert.

What cannot be served is refused here, at load, in one line: a top-k outside 1..experts, and
sliding-window attention (the attention backends attend to the whole context).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe")
SHARED_EXPERT_ARCHS = ("qwen2_moe", "qwen3_next", "qwen3_5_moe")  # a shared expert behind a sigmoid gate


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # each routed expert's MLP width (this rank's share under tensor parallelism)
    renormalize: bool  # the top-k weights divided by their sum (norm_topk_prob; always for Mixtral)
    shared_intermediate_size: int  # the shared expert's MLP width (Qwen2-MoE; 0: none)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE block; the others are dense

    def tp_problem(self, size: int) -> str | None:
        """Why the experts cannot be split ``size`` ways (None: they can)."""
        if self.intermediate_size % size:
            return f"tp_size {size} does not divide the experts' MLP size {self.intermediate_size}"
        if self.shared_intermediate_size % size:
            return (
                f"tp_size {size} does not divide the shared expert's MLP size {self.shared_intermediate_size}"
            )
        return None

    def split(self, size: int) -> MoEConfig:
        """One rank's share of ``size``: every expert's MLP columns split as the dense MLP's are."""
        return replace(
            self,
            intermediate_size=self.intermediate_size // size,
            shared_intermediate_size=self.shared_intermediate_size // size,
        )


def moe_config(hf: Any, arch: str, num_layers: int) -> MoEConfig | None:
    """The MoE part of HF config ``hf`` of architecture ``arch`` (None: a dense model)."""
    if arch not in MOE_ARCHS:
        return None
    window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    if window:
        raise ValueError(f"config.json: sliding-window attention (sliding_window {window}) is not served")
    if arch == "mixtral":
        experts, width, renormalize, shared = hf.num_local_experts, hf.intermediate_size, True, 0
        sparse = tuple(range(num_layers))
    else:
        experts, width = hf.num_experts, hf.moe_intermediate_size
        renormalize = bool(getattr(hf, "norm_topk_prob", True))  # Qwen3.5-MoE: always renormalised
        shared = (
            int(getattr(hf, "shared_expert_intermediate_size", 0) or 0) if arch in SHARED_EXPERT_ARCHS else 0
        )
        dense_only = set(getattr(hf, "mlp_only_layers", None) or ())
        step = getattr(hf, "decoder_sparse_step", 1)
        sparse = tuple(
            i for i in range(num_layers) if experts > 0 and i not in dense_only and (i + 1) % step == 0
        )
    if not sparse:
        return None  # no expert in any layer: a dense model under an MoE name
    top_k = hf.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {top_k} is not between 1 and the {experts} experts"
        )
    return MoEConfig(experts, top_k, width, renormalize, shared, sparse)
