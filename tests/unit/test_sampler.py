"""The Sampler's torch path: greedy, top-k, top-p, min-p, temperature, per-request seeds, and how
parameters reach the device. The flashinfer path is in test_sampler_flashinfer.py (it checks its
seeded rows against :func:`sample` from here)."""

import pytest
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo
from tests.helpers.sampler import sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def freqs(tokens, vocab):
    return torch.bincount(tokens.cpu(), minlength=vocab).double() / tokens.numel()


def logits_for(probs, rows, device="cpu"):
    return torch.tensor(probs, dtype=torch.float32, device=device).log().expand(rows, -1).contiguous()


def support(tokens):
    return set(tokens.unique().tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_picks_argmax_per_row(device):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1)).to(device)
    out = sample(logits, SamplingParams(temperature=0.0))
    assert torch.equal(out, logits.argmax(-1))


def test_all_greedy_fast_path_does_not_consume_randomness():
    logits = torch.randn(4, 10)
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    info = SamplingInfo.from_params([SamplingParams(temperature=0.0)] * 4, [0] * 4, "cpu")
    assert info.all_greedy
    Sampler(generator=gen)(logits, info)
    assert torch.equal(gen.get_state(), before)


def test_mixed_batch_greedy_and_sampled_rows():
    rows = 400
    logits = torch.zeros(rows, 50)
    logits[:, 7] = 0.5  # argmax 7, but a sampled row picks it only ~3% of the time
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams() for i in range(rows)]
    out = sample(logits, params)
    assert (out[0::2] == 7).all()
    sampled = out[1::2]
    assert (sampled != 7).sum() > 150
    assert len(support(sampled)) > 30


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(2))
    out = sample(logits, SamplingParams(temperature=1.5, top_k=1))
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_stays_inside_the_k_largest(device):
    base = torch.randn(30, generator=torch.Generator().manual_seed(3))
    logits = base.expand(5000, -1).contiguous().to(device)
    out = sample(logits, SamplingParams(temperature=2.0, top_k=4))
    assert support(out) == set(base.topk(4).indices.tolist())


def test_top_k_rows_do_not_affect_other_rows():
    probs = [0.05, 0.2, 0.1, 0.05, 0.15, 0.05, 0.1, 0.1, 0.1, 0.1]
    logits = logits_for(probs, 4000)
    params = [SamplingParams(top_k=2) if i % 2 else SamplingParams(top_k=-1) for i in range(4000)]
    out = sample(logits, params)
    assert support(out[1::2]) == {1, 4}
    assert support(out[0::2]) == set(range(10))


