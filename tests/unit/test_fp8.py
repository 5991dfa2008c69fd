"""FP8 weights end to end on CPU: each checkpoint format, and ``--quantization fp8``, loaded by the real
loader and served by the engine, against HF transformers run on the same weights dequantized.

Tolerance: the logits of a 40-token prompt (every position) within 1e-4 of HF's. On CPU the FP8
weights are dequantized per matmul, in float32 here, so the only differences are float32 rounding
(the merged projections, the attention kernel). Greedy tokens (3 prompts x 12) are identical.
Resident weights: the engine's own report (``placement``) is exactly the FP8 projections (1 byte
a parameter) plus their float32 scales plus the rest in the serving dtype; the projections are
half their bf16 size (plus 1.6% per-row scales at K=256), a model about 55% of its bf16 size here
(embeddings and norms stay in high precision) -- real models, whose projections dominate, ~52%.
"""

from __future__ import annotations

import pytest
from grpc_health.v1.health import HealthServicer
from prometheus_client import generate_latest
from safetensors.torch import load_file

from radixserve import Engine, SamplingParams
from radixserve.scheduler.model.quant.linear import Fp8Linear
from radixserve.scheduler.server import SchedulerService
from tests.helpers.fp8_models import expected_bytes, projection_bytes, source_model, write_fp8
from tests.helpers.model_logits import served_like_hf

FORMATS = {"block": "qwen3", "channel": "qwen2", "tensor": "llama", "load": "qwen3"}  # biases: qwen2


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-src")
    return {arch: source_model(root / arch, arch) for arch in sorted({*FORMATS.values(), "qwen3_moe"})}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def checkpoint(request, sources, tmp_path_factory):
    """(format, FP8 folder, reference folder with the weights dequantized)."""
    fmt = request.param
    folder, ref = write_fp8(sources[FORMATS[fmt]], tmp_path_factory.mktemp("fp8") / fmt, fmt)
    return fmt, folder, ref


def test_fp8_logits_tokens_and_bytes_match_hf_on_the_dequantized_weights(checkpoint):
    fmt, folder, ref = checkpoint
    served = served_like_hf(folder, ref, "fp8" if fmt == "load" else "none", fmt)
    fp8_modules = [m for m in served.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_modules) == 4 * 4 - (fmt == "channel")  # llm-compressor's ignore entry stays fp32
    assert any(n.startswith("FP8 weights") and "per matmul" in n for n in served.profile.notes)
    report = served.weight_bytes
    total, _ = expected_bytes(ref, fmt, dtype_bytes=4)
    assert report == [total]
    proj_fp8, proj_bf16 = projection_bytes(ref, fmt)
    print(
        f"{fmt}: weights {report[0]} bytes; projections {proj_fp8} bytes, {proj_fp8 / proj_bf16:.3f} of bf16"
    )
    assert 0.5 <= proj_fp8 / proj_bf16 < 0.52


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_halves_a_bf16_models_resident_weights(sources, arch):
    """A bf16-served model with --quantization fp8, by the engine's own report (and the scheduler
    pod's /metrics, which reads it): its projections (an MoE model's experts too) in FP8 with a
    float32 scale per row, the rest (embeddings, norms, routers) in bf16."""
    src = sources[arch]
    params = sum(t.numel() for t in load_file(str(src / "model.safetensors")).values())
    args = dict(device="cpu", dtype="bfloat16", max_total_tokens=512, quantization="fp8", warmup=False)
    with Engine(src, **args) as engine:
        report = engine.placement["weight_bytes_per_rank"][0]
        pod = SchedulerService(engine, "localhost:1", "localhost:2", HealthServicer(), model_name="m")
        scraped = generate_latest(pod.metrics.registry).decode()
        pod.out.close()
        out = engine.generate(prompt="def add(a, b):", sampling_params=SamplingParams(max_new_tokens=2))
    assert len(out["token_ids"]) == 2
    (line,) = [
        x for x in scraped.splitlines() if x.startswith('radixserve_weight_bytes{model_name="m",rank="0"}')
    ]
    assert float(line.split()[-1]) == report == expected_bytes(src, "load", dtype_bytes=2)[0]
    fp8, bf16 = projection_bytes(src, "load")
    print(
        f"--quantization fp8, bf16 {arch}: {report} bytes, {report / (2 * params):.3f} of the bf16 model;"
        f" projections {fp8 / bf16:.3f} of bf16"
    )
    assert 0.5 < report / (2 * params) < 0.65 and 0.5 <= fp8 / bf16 < 0.52  # embeddings: a third here
