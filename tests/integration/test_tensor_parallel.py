"""Tensor parallelism on CPU (gloo): the sharded model computes what the whole one does.

Real processes: ``Engine(tp_size=2)`` starts a follower process and both join a gloo group; the
logits test runs two ranks of the model by hand. HF transformers is the reference throughout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine, SamplingParams
from radixserve.common.demo_model import model_config, save_random_model
from radixserve.common.demo_moe import MOE_ARCHS
from radixserve.common.sampling import Constraint
from radixserve.launcher import free_port
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.parallel import ShardLayout, tp_problem
from radixserve.scheduler.tensor_parallel import weight_bytes
from tests.helpers.fp8_models import expected_bytes, source_model, write_fp8
from tests.helpers.hf import NEW, PROMPTS, hf_greedy, one_thread
from tests.helpers.host_tier import PREFIX, engine_turns

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, demo_model):
    return demo_model(request.param)


@pytest.fixture(scope="module")
def hf_ref(model_dir):
    return hf_greedy(model_dir, PROMPTS)


# ----------------------------------------------------------------------------- layout
def _cfg(heads: int, kv: int, inter: int = 128, vocab: int = 1000) -> ModelConfig:
    return ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=64, intermediate_size=inter, num_layers=2,
        num_heads=heads, num_kv_heads=kv, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
        mlp_bias=False, qk_norm=False, dtype=torch.float32, eos_token_ids=(),
    )  # fmt: skip


def test_tp_problem_names_what_does_not_divide():
    assert tp_problem(_cfg(28, 4, inter=18944), 4) is None
    assert "28 attention heads" in (tp_problem(_cfg(28, 4), 8) or "")
    assert "3 KV heads" in (tp_problem(_cfg(12, 3), 2) or "")
    assert "MLP size 130" in (tp_problem(_cfg(8, 8, inter=130), 4) or "")
    assert tp_problem(_cfg(8, 2), 4) is None  # fewer KV heads than ranks: replicated


def test_layout_splits_heads_replicates_kv_heads_and_pads_the_vocabulary():
    cfg = _cfg(8, 2, inter=128, vocab=1001)
    layouts = [ShardLayout.of(cfg, r, 4) for r in range(4)]
    assert [(x.q_head_start, x.q_heads) for x in layouts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # query heads 0-3 use KV head 0 (groups of 4), 4-7 KV head 1: ranks 0-1 keep head 0, 2-3 head 1
    assert [(x.kv_head_start, x.kv_heads) for x in layouts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [x.intermediate_start for x in layouts] == [0, 32, 64, 96]
    assert {x.vocab_rows for x in layouts} == {251}
    assert [x.vocab_end(cfg) for x in layouts] == [251, 502, 753, 1001]
    assert sum(x.vocab_end(cfg) - x.vocab_start for x in layouts) == 1001
    with pytest.raises(ValueError, match="28 attention heads"):
        ShardLayout.of(_cfg(28, 4), 0, 8)


# --------------------------------------------------------------------- the engine, tp=2
def test_tp2_greedy_equals_tp1_and_hf_with_chunking_radix_cache_and_overlap(model_dir, hf_ref):
    args = dict(
        max_total_tokens=2048, page_size=16, chunked_prefill_size=16, disable_overlap=False,
        cpu_overlap_thread_min_ms=0, max_running_requests=8, device="cpu",
    )  # fmt: skip
    with Engine(model_dir, **args) as one:
        ref1 = [o["token_ids"] for o in one.generate(prompt=PROMPTS, sampling_params=GREEDY)]
        whole = one.placement["weight_bytes_per_rank"][0]
    assert ref1 == hf_ref
    with Engine(model_dir, tp_size=2, **args) as engine:
        for _ in range(2):  # the second round hits the prefixes the first cached
            outs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
            assert [o["token_ids"] for o in outs] == hf_ref
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        kv = engine.scheduler.kv
        assert kv.available() == kv.capacity
        per_rank = engine.placement["weight_bytes_per_rank"]
    assert len(per_rank) == 2
    for b in per_rank:  # each rank holds about half (the norms are whole on both)
        assert 0.49 < b / whole < 0.52, (b, whole)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tp2_moe_greedy_equals_hf_with_chunking_radix_cache_overlap_and_static_decode(demo_model, arch):
    """Every expert's columns split over two ranks, one all-reduce per MoE block (model/moe.py)."""
    path = demo_model(arch)
    ref = hf_greedy(path, PROMPTS)
    whole = weight_bytes(load_model(path, ModelConfig.from_pretrained(path), "cpu"))
    with Engine(
        path, tp_size=2, device="cpu", max_total_tokens=2048, page_size=16, chunked_prefill_size=16,
        disable_overlap=False, cpu_overlap_thread_min_ms=0, max_running_requests=8, cpu_static_decode=True,
        cuda_graph_max_bs=4,
    ) as engine:  # fmt: skip
        for _ in range(2):  # the second round hits the prefixes the first cached
            outs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
            assert [o["token_ids"] for o in outs] == ref
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        assert engine.runner.graphs.eager_static > 0
        per_rank = engine.placement["weight_bytes_per_rank"]
    for b in per_rank:  # each rank holds about half (the norms and the routers are whole on both)
        assert 0.49 < b / whole < 0.52, (b, whole)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_tp2_hybrid_greedy_equals_hf_with_chunking_snapshots_overlap_and_static_decode(demo_model, arch):
    """Gated DeltaNet heads split over two ranks (Qwen3-Next's per-key-head grouped projections
    too), each rank holding its heads' recurrent states; the second round resumes from the
    snapshots the first left (Qwen3.5-MoE: the same layers over model/moe.py's experts)."""
    path = demo_model(arch)
    with one_thread():
        ref = hf_greedy(path, PROMPTS)
    with Engine(
        path, tp_size=2, device="cpu", max_total_tokens=2048, page_size=16, chunked_prefill_size=16,
        disable_overlap=False, cpu_overlap_thread_min_ms=0, max_running_requests=8, cpu_static_decode=True,
        cuda_graph_max_bs=4,
    ) as engine:  # fmt: skip
        for _ in range(2):
            outs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
            assert [o["token_ids"] for o in outs] == ref
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        assert engine.runner.graphs.eager_static > 0 and engine.placement["state_bytes_per_rank"] > 0
        kv = engine.scheduler.kv
        kv.check([])
        assert kv.available() == kv.capacity


