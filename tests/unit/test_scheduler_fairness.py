"""BatchScheduler fairness: the wait bound (fairness_timeout) that lets an overdue request go ahead
of cache order, and the decodes it preempts to make room."""

import pytest

from radixserve.scheduler.batch_scheduler import BatchScheduler
from tests.helpers.scheduler import (
    SYS,
    make_req,
    reference_output,
    run_to_completion,
    runner_for,
    sched,
    step,
)


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
