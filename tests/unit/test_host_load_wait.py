"""A request whose prefix must be loaded back from the host tier waits a step for its load while the
others run (docs/architecture.md, "KV tiers", "When the copies run"): its copies go with a batch it is
not in, and it joins the next step's, reading its prefix from the device.

The echo runner (tests/helpers/scheduler.py) lands a step's loads only after that step's forward
unless the batch says it reads them (``KVTransfers.load_sync``), as on CUDA where they run beside
it: a batch that reads a page its own step loads without waiting reads it wrong and fails there.
"""

from __future__ import annotations

import time

import pytest

from radixserve.common import telemetry
from radixserve.scheduler.batch import ForwardMode, ScheduleBatch
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.memory.host_pool import KVLoad
from radixserve.scheduler.metrics import SchedulerMetrics
from radixserve.scheduler.tracing import SchedulerTracer
from tests.helpers.host_tier import PREFIX as HOST_PREFIX
from tests.helpers.host_tier import engine_turns
from tests.helpers.scheduler import (
    KVEchoRunner,
    make_req,
    reference_output,
    run_to_completion,
    runner_for,
    sched,
)

PAGE = 4
PREFIX = [1000 + i for i in range(48)]  # 12 pages, the prefix that goes to the host and comes back


def _with_prefix_on_the_host() -> tuple[BatchScheduler, KVEchoRunner]:
    """A scheduler whose tree holds ``PREFIX`` on the host tier only."""
    s = sched(total=256, page=PAGE, host=1024, min_new_token_ratio=0.0, init_new_token_ratio=0.5)
    s.add(make_req("first", [*PREFIX, 1], max_new=4))
    run_to_completion(s)
    s.kv.cache.evict(s.kv.capacity)  # every device page to the host (the write-backs are queued)
    m = s.kv.cache.match_prefix(PREFIX)
    assert len(m.slots) == 0 and m.host_len == len(PREFIX)
    return s, runner_for(s)


def _step(s: BatchScheduler, runner: KVEchoRunner) -> tuple[ScheduleBatch, list]:
    batch = s.schedule()
    assert batch is not None
    s.kv.check(s.live_requests())
    done = s.process(batch, runner.forward(batch))
    s.kv.check(s.live_requests())
    return batch, done


def _rids(batch: ScheduleBatch) -> list[str]:
    return [r.rid for r in batch.reqs]


def _loads(batch: ScheduleBatch) -> int:
    t = batch.kv_transfers
    return 0 if t is None else len(t.load_src)


def test_a_request_waits_a_step_for_its_load_while_another_runs_and_its_outputs_are_right():
    s, runner = _with_prefix_on_the_host()
    hit = make_req("hit", [*PREFIX, 7, 8], max_new=6, t=1.0)
    other = make_req("other", list(range(300, 320)), max_new=6, t=2.0)
    s.add(hit)
    s.add(other)

    first, _ = _step(s, runner)
    # the step that queues its load runs the other request, not it; its forward need not wait
    assert first.mode is ForwardMode.EXTEND and _rids(first) == ["other"]
    assert _loads(first) == len(PREFIX) and first.kv_transfers is not None
    assert len(first.kv_transfers.load_sync) == 0
    assert first.kv_loads_for == [(hit, len(PREFIX))]
    assert hit in s.waiting and hit.req_pool_idx is None

    second, _ = _step(s, runner)
    # the next step admits it on the loaded prefix, with nothing left to load
    assert _rids(second) == ["hit"] and int(second.prefix_lens[0]) == len(PREFIX)
    assert _loads(second) == 0 and second.kv_loads_for == []
    assert hit.num_cached_tokens == len(PREFIX) and hit.loaded_len == len(PREFIX)
    assert s.kv.hit_tokens["host"] == len(PREFIX)

    done = run_to_completion(s)  # checks every request's KV at every step
    for r in [*done, hit, other]:
        assert r.output_ids == reference_output(r.origin_ids.tolist(), 6), r.rid
    assert runner.loaded == len(PREFIX)


def test_a_request_waits_while_running_requests_decode_beside_its_load():
    s, runner = _with_prefix_on_the_host()
    running = make_req("running", list(range(300, 320)), max_new=8, t=1.0)
    s.add(running)
    _step(s, runner)  # its prefill
    hit = make_req("hit", [*PREFIX, 7], max_new=4, t=2.0)
    s.add(hit)

    first, _ = _step(s, runner)
    assert first.mode is ForwardMode.DECODE and _rids(first) == ["running"]
    assert _loads(first) == len(PREFIX) and first.kv_loads_for == [(hit, len(PREFIX))]
    second, _ = _step(s, runner)
    assert second.mode is ForwardMode.EXTEND and _rids(second) == ["hit"]
    for r in [running, hit, *run_to_completion(s)]:
        assert r.output_ids == reference_output(r.origin_ids.tolist(), r.sampling.max_new_tokens), r.rid


