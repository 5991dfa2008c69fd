"""The offline Engine.generate takes any number of prompts, as vLLM's LLM.generate does: more than its
waiting queue holds are fed to it as room frees, in order, with a progress bar when asked."""

from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams
from radixserve.scheduler.event_loop import Step


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("llama")


def test_more_prompts_than_the_waiting_queue_all_come_back_in_order(model_dir, capsys):
    prompts = [f"def f{i}(x):" for i in range(40)]
    sp = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    with Engine(model_dir, max_total_tokens=2048, max_waiting_requests=4, max_running_requests=4) as engine:
        steps: list[Step] = []
        outs = engine.generate(prompt=prompts, sampling_params=sp, progress=True, on_step=steps.append)
        alone = [engine.generate(prompt=p, sampling_params=sp)["token_ids"] for p in prompts[:3]]
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
    assert [len(o["token_ids"]) for o in outs] == [3] * 40
    assert [o["token_ids"] for o in outs[:3]] == alone  # in order: each output is its own prompt's
    assert sum(len(s.finished) for s in steps) == 40
    assert "generate" in capsys.readouterr().err  # the progress bar
