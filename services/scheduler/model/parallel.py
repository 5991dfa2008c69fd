"""Tensor parallelism inside the model: which part of every weight a rank holds, and its collectives.

Megatron-style split of a Llama-family decoder over ``size`` ranks:

* column-parallel (each rank: a slice of the output rows): q/k/v (``qkv_proj``) and gate/up
  (``gate_up_proj``), biases included, and every MoE expert's gate/up (model/moe.py); attention
  heads are split the same way, so a rank attends with its own heads over its own KV pool (same
  slot indices on every rank, a slice of the heads);
* row-parallel (each rank: a slice of the input columns): ``o_proj`` and ``down_proj`` (also every
  expert's); the ranks' partial sums are added by an all-reduce (one per MoE block: its routed and
  shared experts' sums together), and a bias is added once, after it. The router is whole on every
  rank, so all ranks pick the same experts; experts are not spread over ranks (no expert parallelism);
* vocab-parallel: the embedding and the LM head hold a slice of the vocabulary rows each (padded
  so every rank holds as many); an embedding row lives on one rank, so the lookup is masked and
  all-reduced; the LM head's logits are all-gathered and the padding cut off.

KV heads: when there are fewer KV heads than ranks, each KV head is replicated on
``size / num_kv_heads`` ranks, and a rank keeps the one its query heads use.

``ShardLayout`` is pure arithmetic (the loader reads checkpoint slices with it, the model sizes its
layers with it); ``TPGroup`` holds the process group. ``tp_problem`` says in one sentence why a
model cannot be split ``size`` ways.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.quant.formats import block_problem


def tp_problem(cfg: ModelConfig, size: int) -> str | None:
    """Why ``cfg`` cannot run with tensor parallelism ``size`` (None: it can)."""
    if size < 1:
        return f"tp_size must be >= 1, got {size}"
    if size == 1:
        return None
    heads, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if heads % size:
        return f"tp_size {size} does not divide the model's {heads} attention heads"
    if kv % size and size % kv:
        return f"tp_size {size} and the model's {kv} KV heads: one must divide the other"
    if inter % size:
        return f"tp_size {size} does not divide the model's MLP size {inter}"
    if cfg.moe is not None and (experts := cfg.moe.tp_problem(size)) is not None:
        return experts
    if cfg.hybrid is not None and (linear := cfg.hybrid.tp_problem(size)) is not None:
        return linear
    return block_problem(cfg, size)  # FP8 checkpoints in blocks: each rank holds whole blocks


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The slices of the model that rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    q_heads: int  # query heads on this rank ...
    q_head_start: int  # ... from this head of the checkpoint's
    kv_heads: int
    kv_head_start: int
    intermediate: int  # MLP columns on this rank ...
    intermediate_start: int
    vocab_rows: int  # embedding / LM head rows on this rank (the last rank's may be partly padding)
    vocab_start: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> ShardLayout:
        problem = tp_problem(cfg, size)
        if problem is not None:
            raise ValueError(problem)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside tp_size {size}")
        q = cfg.num_heads // size
        if cfg.num_kv_heads >= size:
            kv, kv_start = cfg.num_kv_heads // size, rank * (cfg.num_kv_heads // size)
        else:  # replicated: ranks r*kv/size .. share a KV head, the one their query heads use
            kv, kv_start = 1, rank * cfg.num_kv_heads // size
        inter = cfg.intermediate_size // size
        vocab = -(-cfg.vocab_size // size)
        return cls(rank, size, q, rank * q, kv, kv_start, inter, rank * inter, vocab, rank * vocab)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head and MLP counts: what its layers and KV pool are sized by."""
        moe = None if cfg.moe is None else cfg.moe.split(self.size)
        hybrid = None if cfg.hybrid is None else cfg.hybrid.split(self.size)
        return replace(
            cfg,
            num_heads=self.q_heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            moe=moe,
            hybrid=hybrid,
        )

    def share(self, columns: int) -> tuple[int, int]:
        """(first, count) of this rank's even share of ``columns`` MLP columns (an expert's)."""
        count = columns // self.size
        return self.rank * count, count

    def vocab_end(self, cfg: ModelConfig) -> int:
        """One past the last real vocabulary row on this rank (the rest of its rows are padding)."""
        return min(self.vocab_start + self.vocab_rows, cfg.vocab_size)


class TPGroup:
    """This rank's place in the tensor-parallel group and the three collectives the model needs."""

    def __init__(self, layout: ShardLayout, group: dist.ProcessGroup | None = None) -> None:
        self.layout = layout
        self.rank, self.size = layout.rank, layout.size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[B, vocab_rows]`` per rank -> ``[B, vocab_size]`` on every rank (padding cut off)."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        full = torch.cat(parts, dim=-1)
        return full if full.shape[-1] == vocab_size else full[:, :vocab_size].contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (``x`` must have its shape everywhere)."""
        dist.broadcast(x, src=src, group=self.group)
        return x
