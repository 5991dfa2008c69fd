"""Sampling the tests' way: one call of the real Sampler on given logits, its output checked."""

from __future__ import annotations

import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo


def sample(logits, params, steps=None, generator_seed=0, candidates=1024):
    if isinstance(params, SamplingParams):
        params = [params] * logits.shape[0]
    steps = [0] * len(params) if steps is None else steps
    info = SamplingInfo.from_params(params, steps, logits.device)
    gen = torch.Generator(device=logits.device).manual_seed(generator_seed)
    out = Sampler(generator=gen, top_p_candidates=candidates)(logits, info)
    assert out.dtype == torch.int64 and out.shape == (logits.shape[0],)
    assert ((out >= 0) & (out < logits.shape[1])).all()
    return out
