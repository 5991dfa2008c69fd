"""The decode path the CUDA graphs replay (model/graph_runner.py), run eagerly on CPU.

On a GPU a decode batch is padded to a bucket, copied into static buffers and replayed from a
captured graph; only the capture and the replay need CUDA. ``cpu_static_decode`` runs the same
padding, static buffers and scratch-slot attention eagerly, so these tests prove that path gives
exactly the tokens of the dynamic one: greedy against HF, seeded sampling against the dynamic path,
under retraction, with and without the overlap loop, with pages of 1 and 16 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.graph_runner import decode_buckets
from tests.helpers.hf import PROMPTS, hf_greedy

NEW = 12


@pytest.fixture(scope="module")
def qwen3_dir(demo_model):
    return demo_model("qwen3")


@pytest.fixture(scope="module")
def qwen3_ref(qwen3_dir):
    return hf_greedy(qwen3_dir, PROMPTS, NEW)


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(160)[-3:] == [144, 152, 160]
    assert decode_buckets(0) == []


def _engine(path, **kw):
    args = dict(max_total_tokens=2048, max_running_requests=8, cpu_overlap_thread_min_ms=0)
    args.update(kw)
    return Engine(path, **args)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page", [1, 16])
def test_padded_static_decode_equals_hf_greedy(qwen3_dir, qwen3_ref, overlap, page):
    # Graph buckets 1, 2, 4: six requests decode eagerly, then padded (3 -> 4) as they finish at
    # different lengths, then unpadded at 4, 2 and 1.
    greedy = [SamplingParams(max_new_tokens=NEW - i, temperature=0, ignore_eos=True) for i in range(6)]
    with _engine(
        qwen3_dir, page_size=page, disable_overlap=not overlap, cpu_static_decode=True, cuda_graph_max_bs=4
    ) as engine:
        graphs = engine.runner.graphs
        assert graphs.enabled and not graphs.capture_graphs and graphs.buckets == [1, 2, 4]
        for _ in range(2):  # the second round hits the prefix cache
            outs = engine.generate(prompt=PROMPTS, sampling_params=greedy)
            assert [o["token_ids"] for o in outs] == [ref[: NEW - i] for i, ref in enumerate(qwen3_ref)]
        assert graphs.eager_static > 0 and graphs.padded > 0  # both the padded and the plain case ran
        kv = engine.scheduler.kv
        assert kv.available() == kv.capacity


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_static_decode_under_retraction(qwen3_dir, qwen3_ref, overlap):
    with _engine(
        qwen3_dir,
        max_total_tokens=96,
        init_new_token_ratio=0.0,
        chunked_prefill_size=0,
        disable_overlap=not overlap,
        cpu_static_decode=True,
        cuda_graph_max_bs=8,
    ) as engine:
        outs = engine.generate(
            prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
        assert engine.scheduler.num_retractions > 0
        assert [o["token_ids"] for o in outs] == qwen3_ref
        assert engine.runner.graphs.padded > 0
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


def test_seeded_and_mixed_sampling_give_the_dynamic_paths_tokens(qwen3_dir):
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=11 + i, ignore_eos=True)
        if i % 2
        else SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    results = []
    for static in (False, True):
        with _engine(qwen3_dir, cpu_static_decode=static, cuda_graph_max_bs=4, page_size=4) as engine:
            outs = engine.generate(prompt=PROMPTS, sampling_params=params)
            results.append([o["token_ids"] for o in outs])
            assert engine.runner.graphs.enabled == static
    assert results[0] == results[1]


def test_every_array_of_a_step_goes_to_the_device_in_one_copy(qwen3_dir, monkeypatch):
    from radixserve.scheduler.model import sampler, staging

    copies = []  # every host->device copy either path makes, whoever calls it

    def counting(host, device, real=staging.to_device):
        copies.append(host.numel())
        return real(host, device)

    monkeypatch.setattr(staging, "to_device", counting)
    monkeypatch.setattr(sampler, "to_device", counting)
    with _engine(qwen3_dir, cpu_static_decode=True, cuda_graph_max_bs=4) as engine:
        before, steps = engine.runner.staging.copies, engine.loop.stats.steps
        copies.clear()
        greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        engine.generate(prompt=PROMPTS, sampling_params=greedy)
        n = engine.loop.stats.steps - steps
        assert engine.runner.staging.copies - before == n > 0
        assert len(copies) == n  # one per step; a greedy batch's sampling needs none
        copies.clear()
        steps = engine.loop.stats.steps
        engine.generate(prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(copies) == 3 * (engine.loop.stats.steps - steps)  # + floats and ints for sampling


def test_page_indices_from_the_device_mirror_match_the_table():
    table = ReqToTokenPool(4, 64)
    rng = np.random.default_rng(0)
    ps = 4
    pages = rng.permutation(np.arange(1, 40))
    lens = {0: 13, 2: 4, 3: 29}
    used = 0
    for row, n in lens.items():
        own = pages[used : used + -(-n // ps)]
        used += len(own)
        table.write(row, 0, (np.repeat(own, ps) * ps + np.tile(np.arange(ps), len(own)))[:n])
    rows = np.array([3, 0, table.scratch_row, 2])
    seq = np.array([29, 13, 1, 4])
    num_pages = -(-seq // ps)
    indptr = np.concatenate([[0], np.cumsum(num_pages)])
    got = table.page_indices(torch.from_numpy(rows), torch.from_numpy(indptr), int(indptr[-1]), ps)
    want = np.concatenate([table.host[r, :s:ps] // ps for r, s in zip(rows, seq, strict=True)])
    assert got.tolist() == want.tolist()
    assert want[int(indptr[2])] == 0  # the scratch row names the scratch page


def test_the_device_mirror_follows_every_write_incrementally():
    table = ReqToTokenPool(3, 16)
    table.attach_device(torch.device("cpu"))
    assert table.take_pending() is None  # on CPU the mirror is the host array itself
    assert table.device_table.data_ptr() == table.host.__array_interface__["data"][0]

    # A separate mirror (what attach_device makes on CUDA), exercised on CPU tensors.
    table._log = []
    table.device_table = torch.from_numpy(table.host.copy())
    table.write(0, 0, np.arange(10, 15))
    table.write_tokens(np.array([0, 1]), np.array([5, 0]), np.array([99, 7]))
    table.write(0, 5, np.array([42]))  # a cell written twice: the latest value wins
    packed = table.take_pending()
    assert packed is not None and table.take_pending() is None
    table.apply_pending(torch.from_numpy(packed))
    assert np.array_equal(table.device_table.numpy(), table.host)
    assert table.host[0, 5] == 42
