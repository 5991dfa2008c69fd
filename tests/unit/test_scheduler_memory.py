"""BatchScheduler memory: admission (a request starts only when its whole prompt fits, cached
prefixes that waiting requests will hit are kept), retraction under memory pressure, and the decode
reserve (new_token_ratio)."""

import pytest

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.req import FinishReason
from tests.helpers.scheduler import make_req, reference_output, run_to_completion, runner_for, sched, step


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
