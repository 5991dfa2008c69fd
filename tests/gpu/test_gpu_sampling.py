"""CUDA tests: the sampler's flashinfer path against the semantics documented in sampler.py.

The whole module is skipped without CUDA or when ``import flashinfer`` fails. The unit tests drive the same
glue on CPU with a stand-in module; here the real kernels run: their empirical distributions over many draws
must match the top-k / top-p / min-p renormalised distributions (per row, in batches that mix parameters),
greedy rows must be the argmax, and seeded rows must reproduce the torch path's tokens.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
try:
    import flashinfer.sampling  # noqa: F401
except Exception as e:  # not installed, or built for another CUDA / torch
    pytest.skip(f"flashinfer does not import: {e!r}", allow_module_level=True)

# Per-test time limits: pyproject's default (a first use JIT-compiles the sampling kernels), or
# scripts/gpu-check's per group, which compiles them before the tests.
pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")

# 12 tokens, shuffled so that sorted order is not index order. Sorted: .22 .17 .13 .11 .09 .08 .06 .05 .04
# .03 .015 .005; the thresholds below sit well away from every cumulative sum and every min-p cut.
_SORTED = [0.22, 0.17, 0.13, 0.11, 0.09, 0.08, 0.06, 0.05, 0.04, 0.03, 0.015, 0.005]
_PERM = [7, 2, 10, 0, 5, 11, 3, 8, 1, 9, 4, 6]
BASE = torch.empty(12, dtype=torch.float64)
BASE[_PERM] = torch.tensor(_SORTED, dtype=torch.float64)
VOCAB = BASE.numel()

PLAIN = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)]
TOP_K_TOP_P = [
    SamplingParams(top_k=4),
    SamplingParams(top_p=0.75),
    SamplingParams(top_k=5, top_p=0.6, temperature=1.2),  # top-p after top-k's renormalisation
]
MIN_P = [
    SamplingParams(min_p=0.3),
    SamplingParams(min_p=0.3, top_k=3),
    SamplingParams(min_p=0.45, top_p=0.9, temperature=1.5),
]


def expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The documented pipeline in float64 for one row: temperature, top-k, top-p, min-p, renormalise."""
    probs = torch.softmax(logits.double().cpu() / p.temperature, -1)
    if p.top_k > 0:
        probs = probs * (probs >= probs.sort(descending=True).values[p.top_k - 1])
        probs /= probs.sum()
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = (sorted_p.cumsum(0) - sorted_p) < p.top_p
        probs = probs * keep
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = probs * (probs >= p.min_p * probs.max())
        probs /= probs.sum()
    return probs


def flashinfer_sampler(seed: int = 0) -> Sampler:
    return Sampler(generator=torch.Generator(device=DEV).manual_seed(seed), backend="flashinfer")


@pytest.mark.parametrize(
    "cases", [PLAIN, PLAIN + TOP_K_TOP_P, PLAIN + TOP_K_TOP_P + MIN_P], ids=["plain", "top_k_top_p", "min_p"]
)
def test_empirical_distribution_matches_the_renormalised_one(cases):
    draws = 40_000
    params = [cases[i % len(cases)] for i in range(draws * len(cases))]
    logits = BASE.log().float().to(DEV).expand(len(params), -1).contiguous()
    info = SamplingInfo.from_params(params, [0] * len(params), DEV)
    out = flashinfer_sampler()(logits, info)
    assert out.dtype == torch.int64 and out.device == logits.device
    out = out.cpu()
    for c, p in enumerate(cases):
        tokens = out[c :: len(cases)]
        freq = torch.bincount(tokens, minlength=VOCAB).double() / tokens.numel()
        want = expected_probs(BASE.log(), p)
        assert (freq[want == 0] == 0).all(), (p, freq)  # a filtered token is never drawn
        tv = 0.5 * (freq - want).abs().sum().item()
        assert tv < 0.015, (p, tv, freq, want)