def test_tp2_greedy_equals_hf_under_decode_retraction(demo_model):
    path = demo_model("llama")
    ref = hf_greedy(path, PROMPTS)
    with Engine(
        path, tp_size=2, device="cpu", max_total_tokens=96, init_new_token_ratio=0.0, page_size=16,
        chunked_prefill_size=0, disable_overlap=False, cpu_overlap_thread_min_ms=0, max_running_requests=8,
    ) as engine:  # fmt: skip
        outs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
        assert engine.scheduler.num_retractions > 0
        assert [o["token_ids"] for o in outs] == ref
        assert engine.scheduler.kv.available() == engine.scheduler.kv.capacity


def test_tp2_seeded_sampling_equals_tp1(demo_model):
    """Also with what rank 0 alone does after the logits: logprobs (and the prompt positions every
    rank computes logits for), penalties and a grammar mask."""
    path = demo_model("qwen3")
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    params[0] = replace(params[0], logprobs=2, prompt_logprobs=2)
    params[1] = replace(params[1], repetition_penalty=1.4, presence_penalty=0.5)
    params[2] = replace(params[2], ignore_eos=False, constraint=Constraint("regex", "[a-z]{3,8}"))
    outs = {}
    for tp in (1, 2):
        with Engine(path, tp_size=tp, device="cpu", max_total_tokens=2048, chunked_prefill_size=8) as engine:
            outs[tp] = engine.generate(prompt=PROMPTS, sampling_params=params)
    assert [o["token_ids"] for o in outs[1]] == [o["token_ids"] for o in outs[2]]
    for key in ("output_logprobs", "prompt_logprobs"):
        one, two = outs[1][0][key], outs[2][0][key]
        assert len(one) == len(two) > 1
        for a, b in zip(one, two, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1]


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(demo_model):
    path = demo_model("llama")  # 4 heads
    with pytest.raises(ValueError, match="tp_size 8 does not divide the model's 4 attention heads"):
        Engine(path, tp_size=8, device="cpu")


# --------------------------------------------------------------------- logits, by hand
# tp_rank.py imports little (no transformers); each rank process runs every model below, so seven
# interpreters start once, at once, on two cores
RANK = "import sys; from tests.helpers.tp_rank import run_rank; run_rank({}, {}, {}, *sys.argv[1:])"
SIZES = (1, 2, 4)  # 4: more ranks than the models' KV heads (2): each on two


