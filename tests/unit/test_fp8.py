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

import numpy as np
import pytest
import torch
from grpc_health.v1.health import HealthServicer
from prometheus_client import generate_latest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from radixserve import Engine, SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention import TorchAttention
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.quant.linear import Fp8Linear
from radixserve.scheduler.server import SchedulerService
from tests.helpers.fp8_models import expected_bytes, source_model, write_fp8
from tests.helpers.hf import NEW, PROMPTS, hf_greedy

GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
FORMATS = {"block": "qwen3", "channel": "qwen2", "tensor": "llama", "load": "qwen3"}  # biases: qwen2


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-src")
    return {arch: source_model(root / arch, arch) for arch in sorted(set(FORMATS.values()))}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def checkpoint(request, sources, tmp_path_factory):
    """(format, FP8 folder, reference folder with the weights dequantized)."""
    fmt = request.param
    folder, ref = write_fp8(sources[FORMATS[fmt]], tmp_path_factory.mktemp("fp8") / fmt, fmt)
    return fmt, folder, ref


def engine_logits(path, quantization: str) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(the input ids, the loaded model's logits at every position, the model): a 32-token prefill
    and 8 decodes on the torch attention backend."""
    cfg = ModelConfig.from_pretrained(path, quantization=quantization)
    model = load_model(path, cfg, "cpu")
    pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, "cpu")
    table = ReqToTokenPool(2, 64)
    backend = TorchAttention(pool, table, cfg.num_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    out = []
    for start, n in [(0, 32), *((i, 1) for i in range(32, 40))]:
        table.host[1, start : start + n] = np.arange(start, start + n) + 1
        fb = ForwardBatch(
            ForwardMode.EXTEND if n > 1 else ForwardMode.DECODE, ids[start : start + n],
            torch.arange(start, start + n), torch.arange(start, start + n) + 1, np.array([start]),
            np.array([n]), None, None, all_logits=True,
        )  # fmt: skip
        backend.prepare(fb, np.array([1]))
        out.append(model(fb.input_ids, fb.positions, fb, backend).logits)
    return ids, torch.cat(out), model


def test_fp8_logits_tokens_and_bytes_match_hf_on_the_dequantized_weights(checkpoint):
    fmt, folder, ref = checkpoint
    quantization = "fp8" if fmt == "load" else "none"
    ids, ours, model = engine_logits(folder, quantization)
    fp8_modules = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_modules) == 4 * 4 - (fmt == "channel")  # llm-compressor's ignore entry stays fp32
    hf = AutoModelForCausalLM.from_pretrained(str(ref)).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    diff = (ours - want).abs().max().item()
    print(f"{fmt}: logits max abs diff {diff:.2e} (logit std {want.std().item():.2f})")
    assert diff < 1e-4
    with Engine(
        folder, device="cpu", max_total_tokens=2048, quantization=quantization, warmup=False
    ) as engine:
        outs = engine.generate(prompt=PROMPTS[:3], sampling_params=GREEDY)
        report = engine.placement["weight_bytes_per_rank"]
        assert any(n.startswith("FP8 weights") and "per matmul" in n for n in engine.profile.notes)
    assert [o["token_ids"] for o in outs] == hf_greedy(ref, PROMPTS[:3])
    total, proj_bf16 = expected_bytes(ref, fmt, dtype_bytes=4)
    assert report == [total]
    proj_fp8 = total - (sum(p.numel() for p in hf.parameters()) - proj_bf16 // 2) * 4
    print(
        f"{fmt}: weights {report[0]} bytes; projections {proj_fp8} bytes, {proj_fp8 / proj_bf16:.3f} of bf16"
    )
    assert 0.5 <= proj_fp8 / proj_bf16 < 0.52


def test_quantization_fp8_halves_a_bf16_models_resident_weights(sources):
    """A bf16-served model with --quantization fp8, by the engine's own report (and the scheduler
    pod's /metrics, which reads it): its projections in FP8, the rest (embeddings, norms) in bf16."""
    src = sources["qwen3"]
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
    assert float(line.split()[-1]) == report
    print(f"--quantization fp8, bf16: {report} bytes, {report / (2 * params):.3f} of the bf16 model")
    assert 0.5 < report / (2 * params) < 0.6
