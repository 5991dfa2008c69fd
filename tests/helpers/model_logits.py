"""A loaded model's logits at every position, outside the engine, and ``served_like_hf``: what the FP8
tests (tests/unit/test_fp8.py, test_fp8_moe.py) hold a checkpoint to, HF transformers run on the same
weights dequantized."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine, SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention import TorchAttention
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.device import DeviceProfile
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.llama import CausalLM
from radixserve.scheduler.model.loader import load_model
from tests.helpers.hf import NEW, PROMPTS, hf_greedy

LOGIT_TOL = 1e-4  # float32 on both sides: only rounding differs


def engine_logits(path, quantization: str) -> tuple[torch.Tensor, torch.Tensor, CausalLM]:
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


@dataclass(frozen=True)
class Served:
    model: CausalLM  # loaded by the real loader
    weight_bytes: list[int]  # the engine's report, per rank
    profile: DeviceProfile  # the engine's


def served_like_hf(folder: Path, ref: Path, quantization: str, label: str) -> Served:
    """Checkpoint ``folder`` (``quantization``: the engine's flag) on CPU against HF on ``ref``: its
    logits at every position of a 40-token prompt within ``LOGIT_TOL`` of HF's (printed), and the
    engine's greedy tokens for 3 prompts HF's own."""
    ids, ours, model = engine_logits(folder, quantization)
    hf = AutoModelForCausalLM.from_pretrained(str(ref)).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    diff = (ours - want).abs().max().item()
    print(f"{label}: logits max abs diff {diff:.2e} (logit std {want.std().item():.2f})")
    assert diff < LOGIT_TOL
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    with Engine(
        folder, device="cpu", max_total_tokens=2048, quantization=quantization, warmup=False
    ) as engine:
        outs = engine.generate(prompt=PROMPTS[:3], sampling_params=greedy)
        served = Served(model, engine.placement["weight_bytes_per_rank"], engine.profile)
    assert [o["token_ids"] for o in outs] == hf_greedy(ref, PROMPTS[:3])
    return served
