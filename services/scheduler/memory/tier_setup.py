"""The KV tiers below the device, sized and opened from the engine's settings (docs/architecture.md,
"KV tiers"): the host tier's tokens, and the disk tier's directory."""

from __future__ import annotations

import logging
from pathlib import Path

from radixserve.common.block_hash import DEFAULT_BLOCK_SIZE, root_hash
from radixserve.common.service_config import EngineConfig
from radixserve.scheduler.memory.allocator import host_kv_tokens
from radixserve.scheduler.memory.disk_store import BlockLayout, DiskStore
from radixserve.scheduler.memory.disk_tier import DiskTier
from radixserve.scheduler.memory.manager import DISK_NEEDS_HOST, HYBRID_DISK_REFUSED
from radixserve.scheduler.memory.state_pool import plan_host_states
from radixserve.scheduler.model.config import ModelConfig

log = logging.getLogger(__name__)


def host_sizes(cfg: EngineConfig, per_token: int, local: ModelConfig) -> tuple[int, int]:
    """The host tier's KV tokens (``host_kv_cache_gb``; 0: none) and, for a hybrid model, its state
    snapshots (``host_state_snapshots``, taken out of the same memory: memory/state_pool.py
    ``plan_host_states``). ``local``: this rank's shard."""
    gb, page = cfg.host_kv_cache_gb, cfg.page_size
    snapshots = state_bytes = 0
    if gb > 0 and local.hybrid is not None and not cfg.disable_radix_cache:
        shape, asked = local.hybrid.state_shape(), cfg.host_state_snapshots
        snapshots, state_bytes = plan_host_states(shape, local.dtype, int(gb * 2**30), asked)
    tokens = host_kv_tokens(gb - state_bytes / 2**30, per_token, page)
    if gb > 0 and not tokens:
        raise ValueError(
            f"host_kv_cache_gb {gb:g} holds no KV page ({per_token * page} bytes)"
            + (f" beside {snapshots} host_state_snapshots" if snapshots else "")
        )
    if tokens:
        log.info("host KV tier: %d tokens (%.1f MiB)", tokens, tokens * per_token / 2**20)
    if snapshots:
        log.info("host state snapshots: %d (%.1f MiB)", snapshots, state_bytes / 2**20)
    return tokens, snapshots


def disk_block_size(page_size: int) -> int:
    """The disk tier's block: the prefix index's default, rounded up to whole pages (block events,
    when on, set theirs: memory/disk_cache.py)."""
    return -(-DEFAULT_BLOCK_SIZE // page_size) * page_size


def disk_tier(cfg: EngineConfig, model_path: str | Path, local: ModelConfig) -> DiskTier | None:
    """The disk tier on ``kv_disk_cache_dir`` (None: off). A directory that cannot be opened for
    writing leaves the engine host-only, with one warning; settings it cannot serve are refused.
    ``local``: rank 0's shard (tensor parallelism: each rank's files hold its own KV heads)."""
    if cfg.kv_disk_cache_dir is None:
        return None
    if local.hybrid is not None:
        raise ValueError(HYBRID_DISK_REFUSED)
    if cfg.host_kv_cache_gb <= 0:
        raise ValueError(DISK_NEEDS_HOST)
    bs = disk_block_size(cfg.page_size)
    layout = BlockLayout((2 * local.num_kv_layers, bs, local.num_kv_heads, local.head_dim), local.dtype)
    capacity = int(cfg.kv_disk_cache_gb * 2**30)
    try:
        store = DiskStore(
            cfg.kv_disk_cache_dir, capacity, layout, root_hash(Path(model_path).name), tp=cfg.tp_size
        )
    except OSError as e:
        log.warning("disk KV tier off, serving from the host tier alone: %s", e)
        return None
    log.info(
        "disk KV tier: %s (id %s), %d blocks held, up to %.1f GiB",
        store.path, store.dir_id, len(store.hashes()), cfg.kv_disk_cache_gb,
    )  # fmt: skip
    return DiskTier(store, bs)
