"""The disk KV tier through the engine and the demo llama (docs/architecture.md, "KV tiers"): greedy
tokens are the same with tiers off, host only and host + disk, through a device pool far smaller than
the working set (chunked prefill, retraction, the overlap loop); a restarted engine, or another one
on the same directory, starts warm from its files; bad files are counted misses with correct
outputs; a read-only directory degrades to the host tier with one warning."""

from __future__ import annotations

import logging
import subprocess

import pytest

from radixserve import Engine, SamplingParams
from tests.helpers.host_tier import PREFIX, engine_turns

HOST_GB = 0.00004  # about 76 tokens of the tiny llama: smaller than one turn's prefixes


@pytest.fixture(scope="module")
def llama_dir(demo_model):
    return demo_model("llama")


@pytest.fixture(scope="module")
def tiers_off(llama_dir):
    off, _ = engine_turns(llama_dir, host_kv_cache_gb=0.0, disable_overlap=True)
    return [[o["token_ids"] for o in t] for t in off]


def _tokens(turns):
    return [[o["token_ids"] for o in t] for t in turns]


def test_greedy_tokens_are_the_same_with_tiers_off_host_and_disk_and_a_restart_starts_warm(
    llama_dir, tiers_off, tmp_path
):
    host, s_host = engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, disable_overlap=False)
    disk, s_disk = engine_turns(
        llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(tmp_path), disable_overlap=False
    )
    assert _tokens(host) == _tokens(disk) == tiers_off
    tier = s_disk.kv.cache.disk
    assert tier.written_tokens > 0 and tier.read_tokens > 0 and not tier.misses and not tier.off
    assert s_disk.prefill_tokens < s_host.prefill_tokens and s_disk.num_retractions > 0
    # A new engine on the directory: the first turn's prefixes come from disk
    again, s_again = engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(tmp_path))
    assert _tokens(again) == tiers_off
    assert again[0][0]["meta_info"]["cached_tokens"] > 0  # the very first request
    assert sum(o["meta_info"]["cached_tokens"] for o in again[0]) >= 3 * PREFIX // 2
    assert s_again.kv.cache.disk.read_tokens > 0


def test_two_engines_sharing_a_directory_reuse_each_others_blocks(llama_dir, tiers_off, tmp_path):
    opts = dict(max_total_tokens=160, page_size=4, chunked_prefill_size=16, warmup=False,
                host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(tmp_path))  # fmt: skip
    with Engine(llama_dir, **opts) as a, Engine(llama_dir, **opts) as b:  # b scanned an empty directory
        assert a.disk is not None and b.disk is not None and a.disk.store.dir_id == b.disk.store.dir_id
        prompts = [[*range(10 + 60 * c, 10 + 60 * c + PREFIX), 3] for c in range(6)]
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        from radixserve import SamplingParams

        greedy = SamplingParams(**params)
        first = a.generate(input_ids=prompts, sampling_params=greedy)
        a.disk.flush()
        assert a.disk.written_tokens > 0
        second = b.generate(input_ids=prompts[:3], sampling_params=greedy)
        assert [o["token_ids"] for o in second] == [o["token_ids"] for o in first[:3]]
        assert b.disk.read_tokens > 0 and second[0]["meta_info"]["cached_tokens"] > 0


@pytest.mark.parametrize("fault", ["corrupt", "truncated"])
def test_bad_files_are_counted_misses_and_the_outputs_stay_correct(llama_dir, tiers_off, tmp_path, fault):
    engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(tmp_path))
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    for f in files:
        raw = f.read_bytes()
        f.write_bytes(raw[:-7] if fault == "truncated" else raw[:-9] + bytes([raw[-9] ^ 0x5A]) + raw[-8:])
    again, s = engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(tmp_path))
    assert _tokens(again) == tiers_off
    tier = s.kv.cache.disk
    assert tier.misses[fault] >= 1 and sum(tier.misses.values()) == tier.misses[fault]
    assert sum(o["meta_info"]["cached_tokens"] for o in again[0]) == 0  # nothing bad was served


def test_a_read_only_directory_degrades_to_the_host_tier_with_one_warning(
    llama_dir, tiers_off, tmp_path, caplog
):
    engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(tmp_path / "d"))
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path / "d"), str(ro)]).returncode:
        pytest.skip("cannot mount a read-only directory here")
    try:
        with caplog.at_level(logging.WARNING):
            again, s = engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(ro))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert _tokens(again) == tiers_off
    tier = s.kv.cache.disk
    warned = [r for r in caplog.records if "disk KV tier off" in r.getMessage()]
    assert tier.off and len(warned) == 1
    assert again[0][0]["meta_info"]["cached_tokens"] > 0  # its blocks were still read before


def test_settings_the_disk_tier_cannot_serve_are_refused_by_name(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_disk_cache_dir: the disk KV tier needs the host tier"):
        Engine(llama_dir, max_total_tokens=160, kv_disk_cache_dir=str(tmp_path), warmup=False)


def test_a_directory_that_cannot_be_opened_starts_the_engine_host_only_with_a_warning(
    llama_dir, tiers_off, tmp_path, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        turns, s = engine_turns(llama_dir, host_kv_cache_gb=HOST_GB, kv_disk_cache_dir=str(blocker / "kv"))
    assert _tokens(turns) == tiers_off
    assert not hasattr(s.kv.cache, "disk")  # the host tier alone
    assert len([r for r in caplog.records if "disk KV tier off" in r.getMessage()]) == 1


@pytest.mark.parametrize("write_down_s", [10.0, 0.0])
def test_a_graceful_stop_writes_the_tiers_down_so_a_restart_starts_warm(llama_dir, tmp_path, write_down_s):
    """A host tier large enough that nothing reached the disk while serving: at the stop the device
    and host tiers go down to disk (unless ``kv_disk_write_down_s`` is 0), and the next engine on
    the directory serves every conversation's prefix from it."""
    opts = dict(
        max_total_tokens=160, page_size=4, chunked_prefill_size=16, warmup=False, host_kv_cache_gb=0.01,
        kv_disk_cache_dir=str(tmp_path), kv_disk_write_down_s=write_down_s,
    )  # fmt: skip
    prompts = [[*range(10 + 60 * c, 10 + 60 * c + PREFIX), 3] for c in range(4)]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with Engine(llama_dir, **opts) as first:
        before = first.generate(input_ids=prompts, sampling_params=params)
        assert first.disk is not None and first.disk.written_tokens == 0  # the host held everything
    assert first.disk.written_tokens == (4 * PREFIX // 16 * 16 if write_down_s else 0)  # whole blocks
    with Engine(llama_dir, **opts) as again:
        after = again.generate(input_ids=prompts, sampling_params=params)
        kv = again.scheduler.kv
    assert [o["token_ids"] for o in after] == [o["token_ids"] for o in before]
    cached = [o["meta_info"]["cached_tokens"] for o in after]
    assert cached == ([PREFIX // 16 * 16] * 4 if write_down_s else [0] * 4)
    assert kv.host is not None and kv.host.free_tokens + kv.cache.host_size == kv.host.capacity_tokens
