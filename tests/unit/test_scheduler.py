"""BatchScheduler, SchedulePolicy and PrefillAdder: behaviour the engine relies on."""

import numpy as np
import pytest

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler, QueueFullError
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.req import FinishReason, Req
from tests.conftest import KVEchoRunner, make_req, reference_output, run_to_completion, runner_for


def sched(clock=None, total=4096, page=1, rows=64, ctx=2048, no_cache=False, **kw) -> BatchScheduler:
    mem = MemoryConfig(
        max_total_tokens=total,
        page_size=page,
        max_running_requests=rows,
        max_context_len=ctx,
        disable_radix_cache=no_cache,
    )
    if clock is None:
        return BatchScheduler(SchedulerConfig(memory=mem, **kw))
    return BatchScheduler(SchedulerConfig(memory=mem, **kw), clock=clock)


def fair_sched(clock, fairness: float | None = 5.0, ratio: float = 0.0) -> BatchScheduler:
    """The fairness scenarios' scheduler: 400 KV tokens, lpm, no chunking, prefill batches as large
    as memory allows, a fixed decode reserve ``ratio``."""
    return sched(
        clock=clock,
        total=400,
        policy="lpm",
        fairness_timeout=fairness,
        chunked_prefill_size=None,
        init_new_token_ratio=ratio,
        min_new_token_ratio=ratio,
        max_prefill_tokens=10_000,
    )


def step(s: BatchScheduler, runner: KVEchoRunner):
    b = s.schedule()
    assert b is not None
    s.process(b, runner.forward(b))
    return b


SYS = list(range(1, 201))  # a 200-token shared prefix


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


def test_fairness_timeout_puts_an_overdue_request_ahead_of_cache_order(clock):
    s = sched(
        clock=clock, policy="lpm", fairness_timeout=5.0, max_prefill_tokens=300, chunked_prefill_size=None
    )
    s.add(make_req("warm", SYS + [1], max_new=1))
    run_to_completion(s)
    s.add(make_req("cold", list(range(500, 800)), max_new=1, t=0.0))
    s.add(make_req("hot", SYS + [9] * 50, max_new=1, t=4.0))
    clock.t = 4.0
    assert [r.rid for r in s.schedule().reqs] == ["hot"]  # cold has waited 4 s < 5 s
    s.add(make_req("hot2", SYS + [8] * 50, max_new=1, t=5.5))
    clock.t = 6.0
    assert [r.rid for r in s.schedule().reqs] == ["cold"]  # overdue: it goes first


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


def test_retraction_frees_memory_and_outputs_are_unchanged():
    # 8 requests of 40-token prompts that each grow by 60 tokens in a 400-token pool.
    s = sched(total=400, page=4, init_new_token_ratio=0.0, min_new_token_ratio=0.0, chunked_prefill_size=None)
    prompts = [[i] + list(range(100 + i, 139 + i)) for i in range(8)]
    for i, p in enumerate(prompts):
        s.add(make_req(f"r{i}", p, max_new=60, t=float(i)))
    done = run_to_completion(s)
    assert s.num_retractions > 0
    assert sorted(r.rid for r in done) == [f"r{i}" for i in range(8)]
    for r in done:
        assert r.output_ids == reference_output(r.origin_ids.tolist(), 60)
    assert s.kv.available() == s.kv.capacity


def test_retraction_takes_the_request_with_least_progress_and_raises_the_ratio():
    s = sched(
        total=200,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        chunked_prefill_size=None,
        retract_ratio_step=0.25,
    )
    runner = runner_for(s)
    s.add(make_req("old", list(range(1, 60)), max_new=100, t=0.0))
    step(s, runner)
    for _ in range(10):
        step(s, runner)  # old decodes ten tokens
    s.add(make_req("new", list(range(100, 160)), max_new=100, t=1.0))
    step(s, runner)
    while not s.num_retractions:
        step(s, runner)
    assert [r.rid for r in s.waiting] == ["new"] and s.waiting[0].retractions == 1
    assert s.new_token_ratio == pytest.approx(0.25)


def test_new_token_ratio_decays_while_memory_is_fine():
    s = sched(init_new_token_ratio=0.7, min_new_token_ratio=0.1, new_token_ratio_decay_steps=6)
    runner = runner_for(s)
    s.add(make_req("a", [1, 2, 3], max_new=20))
    step(s, runner)
    for _ in range(10):
        step(s, runner)
    assert s.new_token_ratio == pytest.approx(0.1)


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