def test_tiny_top_p_is_top_one():
    logits = torch.randn(2000, 40, generator=torch.Generator().manual_seed(4))
    out = sample(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_keeps_exactly_the_nucleus(device):
    # sorted 0.5, 0.3, 0.15 | 0.04, 0.01; mass before each 0, .5, .8 | .95, .99: top_p=0.9 keeps 3
    probs = [0.04, 0.3, 0.01, 0.5, 0.15]
    out = sample(logits_for(probs, 20000, device), SamplingParams(top_p=0.9))
    assert support(out) == {1, 3, 4}
    expected = torch.tensor([0, 0.3, 0, 0.5, 0.15], dtype=torch.float64) / 0.95
    assert (freqs(out, 5) - expected).abs().max() < 0.02


@pytest.mark.parametrize("candidates", [None, 2, 3, 1024])
def test_top_p_nucleus_in_a_large_vocab_whatever_the_candidate_count(candidates):
    # 0.3, 0.25, 0.2, 0.15 then 0.1 spread over 1996 tokens; top_p=0.85 keeps the first four.
    # candidates=2/3: the nucleus reaches past them, so those rows take the full-sort fallback.
    probs = torch.full((2000,), 0.1 / 1996)
    big = torch.tensor([1500, 3, 777, 42])
    probs[big] = torch.tensor([0.3, 0.25, 0.2, 0.15])
    logits = probs.log().expand(3000, -1).contiguous()
    out = sample(logits, SamplingParams(top_p=0.85), candidates=candidates)
    assert support(out) == set(big.tolist())


def test_top_p_candidate_path_matches_full_sort():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(300, 500, generator=gen) * torch.linspace(0.5, 6.0, 300).unsqueeze(1)
    params = [
        SamplingParams(top_p=tp, top_k=tk, min_p=mp)
        for tp, tk, mp in zip(
            torch.rand(300, generator=gen).clamp(0.05, 1.0).tolist(),
            [-1, 20, -1, 300, -1] * 60,
            [0.0, 0.0, 0.01, 0.0, 0.0, 0.1] * 50,
            strict=True,
        )
    ]
    full = sample(logits, params, candidates=None)
    for candidates in (1, 8, 64):  # mixes rows whose nucleus fits the candidates with rows that fall back
        assert torch.equal(sample(logits, params, candidates=candidates), full)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top_k=2 renormalises 0.5/0.3 to 0.625/0.375; top_p=0.55 then keeps only the top token
    # (on the raw distribution the second token would start at mass 0.5 < 0.55 and survive).
    probs = [0.04, 0.3, 0.01, 0.5, 0.15]
    out = sample(logits_for(probs, 3000), SamplingParams(top_k=2, top_p=0.55))
    assert support(out) == {3}
    out = sample(logits_for(probs, 3000), SamplingParams(top_k=3, top_p=0.9))
    assert support(out) == {1, 3, 4}


def test_top_p_rows_do_not_affect_other_rows():
    probs = [0.04, 0.3, 0.01, 0.5, 0.15]
    params = [SamplingParams(top_p=0.45) if i % 2 else SamplingParams() for i in range(20000)]
    out = sample(logits_for(probs, 20000), params)
    assert support(out[1::2]) == {3}
    assert (freqs(out[0::2], 5) - torch.tensor(probs, dtype=torch.float64)).abs().max() < 0.02


def test_min_p_keeps_exactly_the_expected_tokens():
    # threshold 0.25 * 0.4 = 0.1: keeps 0.4, 0.3, 0.2; drops 0.08, 0.02
    probs = [0.08, 0.4, 0.02, 0.2, 0.3]
    out = sample(logits_for(probs, 5000), SamplingParams(min_p=0.25))
    assert support(out) == {1, 3, 4}
    params = [SamplingParams(min_p=0.6) if i % 2 else SamplingParams() for i in range(5000)]
    out = sample(logits_for(probs, 5000), params)
    assert support(out[1::2]) == {1, 4}
    assert support(out[0::2]) == set(range(5))


@pytest.mark.parametrize("device", DEVICES)
def test_unfiltered_frequencies_match_softmax(device):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5], device=device).expand(20000, -1).contiguous()
    out = sample(logits, SamplingParams(temperature=1.0))
    assert (freqs(out, 5) - torch.softmax(logits[0].double().cpu(), -1)).abs().max() < 0.02


def test_temperature_scaling_flattens_or_sharpens():
    base = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    logits = base.expand(20000, -1).contiguous()
    top_freq = []
    for t in (0.5, 1.0, 2.0):
        f = freqs(sample(logits, SamplingParams(temperature=t)), 5)
        assert (f - torch.softmax(base.double() / t, -1)).abs().max() < 0.02
        top_freq.append(f[3].item())
    assert top_freq[0] > top_freq[1] + 0.1 > top_freq[2] + 0.2


def test_seeded_rows_follow_the_distribution():
    probs = [0.1, 0.2, 0.4, 0.25, 0.05]
    params = [SamplingParams(seed=s) for s in range(6000)]
    out = sample(logits_for(probs, 6000), params, steps=[3] * 6000)
    assert (freqs(out, 5) - torch.tensor(probs, dtype=torch.float64)).abs().max() < 0.03


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "seeded",
    [
        SamplingParams(temperature=1.3, seed=1234),
        SamplingParams(temperature=0.8, top_k=200, top_p=0.7, min_p=0.01, seed=-5),
    ],
)
def test_seeded_token_is_independent_of_batch_position_size_and_composition(device, seeded):
    vocab = 3000  # > the default top-p candidates, so other rows take both top-p paths
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(6)).to(device) * 2
    alone = sample(row.unsqueeze(0), [seeded], steps=[7])
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5),
        SamplingParams(top_p=0.99, temperature=2.0),
        SamplingParams(top_k=3),
        SamplingParams(min_p=0.2),
        SamplingParams(seed=99),
    ]
    for size, pos in ((2, 1), (7, 0), (7, 6), (33, 17)):
        logits = torch.randn(size, vocab, generator=torch.Generator().manual_seed(size)).to(device)
        logits[pos] = row
        params = [others[i % len(others)] for i in range(size)]
        params[pos] = seeded
        steps = list(range(size))
        steps[pos] = 7
        for gen_seed in (0, 1):
            out = sample(logits, params, steps, generator_seed=gen_seed)
            assert out[pos] == alone[0]
    torch.manual_seed(42)
    info = SamplingInfo.from_params([seeded], [7], device)
    assert Sampler()(row.unsqueeze(0), info)[0] == alone[0]