@pytest.fixture(scope="module")
def rank_logits(demo_model, tmp_path_factory) -> dict[str, dict[int, list[Path]]]:
    """Each model's logits from every rank of groups of 1, 2 and 4 ranks (their own ports), by
    model and group size: the demo llama, qwen2 and qwen3, and ``odd``, a llama whose 2,051-row
    vocabulary divides over neither 2 nor 4 ranks."""
    out = tmp_path_factory.mktemp("rank-logits")
    odd = save_random_model(out / "odd", lambda vocab, ids: model_config("llama", "tiny", vocab + 3, ids))
    assert ModelConfig.from_pretrained(odd).vocab_size == 2051
    models = {arch: demo_model(arch) for arch in ("llama", "qwen2", "qwen3")} | {"odd": odd}
    outs = {m: {n: [out / f"{m}-rank{r}-of-{n}.npy" for r in range(n)] for n in SIZES} for m in models}
    procs = []
    for size in SIZES:
        port = free_port()
        for r in range(size):
            args = [str(a) for m, path in models.items() for a in (path, outs[m][size][r])]
            cmd = [sys.executable, "-c", RANK.format(r, size, port), *args]
            procs.append(subprocess.Popen(cmd, cwd=REPO))
    try:
        for p in procs:
            assert p.wait(300) == 0
    finally:  # a failed rank leaves the others waiting in a collective: none outlives the test
        for p in procs:
            p.kill()
            p.wait()
    return outs


def _logits(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.load(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sharded_logits_equal_the_whole_models_and_hf(demo_model, rank_logits, arch):
    outs = rank_logits[arch]
    whole = outs[1][0]
    ref = _logits(whole)
    ids = json.loads(Path(f"{whole}.json").read_text())["ids"]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(demo_model(arch))).eval()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ref, hf, atol=1e-4, rtol=1e-4)
    for size in (2, 4):
        for out in outs[size]:  # every rank returns the whole vocabulary's logits
            torch.testing.assert_close(_logits(out), ref, atol=1e-5, rtol=1e-5)


def test_a_vocabulary_that_does_not_divide_is_padded_and_cut_off(rank_logits):
    # 2051 rows over 2 and 4 ranks: the last rank's embedding and (untied) LM head end in zero rows
    outs = rank_logits["odd"]
    ref = _logits(outs[1][0])
    assert ref.shape[-1] == 2051
    for size in (2, 4):
        for out in outs[size]:
            torch.testing.assert_close(_logits(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp2_block_fp8_serves_hf_greedy_tokens_with_half_the_weights_per_rank(tmp_path, arch):
    """The block format (the official FP8 checkpoints'; Qwen3-30B-A3B-FP8's for qwen3_moe, its
    experts 256 wide here: each rank holds one 128-column block of every expert, and its scales)."""
    fp8, ref = write_fp8(source_model(tmp_path / "src", arch), tmp_path / "block", "block")
    prompts, new = PROMPTS[:3], 8  # short: every step is a round of gloo collectives per layer
    greedy = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    with Engine(fp8, tp_size=2, device="cpu", max_total_tokens=1024, warmup=False) as engine:
        outs = engine.generate(prompt=prompts, sampling_params=greedy)
        per_rank = engine.placement["weight_bytes_per_rank"]
    assert [o["token_ids"] for o in outs] == hf_greedy(ref, prompts, new)
    whole, _ = expected_bytes(ref, "block", dtype_bytes=4)  # the model on one rank
    print(f"{arch} block FP8, tp 2: each rank {[round(b / whole, 3) for b in per_rank]} of the whole")
    assert len(per_rank) == 2 and all(0.49 < b / whole < 0.52 for b in per_rank), per_rank


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_tp2_greedy_with_the_host_kv_tier_equals_tp1_without(demo_model, arch):
    """Each rank holds its own heads' host pool; rank 0 plans the copies, every rank runs them. The
    hybrid: each rank's snapshots (its share of every state) stay on its device while the KV goes to
    the host; with four device snapshot slots, those the device evicts go to every rank's host
    snapshot slots and come back (the stores and loads travel in the step's arrays)."""
    path = demo_model(arch)
    few = dict(max_state_snapshots=4) if arch == "qwen3_5" else {}
    off, _ = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True)
    on, s = engine_turns(path, host_kv_cache_gb=0.01, disable_overlap=False, tp_size=2, **few)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    assert s.kv.cache.loaded_tokens >= 2 * PREFIX and s.num_retractions > 0
    if few:
        assert s.kv.cache.stored_snapshots > 0 and s.kv.cache.loaded_snapshots > 0


# ------------------------------------------------------------------- the disk tier, tp=2
DISK_HOST_GB = 0.00004  # the host tier smaller than one turn's prefixes: blocks reach the disk


def _disk_turns(path, directory, tp_size):
    """``engine_turns`` with host + disk on ``directory``; the host tier's tokens the same at every
    tp size (each rank's host pool holds its own heads: tp 2 needs half the bytes per rank)."""
    turns, s = engine_turns(
        path, host_kv_cache_gb=DISK_HOST_GB / tp_size, kv_disk_cache_dir=str(directory),
        disable_overlap=False, tp_size=tp_size,
    )  # fmt: skip
    return [[o["token_ids"] for o in t] for t in turns], turns, s


@pytest.fixture(scope="module")
def tp_disk(demo_model, tmp_path_factory):
    """Tiers off (tp 1), and host + disk at tp 1 and tp 2, each on its own directory."""
    path = demo_model("llama")
    off, s_off = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True)
    dirs = {tp: tmp_path_factory.mktemp(f"disk-tp{tp}") for tp in (1, 2)}
    runs = {tp: _disk_turns(path, dirs[tp], tp) for tp in (1, 2)}
    runs[0] = ([], off, s_off)
    return path, [[o["token_ids"] for o in t] for t in off], dirs, runs


