"""The batch scheduler's configuration, as the engine resolves it from its arguments.

The engine builds it from ``EngineConfig`` (service_config.py), where every user-facing default
lives; the defaults here are those same values, for code that builds a scheduler directly (tests,
benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.common.service_config import CUDA_CHUNKED_PREFILL_SIZE, ENGINE_DEFAULTS, SCHEDULE_POLICIES
from radixserve.scheduler.memory.manager import MemoryConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    memory: MemoryConfig = field(default_factory=lambda: MemoryConfig(max_total_tokens=65536))
    policy: str = ENGINE_DEFAULTS.schedule_policy
    # A request waiting longer than this (seconds) is admitted ahead of cache order. None: off.
    fairness_timeout: float | None = ENGINE_DEFAULTS.fairness_timeout
    # Requests that have waited more than (1 - fairness_lead) * fairness_timeout go first (oldest
    # first) before they are overdue, so the memory they need is not handed to younger requests:
    # without a lead an overdue request can wait for older decodes to drain the pool. Larger: a
    # tighter bound, more fcfs-like order (fewer prefix hits). 0.1 met the bound in policy_sim.
    fairness_lead: float = ENGINE_DEFAULTS.fairness_lead
    # Above this many waiting requests, lpm / dfs-weight order costs more than it wins: use fcfs.
    lpm_fcfs_threshold: int = 128
    # In-batch prefix de-duplication: a waiting request that shares at least this many
    # not-yet-cached tokens with one already chosen waits a step, then hits the cache. 0: off.
    dedup_min_tokens: int = 32
    max_prefill_tokens: int = ENGINE_DEFAULTS.max_prefill_tokens  # new tokens per prefill batch
    chunked_prefill_size: int | None = CUDA_CHUNKED_PREFILL_SIZE  # None: no chunking
    max_running_requests: int | None = None  # None: the memory config's table rows
    max_waiting_requests: int = ENGINE_DEFAULTS.max_waiting_requests
    # After this many prefill batches in a row, run one decode batch (decodes never starve).
    max_consecutive_prefills: int = 4
    # Decode reserve: each running request is expected to need new_token_ratio * remaining tokens.
    init_new_token_ratio: float = ENGINE_DEFAULTS.init_new_token_ratio
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600  # decode steps from init to min
    retract_ratio_step: float = 0.2  # added to the ratio on every retraction
    clip_max_new_tokens: int = 4096  # cap on the per-request reserve estimate
    # A request whose prefix must be loaded from the host tier waits a step while the others run
    # (PrefillAdder): where the copies run beside the forward (CUDA: their own stream). The engine
    # turns it off on CPU, where the scheduler thread runs them within the step anyway: waiting would
    # only cost the request a step (16 conversations x 4 turns: 21 prefill steps against 16).
    defer_host_loads: bool = True

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {self.policy!r}; choose one of {SCHEDULE_POLICIES}")
        if self.fairness_timeout is not None and self.fairness_timeout < 0:
            raise ValueError("fairness_timeout must be >= 0")
        if not 0 <= self.fairness_lead <= 1:
            raise ValueError("fairness_lead must be in [0, 1]")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.memory.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")
        if self.max_prefill_tokens < 1 or self.max_consecutive_prefills < 1:
            raise ValueError("max_prefill_tokens and max_consecutive_prefills must be >= 1")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")

    @property
    def running_limit(self) -> int:
        rows = self.memory.max_running_requests
        return rows if self.max_running_requests is None else min(rows, self.max_running_requests)