def test_auto_backend_picks_flashinfer_on_cuda():
    assert Sampler().uses_flashinfer(torch.zeros(1, 8, device=DEV))
    assert not Sampler().uses_flashinfer(torch.zeros(1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_the_argmax(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(300, 5000, generator=gen) * 3).to(DEV, dtype)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, temperature=1.5),
        SamplingParams(),
        SamplingParams(top_k=50, top_p=0.9),
        SamplingParams(min_p=0.1, seed=4),
    ]
    params = [kinds[i % len(kinds)] for i in range(300)]
    info = SamplingInfo.from_params(params, [0] * 300, DEV)
    out = flashinfer_sampler()(logits, info)
    greedy = torch.tensor([i % len(kinds) < 2 for i in range(300)], device=DEV)
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])


@pytest.mark.parametrize(
    "seeded",
    [
        SamplingParams(temperature=1.3, seed=1234),
        SamplingParams(temperature=0.8, top_k=200, top_p=0.7, min_p=0.01, seed=-5),
    ],
)
def test_seeded_rows_reproduce_the_torch_path(seeded):
    vocab = 32_000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(6)).to(DEV) * 2
    alone = Sampler(backend="torch")(row.unsqueeze(0), SamplingInfo.from_params([seeded], [7], DEV))
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5),
        SamplingParams(seed=9),
    ]
    for size, pos in ((2, 1), (7, 0), (33, 17)):
        logits = torch.randn(size, vocab, generator=torch.Generator().manual_seed(size)).to(DEV)
        logits[pos] = row
        params = [others[i % len(others)] for i in range(size)]
        params[pos] = seeded
        steps = list(range(size))
        steps[pos] = 7
        info = SamplingInfo.from_params(params, steps, DEV)
        out = flashinfer_sampler(seed=size)(logits, info)
        ref = Sampler(generator=torch.Generator(device=DEV).manual_seed(99), backend="torch")(logits, info)
        assert out[pos] == alone[0]
        for i, p in enumerate(params):
            if p.seed is not None:
                assert out[i] == ref[i]


def test_masked_vocab_is_never_sampled():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3000, 64, generator=gen) * 5
    masked = torch.rand(3000, 64, generator=gen) < 0.7
    masked[:, 0] = False
    logits = logits.masked_fill(masked, float("-inf")).to(DEV)
    original = logits.clone()
    for params in (SamplingParams(), SamplingParams(top_k=5, top_p=0.9), SamplingParams(min_p=0.2)):
        info = SamplingInfo.from_params([params] * 3000, [0] * 3000, DEV)
        out = flashinfer_sampler()(logits, info)
        assert not masked.to(DEV).gather(1, out.unsqueeze(1)).any()
    assert torch.equal(logits, original)


def test_unseeded_rows_follow_the_generator():
    logits = torch.zeros(64, 1000, device=DEV)
    info = SamplingInfo.from_params([SamplingParams(top_k=500)] * 64, [0] * 64, DEV)
    a, b, c = (flashinfer_sampler(seed)(logits, info) for seed in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_parameters_move_in_two_pinned_copies():
    params = [SamplingParams(top_k=5, seed=1), SamplingParams(temperature=0.0), SamplingParams(min_p=0.1)]
    info = SamplingInfo.from_params(params, [0, 0, 0], DEV)
    floats, ints = info.host_buffers
    assert floats.is_pinned() and ints.is_pinned()
    float_fields = (info.temperatures, info.top_ps, info.min_ps)
    int_fields = (info.top_ks, info.seeded_index)
    for fields in (float_fields, int_fields):
        assert all(f.is_cuda for f in fields)
        assert len({f.untyped_storage().data_ptr() for f in fields}) == 1
    assert info.top_ks.tolist() == [5, -1, -1] and info.is_greedy.tolist() == [False, True, False]
    assert info.seeded_index.tolist() == [0]
    greedy = SamplingInfo.from_params([SamplingParams(temperature=0.0)] * 3, [0] * 3, DEV)
    assert greedy.temperatures is None and greedy.host_buffers == () and len(greedy) == 3