def test_a_request_on_a_prefix_another_is_loading_waits_with_it_and_both_read_it_next_step():
    s, runner = _with_prefix_on_the_host()
    s.add(make_req("other", list(range(300, 320)), max_new=6, t=1.0))
    a = make_req("a", [*PREFIX, 7], max_new=4, t=2.0)
    b = make_req("b", [*PREFIX, 9, 9], max_new=4, t=3.0)
    s.add(a)
    s.add(b)
    first, _ = _step(s, runner)
    assert _rids(first) == ["other"] and _loads(first) == len(PREFIX)  # loaded once, for the first
    assert [(r.rid, n) for r, n in first.kv_loads_for] == [("a", len(PREFIX))]
    second, _ = _step(s, runner)
    assert sorted(_rids(second)) == ["a", "b"] and second.prefix_lens.tolist() == [len(PREFIX)] * 2
    run_to_completion(s)
    assert a.loaded_len == len(PREFIX) and b.loaded_len == 0  # the host's hits are a's, the device's b's
    assert s.kv.hit_tokens["host"] == len(PREFIX)


def test_with_nothing_else_to_run_it_is_admitted_at_once_and_its_forward_waits_for_the_load():
    s, runner = _with_prefix_on_the_host()
    hit = make_req("hit", [*PREFIX, 7, 8], max_new=6, t=1.0)
    s.add(hit)
    batch, _ = _step(s, runner)
    # waiting would idle the device: it runs in the step that loads its prefix, which waits for it
    assert _rids(batch) == ["hit"] and int(batch.prefix_lens[0]) == len(PREFIX)
    assert batch.kv_transfers is not None and len(batch.kv_transfers.load_sync) == 1
    assert batch.kv_loads_for == [(hit, len(PREFIX))]
    run_to_completion(s)
    assert hit.output_ids == reference_output(hit.origin_ids.tolist(), 6)
    assert hit.loaded_len == len(PREFIX) and s.kv.hit_tokens["host"] == len(PREFIX)


def _timed_load(batch: ScheduleBatch, seconds: float | None) -> KVLoad | None:
    """What the model runner makes of a step's loads (ModelRunner.prepare, HostKVPool.run): its
    KVLoad, timed (``seconds`` None: not known yet, as on CUDA while the copies still run)."""
    t = batch.kv_transfers
    if t is None or not len(t.load_src):
        return None
    batch.kv_load = KVLoad(len(t.load_src), len(t.load_src) * 64)
    if seconds is not None:
        batch.kv_load.timed(time.perf_counter(), seconds)
    return batch.kv_load


def test_the_load_a_request_waited_for_is_traced_and_timed_from_the_step_that_ran_it(monkeypatch):
    spans: list[tuple[str, float, float, dict]] = []
    monkeypatch.setattr(
        telemetry, "span_between", lambda name, parent, s, e, attrs: spans.append((name, s, e, attrs))
    )
    tracer, metrics = SchedulerTracer("pod", "lpm"), SchedulerMetrics("m")
    s, runner = _with_prefix_on_the_host()
    hit = make_req("hit", [*PREFIX, 7, 8], max_new=3, t=1.0)
    tracer.track("hit", {})
    s.add(hit)
    s.add(make_req("other", list(range(300, 320)), max_new=3, t=2.0))
    steps = []
    while not s.idle:
        batch = s.schedule()
        assert batch is not None
        first = not steps
        load = _timed_load(batch, None if first else 0.01)  # the first step's time is known later
        t0 = time.perf_counter()
        done = s.process(batch, runner.forward(batch))
        t1 = time.perf_counter()
        steps.append(batch)
        metrics.on_batch(batch, t0, t1)
        tracer.on_batch(batch, t0, t1)
        if first:  # its copies ran beside this step's forward; the next step's waits for them
            assert load is not None and hit not in batch.reqs
            assert _count(metrics, "radixserve_kv_load_seconds_count") == 0
            load.timed(t0, seconds := (t1 - t0) / 2)
        for r in done:
            tracer.finish(r, "length")
    tracer.close()
    assert _count(metrics, "radixserve_kv_load_seconds_count") == 1
    assert _count(metrics, "radixserve_kv_load_seconds_sum") == pytest.approx(seconds)
    loads = [sp for sp in spans if sp[0] == "kv.load_back"]
    prefills = sorted(sp[1] for sp in spans if sp[0] == "prefill")
    assert len(loads) == 1 and loads[0][3]["radixserve.kv.tokens"] == len(PREFIX)
    assert loads[0][3]["radixserve.kv.bytes"] == len(PREFIX) * 64
    # it lies in the step before its first prefill, the step that ran the other request
    assert loads[0][2] - loads[0][1] == pytest.approx(seconds)
    assert loads[0][2] <= prefills[0] and hit in steps[1].reqs


def _count(metrics: SchedulerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", "from_tier": "host"})
    return value or 0.0


@pytest.mark.parametrize("tp_size", [1, pytest.param(2, marks=pytest.mark.slow)])  # tp 2: rank processes
def test_engine_greedy_tokens_are_the_same_when_requests_wait_for_their_loads(demo_model, tp_size):
    # CPU engines admit at once (the copies cannot run beside the forward there): this one waits, as
    # on CUDA, with the overlap loop, chunked prefill and retraction (tests/helpers/host_tier.py);
    # tp 2: rank 0 plans the copies and whether a step waits for its loads, every rank runs them
    path = demo_model("llama")
    off, _ = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True)
    options = dict(host_kv_cache_gb=0.01, disable_overlap=False, tp_size=tp_size)
    on, s = engine_turns(path, defer_host_loads=True, **options)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    assert s.kv.cache.loaded_tokens >= 3 * HOST_PREFIX and s.kv.hit_tokens["host"] >= 3 * HOST_PREFIX