@pytest.mark.parametrize("fairness", [None, 5.0])
def test_overdue_request_preempts_younger_decodes_and_runs_in_the_next_batch(clock, fairness):
    s = fair_sched(clock, fairness=fairness)
    runner = runner_for(s)
    warm = list(range(1, 101))  # a 100-token prefix everyone but `late` shares
    s.add(make_req("w", [*warm, 0], max_new=1))
    run_to_completion(s)
    clock.t = 1.0
    late = make_req("late", list(range(1000, 1120)), max_new=10, t=1.0)
    s.add(late)
    for i in range(4):  # younger, and they hit the cache: lpm puts them first; they fill the pool
        s.add(
            make_req(f"y{i}", warm + list(range(200 + 60 * i, 260 + 60 * i)), max_new=200, t=1.01 + i / 100)
        )
    for _ in range(30):
        clock.t += 0.01
        step(s, runner)
    assert late.admit_time is None  # starved by cache order and a full pool
    clock.t = 7.0  # late has waited 6 s > 5 s
    batches = [step(s, runner) for _ in range(3)]
    admitted = any(r is late for b in batches for r in b.reqs)
    if fairness is None:
        assert not admitted  # without the bound it waits for the decodes to drain
    else:
        assert any(r is late for r in batches[0].reqs)  # the very next batch
        assert s.num_fairness_preemptions >= 1
        assert all(r.arrival_time > late.arrival_time for r in s.waiting)  # only younger ones gave way
    done = run_to_completion(s)
    for r in done:
        assert r.output_ids == reference_output(r.origin_ids.tolist(), r.sampling.max_new_tokens)
    assert s.kv.available() == s.kv.capacity


def test_a_request_due_soon_goes_before_younger_cache_hits(clock):
    s = sched(clock=clock, policy="lpm", fairness_timeout=5.0, fairness_lead=0.1)
    s.add(make_req("warm", [*SYS, 1], max_new=1))
    run_to_completion(s)
    s.add(make_req("cold", list(range(500, 600)), t=0.0))
    s.add(make_req("hit", [*SYS, 2], t=1.0))
    assert [r.rid for r in s.policy.order(s.waiting, 4.4)] == ["hit", "cold"]  # cache order
    # Within the lead (4.5 s of 5 s) cold goes first: admission stops at it if it does not fit,
    # so younger requests stop taking the memory it needs before it is overdue.
    assert [r.rid for r in s.policy.order(s.waiting, 4.6)] == ["cold", "hit"]


def test_wait_before_and_after_a_retraction_counts_once(clock):
    s = sched(clock=clock, fairness_timeout=100.0)
    runner = runner_for(s)
    r = make_req("r", list(range(1, 51)), max_new=50, t=0.0)
    s.add(r)
    for admit_at, retract_at in ((1.0, 2.0), (4.0, 5.0)):  # waits 1 s, runs, waits 2 s, runs
        clock.t = admit_at
        assert step(s, runner).reqs == [r]
        clock.t = retract_at
        s.running.remove(r)  # what memory pressure does (_retract_until_fits)
        s._retract(r)
    assert r.waited == pytest.approx(3.0)
    assert clock.t - r.queue_time == pytest.approx(3.0)  # its fairness clock: time spent waiting


def test_requests_falling_due_together_run_in_one_batch(clock):
    s = fair_sched(clock)
    runner = runner_for(s)
    warm = list(range(1, 101))
    s.add(make_req("w", [*warm, 0], max_new=1))
    run_to_completion(s)
    late = [
        make_req(f"late{i}", list(range(1000 + 200 * i, 1120 + 200 * i)), max_new=10, t=1.0) for i in (0, 1)
    ]
    for r in late:
        s.add(r)
    for i in range(4):  # younger cache hits: lpm puts them first and they fill the pool
        s.add(
            make_req(f"y{i}", warm + list(range(200 + 60 * i, 260 + 60 * i)), max_new=200, t=1.01 + i / 100)
        )
    for _ in range(30):
        clock.t += 0.01
        step(s, runner)
    assert all(r.admit_time is None for r in late)
    clock.t = 7.0  # both overdue at once: room is made for both, not just the oldest
    assert {r.rid for r in step(s, runner).reqs} >= {"late0", "late1"}
    run_to_completion(s)
    assert s.kv.available() == s.kv.capacity


