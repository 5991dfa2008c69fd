"""The GPU decode benchmark runs end to end (``--smoke``: tiny model on CPU) and reports every figure.

No timing is asserted, and the GPU-only figures (the idle trace, the targets) may be null here: they
come from a run on a GPU machine (benchmarks/results/gpu-<device>.json).
"""

import json
from pathlib import Path

import pytest

from radixserve.bench_index import load_benchmark

NUMBERS = [  # numbers on CPU too
    "decode_ms_bs1",
    "decode_ms_bs8",
    "decode_ms_bs64",
    "decode_ms_bs1_eager",
    "decode_ms_bs8_eager",
    "decode_ms_bs64_eager",
    "floor_ms_bs1",
    "d2d_gbps",
    "kernels_per_decode_step",
    "num_layers",
    "kernels_per_layer",
    "offline_tok_s",
    "hf_tok_s",
    "speedup_vs_hf",
    "overlap_speedup",
    "nano_vllm_published_tok_s",
]
# the GPU's own time per decode step and its idle gap before one (CUDA events): None on CPU
GPU_STEP = [f"decode_gpu_{k}ms_bs{b}{s}" for k in ("", "idle_") for b in (1, 8, 64) for s in ("", "_eager")]
GPU_ONLY = ["gpu_idle_ms_p50", "gpu_idle_ms_p90", "gpu_idle_frac", *GPU_STEP]
TARGETS = [
    "decode_ms_bs1_le_2x_floor",
    "kernels_per_layer_le_15",
    "speedup_vs_hf_ge_10",
    "overlap_speedup_ge_1_15",
]


# The smoke report's keys (no GPU run is committed to compare with): top level (""), and one level
# down for each dict-valued entry. A partial report (a stage failed or not run) has the same keys.
SMOKE_KEYS = {
    "": " ".join(GPU_STEP)
    + """ benchmark partial stages device torch_version flashinfer_version attention_backend
        cuda_graphs_used decode_ms_bs1 decode_ms_bs8 decode_ms_bs64 decode_ms_bs1_eager decode_ms_bs8_eager
        decode_ms_bs64_eager floor_ms_bs1 d2d_gbps kernels_per_decode_step num_layers kernels_per_layer
        kernel_count_method offline_tok_s hf_tok_s speedup_vs_hf nano_vllm_published_tok_s
        nano_vllm_device overlap_speedup gpu_idle_ms_p50 gpu_idle_ms_p90 gpu_idle_frac gpu_trace_steps
        gpu_busy_ms_total gpu_idle_ms_total gpu_trace config floor decode kernels offline hf machine
        targets benchmark_wall_s""",
    "stages": "bandwidth decode_graphs decode_eager offline_overlap hf offline_normal gpu_trace",
    "config": """model model_shapes smoke preset stages_asked device_arg dtype seed page_size
        chunked_prefill_size batch_sizes prompt_len decode_steps profile_steps num_requests input_range
        output_range hf_batch_sizes_tried max_running_requests workload sampling""",
    "floor": """weight_bytes kv_bytes_per_token kv_tokens_read_bs1_median bytes_read_bs1 d2d_gbps
        copy_bytes copy_ms_each_round d2d_method""",
    "decode": "graphs eager",
    "kernels": """kernels_per_decode_step kernel_count_method profiled_steps profiled_decode_steps
        profiled_batch_size cuda_launch_api_calls_per_decode_step top_kernels_per_step""",
    "offline": "overlap normal",
    "hf": """system batch_size wall_s process_cpu_s cpu_per_wall loadavg_1m_before_after minor_page_faults
        prompt_tokens output_tokens output_tok_s total_tok_s raw_generated_tokens raw_generated_tok_s
        num_batches outputs_exact sweep""",
    "machine": """date cpu_model cpu_count torch_threads platform python torch numpy loadavg_at_start
        transformers cuda_device loadavg_at_end""",
    "targets": """decode_ms_bs1_le_2x_floor kernels_per_layer_le_15 speedup_vs_hf_ge_10
        overlap_speedup_ge_1_15 note""",
}


@pytest.fixture(scope="module")
def gpu_bench():
    return load_benchmark("gpu")


@pytest.fixture(scope="module")
def smoke_run(gpu_bench, tmp_path_factory) -> tuple[Path, dict]:
    """One ``--smoke`` run for every test that reads its output."""
    out = tmp_path_factory.mktemp("gpu")
    assert gpu_bench.main(["--smoke", "--out", str(out)]) == 0
    return out, json.loads((out / "gpu-cpu.json").read_text())


