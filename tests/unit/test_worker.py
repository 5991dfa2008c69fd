"""The EngineWorker on its own (no gRPC, no servicer): typed messages in, TokenUpdates out.

It is the seam the servicer (and later tensor parallelism's rank 0) drives, so it must stand alone:
the tokens it emits are the offline Engine's, refusals are typed, an abort ends a request with one
final update, and the KV pool is whole again afterwards.
"""

from __future__ import annotations

import threading
import time

import pytest

from radixserve import Engine, SamplingParams
from radixserve.scheduler.metrics import SchedulerMetrics
from radixserve.scheduler.worker import AlreadyHere, EngineWorker, ShuttingDown, Submit, TokenUpdate


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("llama")


class Collected:
    """What the worker emitted, by request; ``on_taken`` runs as the servicer's sender would."""

    def __init__(self) -> None:
        self.updates: dict[str, list[TokenUpdate]] = {}
        self.cond = threading.Condition()

    def emit(self, updates: list[TokenUpdate], on_taken) -> None:
        with self.cond:
            for u in updates:
                self.updates.setdefault(u.rid, []).append(u)
            self.cond.notify_all()
        if on_taken is not None:
            on_taken()

    def final(self, rid: str, timeout: float = 30) -> TokenUpdate:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not any(u.finish_reason for u in self.updates.get(rid, [])):
                assert self.cond.wait(deadline - time.monotonic()), f"{rid} never ended"
        return self.updates[rid][-1]

    def tokens(self, rid: str) -> list[int]:
        return [t for u in self.updates[rid] for t in u.token_ids]


@pytest.fixture
def worker(model_dir):
    engine = Engine(model_dir, max_total_tokens=2048, max_running_requests=8)
    out = Collected()
    w = EngineWorker(engine, "test:0", out.emit, SchedulerMetrics())
    w.start()
    yield w, out, engine
    w.close()


def submit(w: EngineWorker, rid: str, ids: list[int], **sampling) -> None:
    sp = SamplingParams(**{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling})
    w.submit(Submit(rid=rid, input_ids=ids, sampling=sp, reply_to="gw:1"))


def test_the_worker_emits_the_engines_tokens_and_leaves_the_pool_whole(worker, model_dir):
    w, out, engine = worker
    prompts = {f"r{i}": [5 + i, 17, 23, 42, 7 * i + 3, 11] for i in range(4)}
    for rid, ids in prompts.items():
        submit(w, rid, ids)
    for rid in prompts:
        assert out.final(rid).finish_reason == "length"
    first = [u for u in out.updates["r0"] if u.options is not None]
    assert len(first) == 1 and first[0] is out.updates["r0"][0] and first[0].options.prompt_tokens == 6
    assert all(u.reply_to == "gw:1" for us in out.updates.values() for u in us)
    with Engine(model_dir, max_total_tokens=2048) as ref:
        sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        expected = ref.generate(input_ids=list(prompts.values()), sampling_params=sp)
    assert [out.tokens(rid) for rid in prompts] == [e["token_ids"] for e in expected]
    assert w.holds(list(prompts)) == []  # ended and handed to the sender
    kv = engine.scheduler.kv
    assert kv.available() == kv.capacity


def test_refusals_are_typed(worker):
    w, _, engine = worker
    with pytest.raises(ValueError, match="input_ids"):
        submit(w, "bad", [engine.model_config.vocab_size])
    with pytest.raises(ValueError, match="rid"):
        submit(w, "", [1, 2, 3])
    submit(w, "dup", [1, 2, 3], max_new_tokens=64)
    with pytest.raises(AlreadyHere):
        submit(w, "dup", [1, 2, 3])
    w.draining = True
    with pytest.raises(ShuttingDown):
        submit(w, "late", [1, 2, 3])


def test_an_abort_ends_the_request_once_with_its_reason(worker):
    w, out, engine = worker
    submit(w, "long", [3, 4, 5, 6], max_new_tokens=1000)
    assert w.holds(["long", "other"]) == ["long"]
    assert w.abort(["long", "other"], "client disconnected") == 1
    final = out.final("long")
    assert (final.finish_reason, final.error) == ("abort", "client disconnected")
    assert sum(bool(u.finish_reason) for u in out.updates["long"]) == 1
    assert w.load().waiting == 0 and w.load().running == 0
    kv = engine.scheduler.kv
    assert kv.available() == kv.capacity
