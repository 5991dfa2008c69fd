"""BatchScheduler, SchedulePolicy and PrefillAdder: behaviour the engine relies on.

Fairness is in test_scheduler_fairness.py, admission and retraction in test_scheduler_memory.py;
all three build their schedulers with tests/helpers/scheduler.py's ``sched`` and step them with its
``step``.
"""

import numpy as np
import pytest

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler, QueueFullError
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.req import FinishReason, Req
from tests.helpers.scheduler import (
    SYS,
    make_req,
    reference_output,
    run_to_completion,
    runner_for,
    sched,
    step,
)


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
@pytest.mark.parametrize("no_cache", [False, True])
def test_outputs_do_not_depend_on_cache_policy_paging_or_chunking(page, policy, no_cache):
    rng = np.random.default_rng(1)
    prompts = [
        SYS[: rng.integers(1, 200)] + rng.integers(0, 90, rng.integers(1, 60)).tolist() for _ in range(24)
    ]
    s = sched(page=page, policy=policy, no_cache=no_cache, chunked_prefill_size=64, max_prefill_tokens=128)
    for i, p in enumerate(prompts):
        s.add(make_req(f"r{i}", p, max_new=int(rng.integers(1, 12))))
    done = run_to_completion(s)
    assert len(done) == 24
    for r in done:
        assert r.output_ids == reference_output(r.origin_ids.tolist(), r.sampling.max_new_tokens)
        assert r.finish_reason is FinishReason.LENGTH
    assert s.kv.available() == s.kv.capacity
    s.kv.cache.evict(s.kv.capacity)
    assert s.kv.allocator.free_tokens == s.kv.capacity  # the pool is back to full


def test_second_request_hits_the_prefix_the_first_cached():
    s = sched()
    s.add(make_req("a", SYS + [1, 2], max_new=2))
    run_to_completion(s)
    s.add(make_req("b", SYS + [3, 4], max_new=2))
    (b,) = run_to_completion(s)
    assert b.num_cached_tokens == 200


def test_prefix_is_cached_right_after_prefill_while_the_request_decodes():
    s = sched()
    runner = runner_for(s)
    s.add(make_req("a", SYS + [1], max_new=50))
    step(s, runner)  # prefill of a
    s.add(make_req("b", SYS + [2], max_new=2))
    batch = step(s, runner)
    assert batch.mode is ForwardMode.EXTEND and batch.prefix_lens.tolist() == [200]


def test_chunked_prefill_cuts_a_long_prompt_and_caches_each_chunk():
    s = sched(chunked_prefill_size=64, max_prefill_tokens=64, page=16)
    runner = runner_for(s)
    prompt = list(range(1, 151))
    s.add(make_req("long", prompt, max_new=3))
    lens = []
    for _ in range(3):
        b = step(s, runner)
        lens.append((int(b.prefix_lens[0]), int(b.extend_lens[0])))
    assert lens == [(0, 64), (64, 64), (128, 22)]
    # Between chunks the written part sits in the tree, locked by the request.
    assert s.kv.cache.protected_size == 144  # 150 tokens, page-aligned down
    assert s.running and s.running[0].rid == "long"
    (r,) = run_to_completion(s)
    assert r.output_ids == reference_output(prompt, 3)


def test_prefill_budget_counts_only_the_uncached_suffix():
    s = sched(max_prefill_tokens=64, chunked_prefill_size=None)
    s.add(make_req("warm", SYS + [1], max_new=1))
    run_to_completion(s)
    for i in range(3):
        s.add(make_req(f"r{i}", SYS + [10 + i] * 20, max_new=1))
    b = s.schedule()
    # 3 x 220 tokens but only 3 x 20 uncached: all three fit a 64-token prefill budget.
    assert b.size == 3 and b.num_tokens == 60


def test_lpm_puts_the_longest_cached_prefix_first():
    s = sched(policy="lpm", max_prefill_tokens=300, chunked_prefill_size=None)
    s.add(make_req("warm", SYS + [1], max_new=1))
    run_to_completion(s)
    s.add(make_req("cold", list(range(500, 800)), max_new=1, t=1.0))
    s.add(make_req("hot", SYS + [9] * 50, max_new=1, t=2.0))
    b = s.schedule()
    assert [r.rid for r in b.reqs] == ["hot"]  # cold (300 new tokens) no longer fits after hot


