"""``Engine(path, **options)``'s keyword arguments, typed: ``EngineConfig``'s fields
(common/service_config.py; tests/unit/test_config.py holds the two equal)."""

from __future__ import annotations

from typing import TypedDict


class EngineOptions(TypedDict, total=False):
    """``EngineConfig``'s fields as keyword arguments (``Engine(path, tp_size=2)``), typed for the
    type checker; tests/unit/test_config.py holds the two equal."""

    page_size: int
    max_total_tokens: int | None
    mem_fraction: float
    max_running_requests: int
    max_waiting_requests: int
    max_context_len: int | None
    chunked_prefill_size: int | None
    max_prefill_tokens: int
    schedule_policy: str
    fairness_timeout: float | None
    fairness_lead: float
    init_new_token_ratio: float
    disable_radix_cache: bool
    max_state_snapshots: int | None
    snapshot_interval: int
    host_kv_cache_gb: float
    host_state_snapshots: int | None
    kv_write_policy: str
    kv_disk_cache_dir: str | None
    kv_disk_cache_gb: float
    kv_disk_write_down_s: float
    disable_overlap: bool | None
    cpu_overlap_thread_min_ms: float
    attention_backend: str
    device: str
    dtype: str
    quantization: str
    load_format: str
    seed: int
    disable_cuda_graph: bool
    cuda_graph_max_bs: int
    cpu_static_decode: bool
    warmup: bool
    tp_size: int
    tp_timeout: float
