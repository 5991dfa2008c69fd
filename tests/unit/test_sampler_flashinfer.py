"""The Sampler's flashinfer path (its glue, against a CPU stand-in for flashinfer.sampling) and the
choice between the flashinfer and torch backends. The torch path is in test_sampler.py."""

import pytest
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo
from tests.helpers.sampler import sample


# ------------------------------------------------------------------ flashinfer glue (CPU stand-in)
class StandInFlashinferSampling:
    """A stand-in for the GPU library ``flashinfer.sampling``, NOT flashinfer itself: its five functions
    follow the documented contracts (float32 probs [B, V]; int32 top_k in [1, V], V = off; float32 top_p in
    (0, 1], 1.0 = off; float32 min_p, 0.0 = off; int32 tokens out) in plain torch on CPU, check the arguments
    they get and record every call. It tests our glue, not flashinfer's kernels (tests/gpu does that)."""

    def __init__(self):
        self.calls = []

    def _check_probs(self, probs):
        assert probs.dtype == torch.float32 and probs.dim() == 2
        assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[0]), atol=1e-4)

    def _check_vector(self, t, probs, dtype, low, high):
        assert t.dtype == dtype and t.shape == (probs.shape[0],)
        assert ((t >= low) & (t <= high)).all(), t

    def _renorm(self, probs, keep):
        kept = probs * keep
        return kept / kept.sum(-1, keepdim=True)

    def _sample(self, probs, generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(torch.int32)

    def top_k_renorm_probs(self, probs, top_k):
        self.calls.append(("top_k_renorm_probs", probs.clone(), top_k.clone()))
        self._check_probs(probs)
        self._check_vector(top_k, probs, torch.int32, 1, probs.shape[1])
        kth = probs.sort(-1, descending=True).values.gather(1, top_k.long().unsqueeze(1) - 1)
        return self._renorm(probs, probs >= kth)

    def top_p_renorm_probs(self, probs, top_p):
        self.calls.append(("top_p_renorm_probs", probs.clone(), top_p.clone()))
        self._check_probs(probs)
        self._check_vector(top_p, probs, torch.float32, 1e-9, 1.0)
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p.unsqueeze(1)
        keep_sorted[:, 0] = True
        return self._renorm(probs, torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted))

    def min_p_sampling_from_probs(self, probs, min_p, deterministic=True, generator=None):
        self.calls.append(("min_p_sampling_from_probs", probs.clone(), min_p.clone()))
        self._check_probs(probs)
        self._check_vector(min_p, probs, torch.float32, 0.0, 1.0)
        keep = probs >= min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        return self._sample(self._renorm(probs, keep), generator)

    def top_k_top_p_sampling_from_probs(
        self, probs, top_k, top_p, filter_apply_order="top_k_first", deterministic=True, generator=None
    ):
        self.calls.append(("top_k_top_p_sampling_from_probs", probs.clone(), top_k.clone(), top_p.clone()))
        assert filter_apply_order == "top_k_first"  # top-p over the top-k-renormalised distribution
        n = len(self.calls)
        probs = self.top_p_renorm_probs(self.top_k_renorm_probs(probs, top_k), top_p)
        del self.calls[n:]  # the inner steps are part of this one call
        return self._sample(probs, generator)

    def sampling_from_probs(self, probs, deterministic=True, generator=None):
        self.calls.append(("sampling_from_probs", probs.clone()))
        self._check_probs(probs)
        return self._sample(probs, generator)


def stand_in_sample(logits, params, steps=None, generator_seed=0):
    fi = StandInFlashinferSampling()
    steps = [0] * len(params) if steps is None else steps
    info = SamplingInfo.from_params(params, steps, logits.device)
    gen = torch.Generator().manual_seed(generator_seed)
    sampler = Sampler(generator=gen, backend="flashinfer", flashinfer_module=fi)
    assert sampler.uses_flashinfer(logits)
    out = sampler(logits, info)
    assert out.dtype == torch.int64 and out.shape == (logits.shape[0],)
    return out, fi.calls


def test_flashinfer_glue_greedy_rows_are_the_argmax():
    logits = torch.randn(60, 300, generator=torch.Generator().manual_seed(20)) * 3
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=1.5),
        SamplingParams(top_k=40, top_p=0.9),
        SamplingParams(min_p=0.05),
    ]
    params = [kinds[i % len(kinds)] for i in range(60)]
    out, calls = stand_in_sample(logits, params)
    greedy = torch.tensor([i % len(kinds) < 2 for i in range(60)])
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert not torch.equal(out[~greedy], logits.argmax(-1)[~greedy])  # the other rows really sample
    assert [c[0] for c in calls] == ["top_k_renorm_probs", "top_p_renorm_probs", "min_p_sampling_from_probs"]