def test_fcfs_keeps_arrival_order():
    s = sched(policy="fcfs", max_prefill_tokens=300, chunked_prefill_size=None)
    s.add(make_req("warm", SYS + [1], max_new=1))
    run_to_completion(s)
    s.add(make_req("cold", list(range(500, 800)), max_new=1, t=1.0))
    s.add(make_req("hot", SYS + [9] * 50, max_new=1, t=2.0))
    assert [r.rid for r in s.schedule().reqs] == ["cold"]


def test_lpm_falls_back_to_fcfs_above_the_queue_threshold():
    s = sched(policy="lpm", max_prefill_tokens=300, chunked_prefill_size=None, lpm_fcfs_threshold=1)
    s.add(make_req("warm", SYS + [1], max_new=1))
    run_to_completion(s)
    s.add(make_req("cold", list(range(500, 800)), max_new=1, t=1.0))
    s.add(make_req("hot", SYS + [9] * 50, max_new=1, t=2.0))
    assert [r.rid for r in s.schedule().reqs] == ["cold"]


def test_dfs_weight_runs_the_heaviest_shared_subtree_first():
    s = sched(policy="dfs-weight", max_prefill_tokens=10_000, chunked_prefill_size=None, dedup_min_tokens=0)
    other = list(range(300, 400))
    s.add(make_req("w1", SYS + [1], max_new=1))
    s.add(make_req("w2", other + [1], max_new=1))
    run_to_completion(s)
    s.add(make_req("o1", other + [5], max_new=1, t=1.0))
    for i in range(3):
        s.add(make_req(f"s{i}", SYS + [6 + i], max_new=1, t=2.0 + i))
    order = [r.rid for r in s.policy.order(s.waiting, 0.0)]
    assert order == ["s0", "s1", "s2", "o1"]


def test_waiting_requests_sharing_an_uncached_prefix_are_prefilled_once():
    s = sched(policy="lpm", max_prefill_tokens=10_000, chunked_prefill_size=None)
    runner = runner_for(s)
    for i in range(4):
        s.add(make_req(f"s{i}", SYS + [i] * 5, max_new=2, t=float(i)))
    s.add(make_req("other", list(range(300, 350)), max_new=2, t=9.0))
    first = step(s, runner)
    assert sorted(r.rid for r in first.reqs) == ["other", "s0"]
    second = step(s, runner)
    assert sorted(r.rid for r in second.reqs) == ["s1", "s2", "s3"]
    assert second.prefix_lens.tolist() == [200, 200, 200]


def test_dedup_holds_back_requests_behind_a_chunked_prefill_of_their_prefix():
    s = sched(policy="lpm", max_prefill_tokens=64, chunked_prefill_size=64)
    runner = runner_for(s)
    s.add(make_req("a", SYS + [1], max_new=2, t=0.0))
    s.add(make_req("b", SYS + [2], max_new=2, t=1.0))
    done = []
    while s.waiting or s.chunked:
        b = step(s, runner)
        if b.mode is ForwardMode.EXTEND and any(r.rid == "b" for r in b.reqs):
            done.append(int(b.prefix_lens[[r.rid for r in b.reqs].index("b")]))
    # b was held back while a's chunks wrote the shared prefix, until fewer than
    # dedup_min_tokens (32) shared tokens were left uncached: 192 of 200 came from cache.
    assert done == [192]


def test_decode_is_not_starved_by_a_stream_of_prefills():
    s = sched(max_consecutive_prefills=2, max_prefill_tokens=64, chunked_prefill_size=32)
    runner = runner_for(s)
    s.add(make_req("decoder", [1, 2, 3], max_new=100))
    step(s, runner)
    for i in range(20):
        s.add(make_req(f"long{i}", list(range(7, 400)), max_new=1, t=float(i + 1)))
    modes = [step(s, runner).mode for _ in range(30)]
    runs = "".join("P" if m is ForwardMode.EXTEND else "D" for m in modes)
    assert "PPP" not in runs and "D" in runs