def test_smoke_run_writes_every_figure(smoke_run):
    out, report = smoke_run
    assert (out / "gpu-cpu.png").stat().st_size > 0
    for key in NUMBERS:
        assert isinstance(report[key], (int, float)) and report[key] > 0, key
    for key in GPU_ONLY:
        assert key in report and (report[key] is None or isinstance(report[key], float)), key
    assert isinstance(report["gpu_trace"], list) and len(report["gpu_trace"]) <= 2000
    assert report["device"] == "cpu" and report["nano_vllm_device"] == "RTX 4070"
    assert report["num_layers"] == 2
    assert "CPU" in report["kernel_count_method"]
    assert report["kernels_per_layer"] == pytest.approx(report["kernels_per_decode_step"] / 2)
    assert report["cuda_graphs_used"] is False and report["attention_backend"]
    assert isinstance(report["torch_version"], str) and "flashinfer_version" in report
    assert report["partial"] is False and set(report["stages"].values()) == {"done"}
    assert set(TARGETS) <= set(report["targets"])
    assert all(report["targets"][k] is None for k in TARGETS)  # not judged on CPU
    # every request got exactly its output length, on both loops
    assert all(report["offline"][loop]["outputs_exact"] for loop in ("overlap", "normal"))
    # the decode figures are medians over steps where all B requests decoded together
    for b in (1, 8, 64):
        assert report["decode"]["graphs"]["by_batch_size"][str(b)]["steps_timed"] > 0
    assert report["kernels"]["profiled_decode_steps"] == report["kernels"]["profiled_steps"] > 0


def test_smoke_run_has_the_key_structure_it_had_before_the_split(smoke_run):
    report = smoke_run[1]
    assert set(report) == set(SMOKE_KEYS[""].split())
    for key, keys in SMOKE_KEYS.items():
        if key:
            assert set(report[key]) == set(keys.split()), key
    # every dict-valued entry is listed above
    assert {k for k, v in report.items() if isinstance(v, dict)} == set(SMOKE_KEYS) - {""}


def test_a_run_of_some_stages_is_a_partial_report_with_every_key(gpu_bench, tmp_path):
    """The JSON is written after every stage; a run that did not do them all says so, and keeps
    every key (None where not measured), so a reader of a cut-short run finds the same layout."""
    stages = "bandwidth,decode_graphs"
    assert gpu_bench.main(["--smoke", "--stages", stages, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert set(report) == set(SMOKE_KEYS[""].split())
    assert report["partial"] is True
    assert [k for k, v in report["stages"].items() if v == "done"] == stages.split(",")
    assert {v for k, v in report["stages"].items() if k not in stages} == {"not run"}
    assert report["decode_ms_bs1"] > 0 and report["floor_ms_bs1"] > 0
    assert report["decode_ms_bs1_eager"] is None and report["offline_tok_s"] is None
    assert report["overlap_speedup"] is None and report["targets"]["speedup_vs_hf_ge_10"] is None
    assert (tmp_path / "gpu-cpu.png").stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp"))  # each write replaced the file whole


def test_idle_stats_and_targets(gpu_bench):
    steps = [
        {"mode": "extend", "batch_size": 4, "gpu_ms": 3.0, "idle_before_ms": None},
        {"mode": "decode", "batch_size": 4, "gpu_ms": 1.0, "idle_before_ms": 0.5},
        {"mode": "decode", "batch_size": 4, "gpu_ms": 1.0, "idle_before_ms": 0.5},
    ]
    s = gpu_bench.idle_stats(steps)
    assert s["gpu_idle_ms_p50"] == 0.5 and s["gpu_idle_frac"] == pytest.approx(1.0 / 6.0)
    assert gpu_bench.idle_stats([])["gpu_idle_frac"] is None
    figures = {
        "decode_ms_bs1": 0.5,
        "floor_ms_bs1": 0.3,
        "kernels_per_layer": 16.0,
        "speedup_vs_hf": 12.0,
        "overlap_speedup": None,
    }
    t = gpu_bench.judge(figures, cuda=True)
    assert t["decode_ms_bs1_le_2x_floor"] is True and t["kernels_per_layer_le_15"] is False
    assert t["speedup_vs_hf_ge_10"] is True and t["overlap_speedup_ge_1_15"] is None
    assert gpu_bench.device_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_bench.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_bench_gpu_parses_its_flags(gpu_bench):
    args = gpu_bench.parse_args(["--smoke", "--num-requests", "4", "--out", "x"])
    assert args.smoke and args.num_requests == 4 and str(args.out) == "x"
    check = gpu_bench.parse_args(["--preset", "check", "--device", "cpu", "--stages", "hf,bandwidth"])
    assert (check.num_requests, check.max_running_requests, check.hf_batch_sizes) == (64, 64, (64,))
    assert tuple(check.input_range) == (64, 512) and tuple(check.output_range) == (64, 256)
    assert check.stages == ["hf", "bandwidth"]  # run in the benchmark's own order
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--smoke", "--stages", "decode"])


def test_the_moe_models_decode_stages_write_a_report_of_their_own(gpu_bench, tmp_path):
    """``--arch qwen3_moe`` (scripts/gpu-check phase2 --arch qwen3_moe): the MoE model's decode step
    at every batch size, in gpu-<device>-qwen3_moe.json beside the dense model's report."""
    argv = ["--smoke", "--arch", "qwen3_moe", "--stages", "decode_graphs", "--out", str(tmp_path)]
    assert gpu_bench.main(argv) == 0
    report = json.loads((tmp_path / "gpu-cpu-qwen3_moe.json").read_text())
    assert set(report) == set(SMOKE_KEYS[""].split())
    assert report["config"]["model"] == "random-weight Qwen3-MoE, tiny shapes (--smoke)"
    assert all(report[f"decode_ms_bs{b}"] > 0 for b in (1, 8, 64))
    assert not (tmp_path / "gpu-cpu.json").exists()