@pytest.mark.parametrize(
    "seeded",
    [
        SamplingParams(temperature=1.3, seed=1234),
        SamplingParams(temperature=0.8, top_k=200, top_p=0.7, min_p=0.01, seed=-5),
        SamplingParams(top_p=0.6, seed=7),
    ],
)
def test_flashinfer_glue_seeded_rows_match_the_torch_path(seeded):
    vocab = 2000
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
        SamplingParams(seed=99),
    ]
    for size, pos in ((1, 0), (5, 2), (9, 8)):
        logits = torch.randn(size, vocab, generator=torch.Generator().manual_seed(size)) * 2
        params = [others[i % len(others)] for i in range(size)]
        params[pos] = seeded
        steps = list(range(3, 3 + size))
        out, _ = stand_in_sample(logits, params, steps, generator_seed=size)
        ref = sample(logits, params, steps, generator_seed=size + 100)  # the torch path, other generator
        for row, p in enumerate(params):
            if p.seed is not None or p.temperature == 0.0:
                assert out[row] == ref[row], (size, row)


def test_flashinfer_glue_passes_off_encodings_and_dtypes():
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(21))
    params = [
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(),  # every filter off
        SamplingParams(temperature=2.0, top_p=0.5, top_k=vocab + 10),  # top_k past the vocabulary
        SamplingParams(temperature=0.0),
    ]
    _, calls = stand_in_sample(logits, params)
    [(name, probs, top_k, top_p)] = calls
    assert name == "top_k_top_p_sampling_from_probs"
    temps = torch.tensor([0.5, 1.0, 2.0, 1.0]).unsqueeze(1)
    assert torch.allclose(probs, torch.softmax(logits / temps, -1))
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, vocab, vocab, vocab]
    assert top_p.dtype == torch.float32 and top_p.tolist() == [1.0, 1.0, 0.5, 1.0]

    params[0] = SamplingParams(top_k=5, min_p=0.2)
    _, calls = stand_in_sample(logits, params)
    assert [c[0] for c in calls] == ["top_k_renorm_probs", "top_p_renorm_probs", "min_p_sampling_from_probs"]
    assert calls[0][2].tolist() == [5, vocab, vocab, vocab]
    assert calls[1][2].tolist() == [1.0, 1.0, 0.5, 1.0]
    min_p = calls[2][2]
    assert min_p.dtype == torch.float32 and torch.allclose(min_p, torch.tensor([0.2, 0.0, 0.0, 0.0]))

    _, calls = stand_in_sample(logits[:2], [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)])
    [(name, probs)] = calls
    assert name == "sampling_from_probs"
    assert torch.allclose(probs, torch.softmax(logits[:2] / torch.tensor([[0.7], [1.0]]), -1))


def test_flashinfer_glue_top_k_one_and_tiny_top_p_rows_are_the_argmax():
    logits = torch.randn(200, 100, generator=torch.Generator().manual_seed(22)) * 2
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, min_p=0.3)] * 66
    params += [SamplingParams(top_k=2)] * 2
    out, _ = stand_in_sample(logits, params)
    assert torch.equal(out[:198], logits[:198].argmax(-1))


def test_flashinfer_glue_draws_from_the_samplers_generator():
    logits = torch.zeros(64, 1000)
    params = [SamplingParams(top_k=500)] * 64
    a, _ = stand_in_sample(logits, params, generator_seed=0)
    b, _ = stand_in_sample(logits, params, generator_seed=0)
    c, _ = stand_in_sample(logits, params, generator_seed=1)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_backend_choice(monkeypatch):
    import radixserve.scheduler.model.sampler as sampler_mod

    attempts = []

    def no_flashinfer():
        attempts.append(1)
        raise ModuleNotFoundError("No module named 'flashinfer'")

    monkeypatch.setattr(sampler_mod, "_load_flashinfer_sampling", no_flashinfer)
    with pytest.raises(ValueError):
        Sampler(backend="triton")
    with pytest.raises(ModuleNotFoundError):
        Sampler(backend="flashinfer")
    logits = torch.randn(3, 20)
    info = SamplingInfo.from_params([SamplingParams(top_k=4)] * 3, [0] * 3, "cpu")
    # auto: CPU logits take the torch path without trying to import flashinfer, even with a module given.
    attempts.clear()
    fi = StandInFlashinferSampling()
    for sampler in (Sampler(), Sampler(flashinfer_module=fi), Sampler(backend="torch", flashinfer_module=fi)):
        assert not sampler.uses_flashinfer(logits)
        sampler(logits, info)
    assert attempts == [] and fi.calls == []