def test_abort_frees_the_requests_kv_at_once():
    s = sched(page=4)
    runner = runner_for(s)
    s.add(make_req("a", list(range(1, 30)), max_new=50))
    s.add(make_req("w", list(range(40, 50)), max_new=5))
    step(s, runner)
    step(s, runner)
    a = next(r for r in s.running if r.rid == "a")
    held = -(-a.alloc_len // 4) * 4
    before = s.kv.available()
    assert s.abort("a").finish_reason is FinishReason.ABORT
    assert s.kv.available() == before + held  # every page of a is free or evictable now
    assert s.abort("nope") is None
    s.kv.check(s.live_requests())
    s.abort("w")
    assert s.kv.available() == s.kv.capacity


def test_bad_requests_are_rejected_with_a_clear_error():
    s = sched(total=256, ctx=128, max_waiting_requests=1)
    with pytest.raises(ValueError, match="empty"):
        s.add(make_req("e", []))
    with pytest.raises(ValueError, match="context length"):
        s.add(make_req("c", range(100), max_new=50))
    s.add(make_req("ok", range(10)))
    with pytest.raises(QueueFullError):
        s.add(make_req("full", range(10)))
    with pytest.raises(ValueError, match="positive"):
        s.add(Req("neg", [1, 2], SamplingParams(max_new_tokens=-1)))
    with pytest.raises(ValueError, match="top_p"):
        s.add(Req("p", [1, 2], SamplingParams(top_p=0.0)))
    assert [r.rid for r in s.waiting] == ["ok"]  # nothing bad was queued
    with pytest.raises(ValueError, match="unknown schedule policy"):
        SchedulerConfig(policy="random")


def test_prompt_over_kv_capacity_is_rejected():
    s = sched(total=64, ctx=1024)
    with pytest.raises(ValueError, match="KV capacity"):
        s.add(make_req("big", range(60), max_new=10))


def test_stop_tokens_and_eos_end_a_request():
    s = BatchScheduler(SchedulerConfig(memory=MemoryConfig(max_total_tokens=512)), eos_token_ids=[5])
    ref = reference_output([1, 2, 3], 30)
    stop_at = ref[3]
    s.add(
        Req("stop", [1, 2, 3], SamplingParams(max_new_tokens=30, stop_token_ids=(stop_at,), ignore_eos=True))
    )
    (r,) = run_to_completion(s)
    assert r.finish_reason is FinishReason.STOP and r.output_ids[-1] == stop_at
    assert r.output_ids == ref[: ref.index(stop_at) + 1]


def test_dfs_weight_puts_requests_with_no_cached_prefix_after_the_shared_subtrees():
    s = sched(policy="dfs-weight", max_prefill_tokens=10_000, chunked_prefill_size=None, dedup_min_tokens=0)
    s.add(make_req("w", [*SYS, 1], max_new=1))
    run_to_completion(s)
    s.add(make_req("unmatched", list(range(500, 600)), max_new=1, t=1.0))
    s.add(make_req("hit", [*SYS, 2], max_new=1, t=2.0))
    assert [r.rid for r in s.policy.order(s.waiting, 0.0)] == ["hit", "unmatched"]


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_abort_of_a_request_in_flight_is_not_lost_and_frees_its_kv_after_the_step(when):
    s = sched(page=4)
    runner = runner_for(s)
    s.add(make_req("a", list(range(1, 30)), max_new=50))
    s.add(make_req("b", list(range(40, 60)), max_new=50))
    if when == "decode":
        step(s, runner)
    batch = s.schedule()  # in flight: the forward may still write a's slots
    r = s.abort("a")
    assert r is not None and r.finish_reason is FinishReason.ABORT
    assert r.req_pool_idx is not None  # not freed under a running forward
    finished = s.process(batch, runner.forward(batch))
    assert r not in finished and r.req_pool_idx is None  # freed once the step is done
    s.kv.check(s.live_requests())
    assert [x.rid for x in run_to_completion(s)] == ["b"]
    assert s.kv.available() == s.kv.capacity
