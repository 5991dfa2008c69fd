"""The offline Engine on real (tiny, random-weight) models: HF transformers is the reference."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine, SamplingParams
from radixserve.common.demo_moe import MOE_ARCHS
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.event_loop import Step
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention import TorchAttention
from radixserve.scheduler.model.attention import cpu as cpu_attention
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.loader import load_model
from tests.helpers.hf import NEW, PROMPTS, hf_greedy


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", *MOE_ARCHS])
def model_dir(request, demo_model):
    return demo_model(request.param)


@pytest.fixture(scope="module")
def llama_dir(demo_model):
    return demo_model("llama")


NO_KERNEL = cpu_attention.unavailable_reason(torch.device("cpu"), torch.float32)
BACKENDS = [
    pytest.param(TorchAttention, id="torch"),
    pytest.param(
        cpu_attention.CpuAttention,
        id="cpu",
        marks=pytest.mark.skipif(NO_KERNEL is not None, reason=f"no decode kernel: {NO_KERNEL}"),
    ),
]


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_logits_match_hf_for_prefill_cached_extend_and_decode(model_dir, backend_cls):
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    cfg = ModelConfig.from_pretrained(model_dir)
    model = load_model(model_dir, cfg, "cpu")
    pool = KVPool(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, "cpu")
    table = ReqToTokenPool(2, 128)
    backend = backend_cls(pool, table, cfg.num_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]

    def run(start, n, mode):
        slots = np.arange(start, start + n) * 3 + 5  # scattered slots: attention must follow the table
        table.host[1, start : start + n] = slots
        fb = ForwardBatch(
            mode,
            ids[start : start + n],
            torch.arange(start, start + n),
            torch.from_numpy(slots),
            np.array([start]),
            np.array([n]),
            None,
            None,
            all_logits=True,
        )
        backend.prepare(fb, np.array([1]))
        return model(fb.input_ids, fb.positions, fb, backend).logits

    ours = torch.cat(
        [run(0, 25, ForwardMode.EXTEND), run(25, 11, ForwardMode.EXTEND)]
        + [run(i, 1, ForwardMode.DECODE) for i in range(36, 40)]
    )
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_matches_hf_generate(model_dir):
    ref = hf_greedy(model_dir, PROMPTS)
    with Engine(model_dir, max_total_tokens=2048) as engine:
        outs = engine.generate(
            prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
    assert [o["token_ids"] for o in outs] == ref


@pytest.fixture(scope="module")
def llama_ref(llama_dir):
    return hf_greedy(llama_dir, PROMPTS)


COMBOS = list(itertools.product([False, True], [False, True], [0, 16], [1, 16]))


@pytest.mark.parametrize(
    ("overlap", "radix", "chunk", "page"),
    COMBOS,
    ids=[f"overlap{o:d}-radix{r:d}-chunk{c}-page{p}" for o, r, c, p in COMBOS],
)
def test_greedy_equals_hf_with_every_engine_feature(llama_dir, llama_ref, overlap, radix, chunk, page):
    with Engine(
        llama_dir,
        max_total_tokens=2048,
        page_size=page,
        chunked_prefill_size=chunk,
        disable_overlap=not overlap,
        cpu_overlap_thread_min_ms=0,  # overlap: every forward on the worker thread
        disable_radix_cache=not radix,
        max_running_requests=8,
    ) as engine:
        # twice: the second round hits what the first cached
        for _ in range(2):
            outs = engine.generate(
                prompt=PROMPTS,
                sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True),
            )
            assert [o["token_ids"] for o in outs] == llama_ref
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        assert (cached > 0) == radix
        kv = engine.scheduler.kv
        assert kv.available() == kv.capacity  # nothing leaked


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page", [1, 16])
def test_greedy_equals_hf_under_decode_retraction(llama_dir, llama_ref, overlap, page):
    with Engine(
        llama_dir,
        max_total_tokens=96,
        init_new_token_ratio=0.0,
        page_size=page,
        chunked_prefill_size=0,  # no chunking
        disable_overlap=not overlap,
        cpu_overlap_thread_min_ms=0,  # overlap: every forward on the worker thread
        max_running_requests=8,
    ) as engine:
        outs = engine.generate(
            prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
        assert engine.scheduler.num_retractions > 0
        assert [o["token_ids"] for o in outs] == llama_ref
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


@pytest.mark.skipif(NO_KERNEL is not None, reason=f"no decode kernel: {NO_KERNEL}")
@pytest.mark.parametrize(("overlap", "page", "pool"), [(False, 1, 2048), (True, 16, 2048), (False, 16, 96)])
def test_greedy_equals_hf_with_the_cpu_attention_backend(llama_dir, llama_ref, overlap, page, pool):
    with Engine(
        llama_dir,
        attention_backend="cpu",
        max_total_tokens=pool,
        init_new_token_ratio=0.0 if pool < 128 else 0.7,
        page_size=page,
        chunked_prefill_size=16,
        disable_overlap=not overlap,
        cpu_overlap_thread_min_ms=0,  # overlap: every forward on the worker thread
        max_running_requests=8,
    ) as engine:
        assert engine.runner.backend.name == "cpu"
        for _ in range(2):
            outs = engine.generate(
                prompt=PROMPTS,
                sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True),
            )
            assert [o["token_ids"] for o in outs] == llama_ref
        assert (engine.scheduler.num_retractions > 0) == (pool < 128)
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


def test_outputs_and_meta_info(llama_dir):
    with Engine(llama_dir, max_total_tokens=2048) as engine:
        one = engine.generate(
            prompt=PROMPTS[0], sampling_params=SamplingParams(max_new_tokens=5, ignore_eos=True)
        )
        assert one["finish_reason"] == "length" and len(one["token_ids"]) == 5
        assert one["meta_info"]["completion_tokens"] == 5
        assert one["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(PROMPTS[0]))
        assert one["text"] == engine.tokenizer.decode(one["token_ids"], skip_special_tokens=True)
        by_ids = engine.generate(
            input_ids=engine.tokenizer.encode(PROMPTS[0]),
            sampling_params=SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0),
        )
        assert by_ids["meta_info"]["cached_tokens"] > 0  # the same prompt again


def test_chunked_prefill_size_defaults_by_device_and_zero_turns_chunking_off(llama_dir):
    long_prompt = list(range(10, 10 + 600))  # more than one CPU chunk
    sp = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    for requested, chunk in ((None, 256), (0, None), (100, 100)):
        with Engine(llama_dir, max_total_tokens=2048, chunked_prefill_size=requested) as engine:
            assert engine.scheduler.config.chunked_prefill_size == chunk
            steps: list[int] = []
            forward = engine.runner.forward

            def counted(fb, forward=forward, steps=steps):
                steps.append(int(fb.extend_lens.sum()))
                return forward(fb)

            engine.runner.forward = counted
            engine.generate(input_ids=long_prompt, sampling_params=sp)
            assert max(steps) == (chunk or 600)  # the prompt's tokens per prefill step


def test_seeded_sampling_is_reproducible_and_batch_independent(llama_dir):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    with Engine(llama_dir, max_total_tokens=2048) as engine:
        alone = engine.generate(prompt=PROMPTS[2], sampling_params=sp)["token_ids"]
        batched = engine.generate(prompt=PROMPTS, sampling_params=sp)[2]["token_ids"]
        other = engine.generate(
            prompt=PROMPTS[2],
            sampling_params=SamplingParams(
                max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
            ),
        )["token_ids"]
    assert alone == batched
    assert alone != other


def test_stop_token_ids_and_stop_strings(llama_dir, llama_ref):
    first = llama_ref[0]
    with Engine(llama_dir, max_total_tokens=2048) as engine:
        out = engine.generate(
            prompt=PROMPTS[0],
            sampling_params=SamplingParams(
                max_new_tokens=NEW, temperature=0, stop_token_ids=(first[3],), ignore_eos=True
            ),
        )
        assert out["finish_reason"] == "stop" and out["token_ids"] == first[: first.index(first[3]) + 1]
        full = engine.tokenizer.decode(first, skip_special_tokens=True)
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop.strip(), "the reference text must offer a visible stop string"
        out = engine.generate(
            prompt=PROMPTS[0],
            sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, stop=(stop,), ignore_eos=True),
        )
        assert out["finish_reason"] == "stop" and stop not in out["text"]
        assert full.startswith(out["text"])


def test_bad_input_is_rejected_and_the_engine_keeps_serving(llama_dir):
    with Engine(llama_dir, max_total_tokens=512, max_context_len=256) as engine:
        with pytest.raises(TypeError, match="unknown engine argument"):
            Engine(llama_dir, no_such_flag=1)
        with pytest.raises(ValueError, match="input_ids"):
            engine.generate(input_ids=[1, 2, 10**9])
        with pytest.raises(ValueError, match="context length"):
            engine.generate(input_ids=[1] * 250, sampling_params=SamplingParams(max_new_tokens=10))
        with pytest.raises(ValueError, match="positive"):
            engine.generate(prompt="hi", sampling_params=SamplingParams(max_new_tokens=-3))
        with pytest.raises(ValueError, match="exactly one"):
            engine.generate()
        ok = engine.generate(prompt="hi", sampling_params=SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(ok["token_ids"]) == 3
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_launches_each_batch_before_reading_the_previous_ones_tokens(llama_dir, llama_ref, overlap):
    with Engine(
        llama_dir, max_total_tokens=2048, disable_overlap=not overlap, cpu_overlap_thread_min_ms=0
    ) as engine:
        fed_placeholders = []
        prepare = engine.runner.prepare

        def spy(batch):
            fed_placeholders.append(bool((batch.input_ids < 0).any()))
            return prepare(batch)

        engine.runner.prepare = spy
        outs = engine.generate(
            prompt=PROMPTS, sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
        )
    assert [o["token_ids"] for o in outs] == llama_ref
    # With overlap, decode batches feed tokens the previous batch has not returned yet (FutureMap
    # placeholders, resolved on the device); without it, every input is known on the host.
    assert any(fed_placeholders) == overlap


@pytest.mark.slow  # hundreds of requests through the normal loop: about 10 s each
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomised_load_loses_nothing_and_returns_the_pool_full(llama_dir, overlap, seed):
    """Mixed sampling, stop strings and stop ids, shared prefixes and a pool small enough to
    retract: every request ends with a reason, within its limits, and nothing leaks."""
    rng = np.random.default_rng(seed)
    with Engine(
        llama_dir,
        max_total_tokens=256,
        page_size=4,
        chunked_prefill_size=16,
        max_running_requests=6,
        disable_overlap=not overlap,
        cpu_overlap_thread_min_ms=0,  # overlap: every forward on the worker thread
        init_new_token_ratio=0.0,
        schedule_policy=["lpm", "fcfs", "dfs-weight"][seed % 3],
        fairness_timeout=0.05,
    ) as engine:
        vocab = engine.model_config.vocab_size
        shared = rng.integers(5, vocab, 40).tolist()
        for _ in range(3):
            n = int(rng.integers(4, 12))
            ids, params = [], []
            for _ in range(n):
                tail = rng.integers(5, vocab, int(rng.integers(1, 60))).tolist()
                ids.append(shared[: int(rng.integers(0, 41))] + tail)
                params.append(
                    SamplingParams(
                        max_new_tokens=int(rng.integers(1, 40)),
                        temperature=float(rng.choice([0.0, 0.7, 1.2])),
                        top_k=int(rng.choice([-1, 20])),
                        top_p=float(rng.choice([1.0, 0.9])),
                        seed=int(rng.integers(0, 100)) if rng.random() < 0.5 else None,
                        stop_token_ids=(int(rng.integers(5, vocab)),) if rng.random() < 0.3 else (),
                        stop=("e",) if rng.random() < 0.2 else (),
                        ignore_eos=bool(rng.random() < 0.5),
                    )
                )
            outs = engine.generate(input_ids=ids, sampling_params=params)
            assert len(outs) == n
            for out, sp in zip(outs, params, strict=True):
                assert out["finish_reason"] in ("stop", "length")
                assert 1 <= len(out["token_ids"]) <= sp.max_new_tokens
                if out["finish_reason"] == "length":
                    assert len(out["token_ids"]) == sp.max_new_tokens
                assert all(0 <= t < vocab for t in out["token_ids"])
            kv = engine.scheduler.kv
            assert engine.scheduler.idle and not engine.loop.in_flight
            kv.check([])
            assert kv.available() == kv.capacity


def _both_loops(path, ids, params, **kw):
    results = []
    for overlap in (False, True):
        with Engine(path, disable_overlap=not overlap, cpu_overlap_thread_min_ms=0, **kw) as engine:
            outs = engine.generate(input_ids=ids, sampling_params=params)
            assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
            results.append([(o["finish_reason"], o["token_ids"]) for o in outs])
    return results


def test_a_request_that_stops_in_flight_does_not_wedge_a_full_pool(llama_dir):
    # Regression: in overlap mode the stopped request keeps its KV until its batch is processed;
    # the lone other request could not grow and scheduling raised.
    rng = random.Random(1)
    a = [rng.randrange(5, 2000) for _ in range(10)]
    x = [rng.randrange(5, 2000) for _ in range(10)]
    sp = [
        SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, stop=("de",)),
    ]
    normal, overlap = _both_loops(
        llama_dir, [a, x], sp, max_total_tokens=26, max_running_requests=4, init_new_token_ratio=0.0
    )
    assert normal == overlap
    assert [r for r, _ in normal] == ["length", "stop"]


def test_retraction_that_takes_the_last_decode_candidate_builds_no_empty_batch(llama_dir):
    # Regression: overlap mode built a decode batch of size 0 after retracting the only candidate.
    sp = [
        SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True),
    ]
    normal, overlap = _both_loops(
        llama_dir,
        [list(range(100, 110)), list(range(200, 212))],
        sp,
        max_total_tokens=26,
        init_new_token_ratio=0.0,
    )
    assert normal == overlap
    assert [len(t) for _, t in normal] == [3, 14]


def test_a_rejected_generate_call_leaves_nothing_queued(llama_dir):
    with Engine(llama_dir, max_total_tokens=64) as engine:
        with pytest.raises(ValueError, match="KV capacity"):
            engine.generate(input_ids=[[5, 6, 7], [9] * 70], sampling_params=SamplingParams(max_new_tokens=8))
        assert engine.scheduler.idle
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=SamplingParams(max_new_tokens=2))
        assert engine.scheduler.idle and len(out["token_ids"]) <= 2


LOOP_MODES = {
    "thread": (0.0, (True, False)),
    "inline": (math.inf, (False, True)),
    "mixed": (0.0, (True, True)),
}


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_the_cpu_overlap_stream_keeps_launch_order_on_the_thread_inline_and_mixed(llama_dir, llama_ref, mode):
    """The CPU overlap loop runs a forward on its worker thread, or inline when forwards are short;
    any mix keeps the stream's order (batch N+1 reads batch N's tokens through the FutureMap)."""
    min_ms, (want_threaded, want_inline) = LOOP_MODES[mode]
    with Engine(
        llama_dir, max_total_tokens=2048, disable_overlap=False, cpu_overlap_thread_min_ms=min_ms
    ) as engine:
        stream = engine.loop.stream

        def flip(step: Step) -> None:  # mixed: an inline launch follows a threaded one in flight
            for _ in step.batches:
                stream.cpu_thread_min_s = math.inf if stream.cpu_thread_min_s == 0 else 0.0

        for _ in range(2):
            outs = engine.generate(
                prompt=PROMPTS,
                sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True),
                on_step=flip if mode == "mixed" else None,
            )
            assert [o["token_ids"] for o in outs] == llama_ref
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity
        assert (stream.threaded > 0, stream.inline > 0) == (want_threaded, want_inline)
        assert stream.forward_s > 0  # what the choice is made on
        assert (stream.inline_s > 0) == want_inline
        assert not engine.loop.in_flight


def test_with_short_cpu_forwards_the_overlap_loop_steps_exactly_as_the_normal_loop(llama_dir):
    """Overlapping nothing, it must not pay the overlap's lag either: batch N+1 scheduled before
    N's finished requests left would admit waiting requests one step late. Same batches, same steps."""
    lengths = [3, 9, 5, 12, 4, 7]

    def batches(**loop_args) -> tuple[list, int]:
        with Engine(llama_dir, max_total_tokens=2048, max_running_requests=2, **loop_args) as engine:
            seen: list = []

            def see(step: Step) -> None:
                seen.extend((b.batch.mode.name, b.batch.extend_lens.tolist()) for b in step.batches)

            sps = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
            engine.generate(prompt=PROMPTS, sampling_params=sps, on_step=see)
            return seen, engine.loop.stats.steps

    normal = batches(disable_overlap=True)
    inline = batches(disable_overlap=False, cpu_overlap_thread_min_ms=math.inf)
    assert inline == normal
    threaded = batches(disable_overlap=False, cpu_overlap_thread_min_ms=0)  # the real overlap differs
    assert threaded[0] != normal[0]


def test_overlap_is_the_default_on_cuda_only(llama_dir):
    with Engine(llama_dir, max_total_tokens=256, device="cpu") as engine:
        assert engine.loop.overlap is False  # no gain measured on CPU (one GIL for host and forward)
    with Engine(llama_dir, max_total_tokens=256, device="cpu", disable_overlap=False) as engine:
        assert engine.loop.overlap is True
