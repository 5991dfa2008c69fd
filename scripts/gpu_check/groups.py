"""tests/gpu in three pytest processes, kernels first: a crash or hang in one (a device fault, a
stuck engine) costs only its own group, and the groups that ran before it keep their logs.

Each test is named by its function, so a group is one ``-k`` expression over the files it draws
from (a skipped module cannot be named by node id). A CPU test holds that the groups name every test
function in tests/gpu exactly once. ``per_test_s`` is each test's limit (pytest-timeout), which
presumes the JIT step built the modules; ``limit_s`` the whole process's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    name: str
    tests: dict[str, tuple[str, ...]]  # file -> test functions
    per_test_s: int
    limit_s: int

    def argv(self) -> list[str]:
        names = [t for fns in self.tests.values() for t in fns]
        return [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=15",
            f"--timeout={self.per_test_s}", *self.tests, "-k", " or ".join(names),
        ]  # fmt: skip


GPU = "tests/gpu/"
GROUPS = (
    Group(
        "kernels",  # flashinfer attention, fused ops, staging, the mirror, logits processing, FP8 GEMMs
        {
            GPU + "test_gpu_attention.py": (
                "test_flashinfer_matches_torch_backend",
                "test_unsupported_configs_are_refused",
                "test_auto_picks_flashinfer_only_where_it_can_serve",
                "test_prepare_does_not_wait_for_the_running_step",
                "test_stale_forward_batch_is_refused",
                "test_model_logits_flashinfer_vs_torch",
            ),
            GPU + "test_gpu_fastpath.py": (
                "test_fused_ops_match_the_torch_reference",
                "test_staging_sends_a_steps_arrays_in_one_pinned_copy",
                "test_device_mirror_and_page_indices_on_cuda",
            ),
            GPU + "test_gpu_logits.py": ("test_bitmask_and_penalties_equal_the_cpu_results",),
            GPU + "test_gpu_fp8.py": ("test_fp8_gemm_agrees_with_the_dequantized_matmul",),
            GPU + "test_gpu_fp8_moe.py": ("test_fp8_grouped_experts_agree_with_the_dequantized_reference",),
            GPU + "test_gpu_hybrid.py": ("test_fla_kernels_agree_with_the_torch_delta_rule_in_bfloat16",),
            GPU + "test_gpu_host_tier.py": (
                "test_host_pages_are_pinned_and_round_trip_byte_exact_through_the_side_stream",
                "test_the_forward_stream_waits_for_a_steps_loads_only_when_its_batch_reads_them",
            ),
            GPU + "test_gpu_kv_tier_metrics.py": (
                "test_a_loads_seconds_come_from_its_events_once_fired_and_the_pages_arrive",
            ),
        },
        per_test_s=120,
        limit_s=180,
    ),
    Group(
        "sampling",  # flashinfer's sampling kernels against the documented distributions
        {
            GPU + "test_gpu_sampling.py": (
                "test_empirical_distribution_matches_the_renormalised_one",
                "test_auto_backend_picks_flashinfer_on_cuda",
                "test_greedy_rows_are_the_argmax",
                "test_seeded_rows_reproduce_the_torch_path",
                "test_masked_vocab_is_never_sampled",
                "test_unseeded_rows_follow_the_generator",
                "test_parameters_move_in_two_pinned_copies",
            ),
        },
        per_test_s=60,
        limit_s=120,
    ),
    Group(
        "engine",  # whole engines: graphs, overlap, warm-up, dtype, logprobs, tensor parallelism
        {
            GPU + "test_gpu_attention.py": (
                "test_engine_flashinfer_greedy_agrees_with_torch",
                "test_engine_flashinfer_overlap_agrees_with_no_overlap",
                "test_engine_overlap_matches_no_overlap_torch",
                "test_engine_auto_serves_tiny_model_with_torch",
            ),
            GPU + "test_gpu_fastpath.py": (
                "test_graph_replay_gives_the_eager_logits",
                "test_graph_replay_with_overlap_and_seeded_sampling",
                "test_float32_checkpoint_serves_in_bf16_and_float32_is_honoured",
                "test_warm_up_runs_before_ready_and_leaves_an_empty_cache",
                "test_capture_freezes_the_collector_and_thaws_it_after",
                "test_cuda_n_is_honoured",
            ),
            GPU + "test_gpu_logits.py": ("test_logprobs_penalties_and_json_schema_on_cuda",),
            GPU + "test_gpu_tensor_parallel.py": ("test_tp2_on_two_gpus_agrees_with_tp1",),
            GPU + "test_gpu_fp8.py": (
                "test_block_fp8_checkpoint_agrees_with_its_dequantized_weights",
                "test_quantization_fp8_on_cuda_graphs_agrees_with_bf16_and_leaves_no_cache",
            ),
            GPU + "test_gpu_fp8_moe.py": ("test_fp8_moe_checkpoints_agree_with_their_dequantized_weights",),
            GPU + "test_gpu_hybrid.py": ("test_cuda_engine_with_decode_graphs_equals_the_cpu_engine",),
            GPU + "test_gpu_host_tier.py": (
                "test_engine_greedy_tokens_are_the_same_with_the_host_tier_on_cuda",
                "test_a_hybrid_engine_resumes_host_prefixes_from_their_snapshots_on_cuda",
                "test_engine_greedy_tokens_are_the_same_with_the_disk_tier_on_cuda_and_a_restart_starts_warm",
            ),
        },
        per_test_s=150,
        limit_s=300,
    ),
)
