"""What the tier metrics count (radixserve_kv_hit_tokens by tier; the load-back's bytes and seconds),
checked against what the scheduler really did: the echo runner (tests/helpers/scheduler.py) runs the
copies the scheduler plans and counts the tokens it loaded, and the host pool times real copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.host_pool import HostKVPool, KVLoad
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.tiered_cache import KVTransfers
from tests.helpers.scheduler import make_req, run_to_completion, runner_for, sched

PREFIX = 48


def _two_turns(host: int, **kw):
    """Six conversations, two turns each, through a device pool of 160 tokens (about two of them)."""
    s = sched(total=160, page=4, host=host, min_new_token_ratio=0.0, **kw)
    convs = [[1000 + 100 * c + i for i in range(PREFIX)] for c in range(6)]
    done = []
    for turn in range(2):
        for c, prefix in enumerate(convs):
            s.add(make_req(f"c{c}t{turn}", [*prefix, 7 + turn, 9 + c], max_new=12, t=float(10 * turn + c)))
        done += run_to_completion(s)
    return s, done


def test_hit_tokens_by_tier_are_the_cached_tokens_and_the_host_part_is_what_was_loaded():
    s, done = _two_turns(2048, chunked_prefill_size=None, init_new_token_ratio=0.7)
    assert s.num_retractions == 0  # each request admitted once: its hits are its cached tokens
    hits = s.kv.hit_tokens
    assert hits["host"] == runner_for(s).loaded >= 3 * PREFIX  # the second turns' prefixes came back
    assert hits["device"] + hits["host"] == sum(r.num_cached_tokens for r in done)
    assert sum(r.loaded_len for r in done) == hits["host"]


def test_without_a_host_tier_every_hit_is_the_devices():
    s, done = _two_turns(0, chunked_prefill_size=None, init_new_token_ratio=0.7)
    assert s.kv.hit_tokens == {"device": sum(r.num_cached_tokens for r in done)}


def test_with_retractions_a_readmission_counts_its_hits_again():
    s, done = _two_turns(2048, chunked_prefill_size=8, init_new_token_ratio=0.0)
    assert s.num_retractions > 0
    hits = s.kv.hit_tokens
    assert hits["host"] > 0 and hits["device"] + hits["host"] >= sum(r.num_cached_tokens for r in done)


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_the_host_pool_times_a_steps_loads_and_only_its_loads(device):
    page, layers, heads, dim = 4, 2, 2, 8
    pool = KVPool(17 * page, layers, heads, dim, torch.float32, device)
    host = HostKVPool(9 * page, layers, heads, dim, torch.float32, torch.device(device))
    assert host.bytes_per_slot == 2 * layers * heads * dim * 4  # K and V of every layer, float32
    slots = PagedAllocator(16, page).pages_to_slots(np.array([3, 7], dtype=np.int64))
    host_slots = PagedAllocator(8, page).pages_to_slots(np.array([1, 2], dtype=np.int64))
    empty = np.zeros(0, dtype=np.int64)
    stored = KVLoad(0, 0)
    host.run(pool, KVTransfers(slots, host_slots, empty, empty), stored)  # a write-back alone
    assert stored.start is None and stored.seconds() is None
    load = KVLoad(len(slots), len(slots) * host.bytes_per_slot)
    host.run(pool, KVTransfers(empty, empty, host_slots, slots), load)
    host.synchronize()
    seconds = load.seconds()
    assert load.start is not None and seconds is not None and seconds > 0