def test_seeded_steps_and_seeds_give_different_draws():
    logits = torch.zeros(1, 1000)
    by_step = [sample(logits, [SamplingParams(seed=5)], steps=[s]).item() for s in range(6)]
    assert len(set(by_step)) > 1
    by_seed = [sample(logits, [SamplingParams(seed=s)], steps=[0]).item() for s in range(6)]
    assert len(set(by_seed)) > 1
    again = [sample(logits, [SamplingParams(seed=5)], steps=[s]).item() for s in range(6)]
    assert again == by_step


def test_unseeded_rows_are_random_across_calls():
    logits = torch.zeros(8, 1000)
    a = sample(logits, SamplingParams(), generator_seed=0)
    b = sample(logits, SamplingParams(), generator_seed=1)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1e-5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=50),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=1e-5, top_k=5, top_p=0.3, min_p=0.1, seed=3),
    ],
)
def test_masked_vocab_is_never_sampled(device, params):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3000, 64, generator=gen) * 5
    masked = torch.rand(3000, 64, generator=gen) < 0.7
    masked[:, 0] = False  # every row keeps at least one token
    logits = logits.masked_fill(masked, float("-inf")).to(device)
    original = logits.clone()
    out = sample(logits, params)
    assert not masked.to(device).gather(1, out.unsqueeze(1)).any()
    assert torch.equal(logits, original)  # the caller's logits are not modified


@pytest.mark.parametrize("temperature", [1e-5, 1.0])
def test_all_equal_logits_and_tiny_temperature(temperature):
    out = sample(torch.full((4000, 8), 3.0), SamplingParams(temperature=temperature, top_p=0.95))
    assert support(out) == set(range(8))
    logits = torch.randn(500, 300, generator=torch.Generator().manual_seed(8)) * 3
    out = sample(logits, SamplingParams(temperature=1e-5))
    assert torch.equal(out, logits.argmax(-1))


def test_half_precision_logits():
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(top_k=5, top_p=0.9), SamplingParams(temperature=0.0)] * 100)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))
    fifth = logits[0::2].float().topk(5).values[:, -1]  # bf16 ties at the boundary are kept
    assert (logits[0::2].float().gather(1, out[0::2].unsqueeze(1)).squeeze(1) >= fifth).all()


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError):
        SamplingInfo.from_params([SamplingParams()], [0, 1], "cpu")
    info = SamplingInfo.from_params([SamplingParams()] * 2, [0, 0], "cpu")
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(3, 10), info)


# ------------------------------------------------------------------ parameter transfer
def test_all_greedy_batch_builds_no_tensors():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, seed=3)] * 3
    info = SamplingInfo.from_params(params, [0] * 6, "cpu")
    assert info.all_greedy and len(info) == 6 and info.seeded_rows == []
    fields = (info.temperatures, info.top_ks, info.top_ps, info.min_ps, info.is_greedy, info.seeded_index)
    assert all(f is None for f in fields) and info.host_buffers == ()
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, info), logits.argmax(-1))
    empty = SamplingInfo.from_params([], [], "cpu")
    assert len(empty) == 0 and Sampler()(torch.zeros(0, 5), empty).shape == (0,)


def test_mixed_batch_moves_its_parameters_in_two_packed_arrays():
    params = [
        SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8, min_p=0.1),
        SamplingParams(seed=9),
    ]
    info = SamplingInfo.from_params(params, [4, 0, 0, 2], "cpu")
    floats, ints = info.host_buffers
    assert floats.dtype == torch.float32 and floats.shape == (12,)
    assert ints.dtype == torch.int64 and ints.shape == (4 + 4 + 2,)
    # On CPU every field is a view of one of the two packed arrays: no per-field tensor, no copy.
    for field, packed in (
        (info.temperatures, floats),
        (info.top_ps, floats),
        (info.min_ps, floats),
        (info.top_ks, ints),
        (info.seeded_index, ints),
    ):
        assert field.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert info.temperatures.shape == (4, 1) and info.temperatures.dtype == torch.float32
    assert torch.equal(info.temperatures.squeeze(1), torch.tensor([0.7, 1.0, 1.0, 1.0]))
    assert info.top_ks.tolist() == [5, -1, -1, -1]
    assert torch.allclose(info.top_ps, torch.tensor([1.0, 1.0, 0.8, 1.0]))
    assert torch.allclose(info.min_ps, torch.tensor([0.0, 0.0, 0.1, 0.0]))
    assert info.is_greedy.tolist() == [False, True, False, False]
    assert info.seeded_index.tolist() == [0, 3] == [r for r, _ in info.seeded_rows]
    assert (info.max_top_k, info.need_top_p, info.need_min_p) == (5, True, True)
    assert not info.all_greedy and info.any_greedy and len(info) == 4