def test_tp2_greedy_with_host_and_disk_equals_tiers_off_and_tp1_and_a_restart_starts_warm(tp_disk):
    """Every rank writes its own heads' part of each block; rank 0 reads and checks all of them and
    sends each follower its heads of the fills: tokens identical to tiers off and to tp 1."""
    path, off, dirs, runs = tp_disk
    (_, _, s_off), (tokens1, _, _), (tokens2, _, s2) = runs[0], runs[1], runs[2]
    assert tokens2 == tokens1 == off
    tier = s2.kv.cache.disk
    assert tier.written_tokens > 0 and tier.read_tokens > 0 and not tier.misses and not tier.off
    assert s2.prefill_tokens < s_off.prefill_tokens  # (how many: when the reads land, not exact)
    parts = {r: sorted(p.name[:16] for p in dirs[2].glob(f"*.r{r}of2.kv")) for r in (0, 1)}
    assert parts[0] and parts[0] == parts[1] and not list(dirs[2].glob("????????????????.kv"))
    tokens, again, s = _disk_turns(path, dirs[2], 2)  # a restart on the directory
    assert tokens == off and again[0][0]["meta_info"]["cached_tokens"] > 0
    assert s.kv.cache.disk.read_tokens > 0 and not s.kv.cache.disk.misses


def test_tp2_a_corrupt_part_on_rank_1_is_a_counted_miss_and_the_outputs_stay_correct(tp_disk, tmp_path):
    path, off, dirs, _ = tp_disk
    for f in dirs[2].glob("*.kv"):  # a copy: the other test's restart reads the originals
        (tmp_path / f.name).write_bytes(f.read_bytes())
    for f in tmp_path.glob("*.r1of2.kv"):
        raw = bytearray(f.read_bytes())
        raw[-9] ^= 0x5A
        f.write_bytes(bytes(raw))
    tokens, again, s = _disk_turns(path, tmp_path, 2)
    assert tokens == off
    tier = s.kv.cache.disk
    assert tier.misses["corrupt"] >= 1 and sum(tier.misses.values()) == tier.misses["corrupt"]
    assert sum(o["meta_info"]["cached_tokens"] for o in again[0]) == 0  # nothing bad was served


def test_files_of_another_tp_size_are_never_loaded(tp_disk):
    """A tp 2 engine on tp 1's directory, and a tp 1 engine on tp 2's, find none of its blocks."""
    path, off, dirs, _ = tp_disk
    for tp, other in ((2, 1), (1, 2)):
        tokens, turns, s = _disk_turns(path, dirs[other], tp)
        assert tokens == off and sum(o["meta_info"]["cached_tokens"] for o in turns[0]) == 0
        assert not s.kv.cache.disk.misses  # not even looked at: another layout's names


def test_tp2_a_graceful_stop_writes_every_ranks_part_down_so_a_restart_starts_warm(demo_model, tmp_path):
    """A host tier that held everything while serving: at the stop every rank runs the write-down's
    copies and writes its parts; the next tp 2 engine serves every prefix from them."""
    opts = dict(
        max_total_tokens=160, page_size=4, chunked_prefill_size=16, warmup=False, host_kv_cache_gb=0.005,
        kv_disk_cache_dir=str(tmp_path), tp_size=2,
    )  # fmt: skip
    prompts = [[*range(10 + 60 * c, 10 + 60 * c + PREFIX), 3] for c in range(4)]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with Engine(demo_model("llama"), **opts) as first:
        before = first.generate(input_ids=prompts, sampling_params=params)
        assert first.disk is not None and first.disk.written_tokens == 0  # the host held everything
    assert first.disk.written_tokens == 4 * PREFIX // 16 * 16  # whole blocks
    assert (
        len(list(tmp_path.glob("*.r1of2.kv"))) == len(list(tmp_path.glob("*.r0of2.kv"))) == 4 * PREFIX // 16
    )
    with Engine(demo_model("llama"), **opts) as again:
        after = again.generate(input_ids=prompts, sampling_params=params)
    assert [o["token_ids"] for o in after] == [o["token_ids"] for o in before]
    assert [o["meta_info"]["cached_tokens"] for o in after] == [PREFIX // 16 * 16] * 4