def test_a_chunked_prefill_keeps_the_memory_promised_to_its_whole_prompt():
    # 400-token pool, 64-token chunks. After long's first chunk, 336 tokens are free but 236 of
    # them are promised to the rest of long's prompt: a 120-token request must wait.
    s = sched(
        total=400,
        chunked_prefill_size=64,
        max_prefill_tokens=1000,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        policy="fcfs",
        dedup_min_tokens=0,
    )
    runner = runner_for(s)
    s.add(make_req("long", list(range(1, 301)), max_new=4, t=0.0))
    s.add(make_req("small", list(range(400, 520)), max_new=4, t=1.0))
    chunks = []
    while s.chunked is not None or not chunks:
        b = step(s, runner)
        assert "small" not in [r.rid for r in b.reqs]
        chunks += [int(n) for r, n in zip(b.reqs, b.extend_lens, strict=True) if r.rid == "long"]
    assert chunks == [64, 64, 64, 64, 44]  # every prefill step carried long's next chunk
    assert len(run_to_completion(s)) == 2


def test_a_request_is_admitted_only_when_its_whole_prompt_fits():
    s = sched(total=400, chunked_prefill_size=64, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    runner = runner_for(s)
    s.add(make_req("a", list(range(1, 201)), max_new=150, t=0.0))
    while s.chunked is not None or s.waiting:
        step(s, runner)
    step(s, runner)  # a decodes; 199 tokens free
    s.add(make_req("b", list(range(500, 700)), max_new=1, t=1.0))  # its first chunk would fit
    b = s.schedule()
    assert b.mode is ForwardMode.DECODE  # b waits: its 200-token prompt does not fit whole


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


def test_abort_of_a_request_retracted_while_its_old_batch_is_in_flight_removes_it():
    # Overlap order: schedule N+1 before processing N. A request retracted at N+1's schedule
    # still appears in batch N; aborting it must take it out of the waiting queue.
    s = sched(total=26, ctx=64, rows=4, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    runner = runner_for(s)
    s.add(make_req("a", list(range(10, 20)), max_new=14, t=0.0))
    s.add(make_req("b", list(range(30, 42)), max_new=14, t=1.0))
    in_flight = []
    victim = None
    for _ in range(12):
        batch = s.schedule()
        in_flight.append((batch, runner.forward(batch)))
        victim = next((r for r in s.waiting if any(r in b.reqs for b, _ in in_flight[:-1])), None)
        if victim is not None:
            break
        while len(in_flight) > 1:
            s.process(*in_flight.pop(0))
    assert victim is not None, "the scenario needs a retraction under overlap"
    assert s.abort(victim.rid) is victim
    assert victim.finished and victim not in s.waiting
    for b, t in in_flight:
        s.process(b, t)
    done = run_to_completion(s)
    assert {r.rid for r in done} == {"a", "b"} - {victim.rid}  # the other one still completes
    assert s.kv.available() == s.kv.capacity


@pytest.mark.parametrize("n_young", [1, 2, 3])
def test_an_overdue_request_whose_cached_prefix_nobody_locks_still_gets_room(clock, n_young):
    """Its prefix is evictable, so it counts in available(), but admitting the request locks it:
    room must be made for it too, or nothing is preempted and the request waits for the younger
    decodes to finish (found in review: 100+ steps)."""
    s = fair_sched(clock, ratio=1.0)
    runner = runner_for(s)
    shared, late_prefix = list(range(1, 151)), list(range(1000, 1100))
    for rid, prompt in (("p", late_prefix), ("w", shared)):  # both prefixes cached, unlocked
        s.add(make_req(rid, [*prompt, 0], max_new=1))
        run_to_completion(s)
    clock.t = 1.0
    late = make_req("late", [*late_prefix, *range(3000, 3020)], max_new=10, t=1.0)
    s.add(late)
    for i in range(n_young):  # younger cache hits run ahead of it and fill the pool
        s.add(
            make_req(f"y{i}", [*shared, *range(5000 + 40 * i, 5040 + 40 * i)], max_new=150, t=1.01 + i / 100)
        )
    for _ in range(5):
        clock.t += 0.01
        step(s, runner)
    assert late.admit_time is None  # held back by the younger hits (lpm), not yet due
    clock.t = 7.0  # overdue
    batch = step(s, runner)
    assert late in batch.reqs and s.num_fairness_preemptions > 0
    run_to_completion(s)
    assert s.kv.available() == s.kv.capacity


A_PREFIX = list(range(1000, 1100))  # two tenants' system prompts, 100 and 150 tokens
B_PREFIX = list(range(2000, 2150))


def tight_sched(total: int = 400) -> BatchScheduler:
    """A small pool, lpm, no chunking, an exact decode reserve (ratio 1): admission alone decides
    what gets evicted."""
    return sched(
        total=total,
        policy="lpm",
        chunked_prefill_size=None,
        init_new_token_ratio=1.0,
        min_new_token_ratio=1.0,
        max_prefill_tokens=10_000,
    )


def test_admission_keeps_a_cached_prefix_that_a_waiting_request_will_hit():
    s = tight_sched()
    s.add(make_req("a0", A_PREFIX + [1], max_new=1))
    s.add(make_req("b0", B_PREFIX + [1], max_new=1))
    run_to_completion(s)  # both prefixes cached, nothing locks them
    s.add(make_req("long", list(range(3000, 3040)), max_new=30))
    step(s, runner_for(s))  # "long" runs: the engine is not idle
    # The B requests go first (longer match). All three fit only by evicting A's prefix, which
    # "a1" (behind them) would then compute again.
    for i in range(3):
        s.add(make_req(f"b{i + 1}", B_PREFIX + list(range(4000 + 100 * i, 4050 + 100 * i)), max_new=2))
    s.add(make_req("a1", A_PREFIX + [7, 7, 7, 7, 7], max_new=2))
    b = step(s, runner_for(s))
    assert b.mode is ForwardMode.EXTEND and [r.rid for r in b.reqs] == ["b1"]
    done = {r.rid: r for r in run_to_completion(s)}
    assert done["a1"].num_cached_tokens == 100  # A's prefix was still there
    assert all(
        r.output_ids == reference_output(r.origin_ids.tolist(), 2) for r in done.values() if r.rid != "long"
    )
    assert s.kv.available() == s.kv.capacity


def test_an_idle_engine_admits_a_request_even_if_it_evicts_a_wanted_prefix():
    s = tight_sched()
    s.add(make_req("a0", A_PREFIX + [1], max_new=1))
    s.add(make_req("b0", B_PREFIX + [1], max_new=1))
    run_to_completion(s)
    # "x" (longest match) needs more than the free pages plus everything but A's prefix, which
    # "a1" wants. With nothing running, nothing would ever make room for it: it goes now.
    s.add(make_req("x", B_PREFIX + list(range(5000, 5200)), max_new=1))
    s.add(make_req("a1", A_PREFIX + [7], max_new=1))
    b = step(s, runner_for(s))
    assert [r.rid for r in b.reqs] == ["x"] and b.reqs[0].finish_reason is FinishReason.LENGTH
    (a1,) = run_to_completion(s)
    assert a1.rid == "a1" and a1.output_ids == reference_output(a1.origin_ids.tolist(), 1)
    assert s.kv.available() == s.kv.capacity


def test_a_shared_prefix_starts_only_with_room_for_the_requests_waiting_to_hit_it():
    # Two tenants' bursts arrive at once; nothing is cached. Each tenant's first request is
    # offered (the rest are held back to hit its prefix). Both firsts fit, but only one tenant's
    # whole group fits beside the other's: starting both would pin two prefixes and leave room
    # for neither group, so the second tenant starts when its group has room.
    s = tight_sched(total=300)
    for i in range(5):
        s.add(make_req(f"a{i}", A_PREFIX + [10 + i] * 10, max_new=4, t=i))
    for i in range(5):
        s.add(make_req(f"b{i}", B_PREFIX[:120] + [20 + i] * 10, max_new=4, t=5 + i))
    b = step(s, runner_for(s))
    assert [r.rid for r in b.reqs] == ["a0"]
    done = {r.rid: r for r in run_to_completion(s)}
    assert len(done) == 10 and all(
        r.output_ids == reference_output(r.origin_ids.tolist(), 4) for r in done.values()
    )
    assert [done[f"a{i}"].num_cached_tokens for i in range(1, 5)] == [100] * 4
    assert [done[f"b{i}"].num_cached_tokens for i in range(1, 5)] == [120] * 4
    assert s.kv.available() == s.kv.capacity
