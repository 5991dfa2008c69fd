"""A request continued from output a client already has (the gateway's failover, issue 44) yields what
the undisturbed request would have: greedy and seeded draws, penalties over the whole output, a JSON
constraint replayed over the delivered tokens, the token budget; logprobs come for new tokens only.
The EngineWorker on its own, in-process."""

from __future__ import annotations

import json
import threading
import time

import pytest

from radixserve import Engine, SamplingParams
from radixserve.common.sampling import Constraint
from radixserve.scheduler.continuation import Continuation
from radixserve.scheduler.metrics import SchedulerMetrics
from radixserve.scheduler.worker import EngineWorker, Submit, TokenUpdate

PROMPT = [5, 17, 23, 42, 9, 11, 64, 3]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}


class Collected:
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

    def run(
        self, w: EngineWorker, rid: str, sp: SamplingParams, cont: Continuation | None = None
    ) -> list[TokenUpdate]:
        w.submit(Submit(rid=rid, input_ids=PROMPT, sampling=sp, reply_to="gw:1", continuation=cont))
        deadline = time.monotonic() + 60
        with self.cond:
            while not any(u.finish_reason for u in self.updates.get(rid, [])):
                assert self.cond.wait(deadline - time.monotonic()), f"{rid} never ended"
        return self.updates[rid]


@pytest.fixture(scope="module")
def worker(demo_model):
    engine = Engine(demo_model("qwen2"), max_total_tokens=4096, max_running_requests=8)
    out = Collected()
    w = EngineWorker(engine, "test:0", out.emit, SchedulerMetrics())
    w.start()
    yield w, out
    w.close()


CASES = {
    "greedy": SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    "penalties": SamplingParams(
        max_new_tokens=24, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True
    ),
    "json_schema": SamplingParams(
        max_new_tokens=60, temperature=1.0, seed=3, constraint=Constraint("json_schema", json.dumps(SCHEMA))
    ),
    "logprobs": SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_continuation_yields_the_undisturbed_requests_tokens(worker, case):
    w, out = worker
    sp = CASES[case]
    whole = out.run(w, f"{case}-whole", sp)
    tokens = [t for u in whole for t in u.token_ids]
    k = min(9, len(tokens) - 1)
    moved = out.run(w, f"{case}-moved", sp, Continuation(tuple(tokens[:k]), text_chars=0))
    new = [t for u in moved for t in u.token_ids]
    assert tokens[:k] + new == tokens  # the same tokens, the budget over the whole output
    assert moved[-1].finish_reason == whole[-1].finish_reason
    first = moved[0]
    assert first.options is not None and first.options.prompt_tokens == len(PROMPT)
    assert first.options.continuation == Continuation(tuple(tokens[:k]), 0)
    if sp.logprobs is not None:  # for the new tokens only, the same as the undisturbed run's
        got = [lp for u in moved for lp in (u.logprobs or [])]
        want = [lp for u in whole for lp in (u.logprobs or [])][k:]
        assert len(got) == len(new) and [g[1] for g in got] == [x[1] for x in want]
        assert [g[0] for g in got] == pytest.approx([x[0] for x in want], abs=1e-3)


def test_a_continuation_that_breaks_its_constraint_or_budget_is_refused(worker):
    w, _ = worker
    sp = CASES["json_schema"]
    with pytest.raises(ValueError, match="constraint"):
        w.submit(Submit("bad-json", PROMPT, sp, "gw:1", continuation=Continuation((5, 5, 5), 0)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        w.submit(Submit("spent", PROMPT, CASES["greedy"], "gw:1", continuation=Continuation((5,) * 24, 0)))
