"""The host KV tier's engine workload, shared by the unit test and the tensor-parallel one, and the
scheduler settings the host and disk tier tests share."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.engine import GenerateOutput
from radixserve.scheduler.memory.hybrid_tiered_cache import HybridTieredCache
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.manager import KVCacheManager, MemoryConfig

PREFIX = 48  # tokens of each conversation's own prefix

# The scheduler settings the tier tests run under (``kw``: the scheduler's): whole prompts; chunked
# prefill with retractions; and write-through instead of write-back.
SCHEDULER_CASES = pytest.mark.parametrize(
    "kw",
    [
        dict(chunked_prefill_size=None, init_new_token_ratio=0.7),
        dict(chunked_prefill_size=8, init_new_token_ratio=0.0),  # chunks, and retractions
        dict(chunked_prefill_size=8, init_new_token_ratio=0.0, write_through=True),
    ],
    ids=["whole", "chunked-retracting", "write-through"],
)


def engine_turns(
    model_dir: Any, device: str = "cpu", defer_host_loads: bool | None = None, **options: Any
) -> tuple[list[list[GenerateOutput]], BatchScheduler]:
    """Two turns of six conversations through a device pool of 160 tokens (about two of them), with
    chunked prefill and retraction; returns each turn's outputs and the scheduler, checked after.
    ``defer_host_loads``: the scheduler's setting instead of the engine's (CPU: off)."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(5, 200, PREFIX).tolist() for _ in range(6)]
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with Engine(
        model_dir, max_total_tokens=160, page_size=4, chunked_prefill_size=16, init_new_token_ratio=0.0,
        cpu_overlap_thread_min_ms=0, max_running_requests=6, warmup=False, device=device, **options,
    ) as engine:  # fmt: skip
        if defer_host_loads is not None:
            s = engine.scheduler
            s.config = dataclasses.replace(s.config, defer_host_loads=defer_host_loads)
        turns = []
        for turn in range(2):
            ids = [[*p, 3 + turn, 4 + c] for c, p in enumerate(prefixes)]
            outs = engine.generate(input_ids=ids, sampling_params=greedy)
            assert isinstance(outs, list)
            turns.append(outs)
        kv = engine.scheduler.kv
        kv.check(())
        assert kv.available() == kv.capacity  # every device page free or evictable after the load
        return turns, engine.scheduler


def random_kv_pool(slots: int, layers: int, heads: int, dim: int, dtype: torch.dtype, device: str) -> KVPool:
    """A device KV pool filled with seeded random values (the tier round-trip tests' source)."""
    pool = KVPool(slots, layers, heads, dim, dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return pool


def hybrid_kv(
    device: int = 64, host: int = 64, snapshots: int = 4, page: int = 4, host_snapshots: int = 0
) -> KVCacheManager:
    """A hybrid model's KV manager with the host tier (four rows, contexts of 256 tokens)."""
    config = MemoryConfig(
        max_total_tokens=device, page_size=page, max_running_requests=4, max_context_len=256,
        hybrid=True, state_snapshots=snapshots, host_kv_tokens=host, host_state_snapshots=host_snapshots,
    )  # fmt: skip
    return KVCacheManager(config)


def hybrid_cache(kv: KVCacheManager) -> HybridTieredCache:
    assert isinstance(kv.cache, HybridTieredCache)
    return kv.cache
