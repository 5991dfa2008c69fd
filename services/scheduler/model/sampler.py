"""Batched token sampler that runs where the logits are (CPU or CUDA), one row per request.

Per-row pipeline, in this order (the HF ``generate`` / vLLM order):

1. greedy rows (``temperature == 0`` or ``top_k == 1``): ``argmax`` of the raw logits. A batch where every
   row is greedy takes a fast path: one ``argmax``, nothing else.
2. temperature: ``logits / temperature``.
3. top-k: drop tokens whose logit is below the k-th largest (ties at the boundary are kept, as in HF).
4. top-p (nucleus): over the distribution renormalised after top-k, keep the smallest prefix of the sorted
   tokens whose cumulative probability reaches ``top_p``; the top token is always kept.
5. min-p: drop tokens whose probability is below ``min_p * max_prob`` (done in logit space as
   ``logit < max_logit + log(min_p)``; the max token survives every earlier filter, so the order of the
   filters does not matter for min-p).
6. softmax over what is left and sample with the exponential race: ``argmax(probs / E)`` with
   ``E = -log(U) ~ Exponential(1)`` i.i.d. per token, which picks token ``i`` with probability ``probs[i]``.

Rows whose filter is off (``top_k=-1``, ``top_p=1``, ``min_p=0``) are untouched by it; the filters run only
when some sampled row in the batch uses them.

Seeds: a row with ``SamplingParams.seed`` draws its noise from its own ``torch.Generator`` seeded with a hash
of ``(seed, step)``, ``step`` being the number of tokens the request has generated so far. Each row's
computation depends only on its own logits and parameters, so a seeded request yields the same tokens in
whatever batch, batch position or step schedule it runs. Unseeded rows use the sampler's generator (the
global RNG when it has none).

Backends: the pipeline above is the ``torch`` path, used on CPU and when flashinfer is missing. On CUDA,
when the ``flashinfer`` package imports, the unseeded sampled rows go through flashinfer's sampling kernels
instead (rejection sampling: no sort of the vocabulary). They get ``probs = softmax(logits / temperature)``,
then ``top_k_top_p_sampling_from_probs(..., filter_apply_order="top_k_first")`` (top-p over the
top-k-renormalised distribution, the order above; ``"joint"`` would measure top-p on the raw distribution),
or, when some row uses min-p, ``top_k_renorm_probs`` -> ``top_p_renorm_probs`` ->
``min_p_sampling_from_probs``. The kernels draw from the sampler's generator: same distributions as the
torch path, not the same tokens. Seeded rows always take the torch path (run over just those rows), so a
seed yields the same tokens whichever backend samples its batch; greedy rows are the argmax of the raw
logits on both.

Transfers: ``SamplingInfo.from_params`` runs every engine step, so it moves the parameters in two copies, not
one per field: the float fields packed into one float32 array, the integer ones into one int64 array, each
copied once, non-blocking, from pinned memory (on CPU the fields are views of the arrays: no copy at all).
An all-greedy batch builds no tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.model.staging import to_device

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
BACKENDS = ("auto", "torch", "flashinfer")


def step_seed(seed: int, step: int) -> int:
    """Mix a request seed and its decode step into a 64-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 1_000_003 + step + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingInfo:
    """One batch's sampling parameters as device tensors (one row per request) plus host-side flags.

    The tensor fields are ``None`` when every row is greedy (nothing to sample, so nothing is built).
    Otherwise the float fields are views of one packed float32 device tensor and the integer fields of one
    packed int64 device tensor (``host_buffers``: their host sources, pinned on CUDA).
    """

    batch_size: int
    temperatures: torch.Tensor | None  # [B, 1] float32; 1.0 on greedy rows so the division is harmless
    top_ks: torch.Tensor | None  # [B] int64; -1 = off (also on greedy rows)
    top_ps: torch.Tensor | None  # [B] float32; 1.0 = off
    min_ps: torch.Tensor | None  # [B] float32; 0.0 = off
    is_greedy: torch.Tensor | None  # [B] bool
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # largest top_k among sampled rows with top-k on; 0 when none
    need_top_p: bool
    need_min_p: bool
    seeded_rows: list[tuple[int, int]]  # (row, generator seed) for sampled rows that carry a seed
    seeded_index: torch.Tensor | None = None  # [S] int64 on the device: the rows of seeded_rows, in order
    host_buffers: tuple[torch.Tensor, ...] = ()  # the packed host arrays (pinned on CUDA)

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], steps: Sequence[int], device: torch.device | str
    ) -> SamplingInfo:
        if len(params) != len(steps):
            raise ValueError(f"{len(params)} sampling params but {len(steps)} steps")
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        greedy: list[bool] = []
        seeded: list[tuple[int, int]] = []
        for i, (p, step) in enumerate(zip(params, steps, strict=True)):
            g = p.temperature <= 0.0 or p.top_k == 1
            greedy.append(g)
            if g:
                temps.append(1.0)
                top_ks.append(-1)
                top_ps.append(1.0)
                min_ps.append(0.0)
                continue
            temps.append(float(p.temperature))
            top_ks.append(int(p.top_k) if p.top_k > 0 else -1)
            top_ps.append(float(p.top_p) if p.top_p < 1.0 else 1.0)
            min_ps.append(float(p.min_p) if p.min_p > 0.0 else 0.0)
            if p.seed is not None:
                seeded.append((i, step_seed(int(p.seed), int(step))))
        n = len(params)
        if all(greedy):
            # The sampler takes one argmax; any tensor built here would be a wasted host->device copy.
            return cls(
                batch_size=n,
                temperatures=None,
                top_ks=None,
                top_ps=None,
                min_ps=None,
                is_greedy=None,
                all_greedy=True,
                any_greedy=n > 0,
                max_top_k=0,
                need_top_p=False,
                need_min_p=False,
                seeded_rows=[],
            )
        floats = torch.from_numpy(np.array(temps + top_ps + min_ps, dtype=np.float32))
        ints = torch.from_numpy(np.array(top_ks + greedy + [r for r, _ in seeded], dtype=np.int64))
        dev = torch.device(device)
        floats, dev_floats = to_device(floats, dev)  # pinned and non-blocking on CUDA (model/staging.py)
        ints, dev_ints = to_device(ints, dev)
        return cls(
            batch_size=n,
            temperatures=dev_floats[:n].view(n, 1),
            top_ks=dev_ints[:n],
            top_ps=dev_floats[n : 2 * n],
            min_ps=dev_floats[2 * n :],
            is_greedy=dev_ints[n : 2 * n].bool(),  # a device-side cast, not another transfer
            all_greedy=False,
            any_greedy=any(greedy),
            max_top_k=max((k for k in top_ks if k > 0), default=0),
            need_top_p=any(tp < 1.0 for tp in top_ps),
            need_min_p=any(mp > 0.0 for mp in min_ps),
            seeded_rows=seeded,
            seeded_index=dev_ints[2 * n :] if seeded else None,
            # Referenced here so the pinned sources outlive the asynchronous copies that read them.
            host_buffers=(floats, ints),
        )

    def __len__(self) -> int:
        return self.batch_size


class Sampler:
    """``sampler(logits [B, V], info) -> token ids [B] int64`` on the logits' device.

    ``generator`` drives the unseeded rows (``None``: the global RNG of the logits' device).
    ``top_p_candidates``: on CPU, top-p first looks for each row's nucleus among its this-many largest
    tokens (one ``topk``, much cheaper than sorting the vocabulary there) and fully sorts only the rows
    whose nucleus reaches past them. ``None``, or CUDA logits, always sort (no host sync on the GPU).
    ``backend``: ``"auto"`` samples CUDA logits with flashinfer's kernels when flashinfer imports (tried
    once, on the first CUDA batch) and everything else with torch; ``"torch"`` always uses torch;
    ``"flashinfer"`` always uses flashinfer (it must import: checked here).
    ``flashinfer_module``: the ``flashinfer.sampling`` module to use instead of importing it (tests pass a
    stand-in with the same functions).
    """

    def __init__(
        self,
        generator: torch.Generator | None = None,
        top_p_candidates: int | None = 1024,
        backend: str = "auto",
        flashinfer_module: ModuleType | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"sampler backend must be one of {BACKENDS}, got {backend!r}")
        self.generator = generator
        self.top_p_candidates = top_p_candidates
        self.backend = backend
        self._flashinfer = flashinfer_module
        # Imported lazily: importing radixserve, or sampling on CPU, never needs flashinfer.
        self._flashinfer_resolved = flashinfer_module is not None or backend == "torch"
        if backend == "flashinfer" and flashinfer_module is None:
            self._flashinfer = _load_flashinfer_sampling()
            self._flashinfer_resolved = True

    def uses_flashinfer(self, logits: torch.Tensor) -> bool:
        """Whether sampling these logits goes through flashinfer's kernels."""
        return self._kernels(logits) is not None

    def __call__(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(info):
            raise ValueError(f"logits must be [{len(info)}, V], got {tuple(logits.shape)}")
        if info.all_greedy:
            return logits.argmax(dim=-1)
        kernels = self._kernels(logits)
        if kernels is None or len(info.seeded_rows) == len(info):
            return self._sample_torch(logits, info)
        return self._sample_flashinfer(kernels, logits, info)

    def _kernels(self, logits: torch.Tensor) -> ModuleType | None:
        """The flashinfer sampling module for these logits, or None for the torch path."""
        if self.backend == "torch" or (self.backend == "auto" and not logits.is_cuda):
            return None
        if not self._flashinfer_resolved:
            self._flashinfer_resolved = True
            try:
                self._flashinfer = _load_flashinfer_sampling()
            except Exception as e:  # not installed, or built for another CUDA / torch
                log.info("flashinfer sampling unavailable (%r); sampling with torch", e)
        return self._flashinfer

    def _sample_flashinfer(self, fi: ModuleType, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        assert info.temperatures is not None and info.top_ks is not None and info.is_greedy is not None
        vocab = logits.shape[1]
        probs = torch.softmax(torch.div(logits, info.temperatures).float(), dim=-1)
        # flashinfer wants int32 top_k with "off" as the whole vocabulary (ours: -1).
        top_ks = torch.where(info.top_ks > 0, info.top_ks.clamp(max=vocab), vocab).to(torch.int32)
        if info.need_min_p:
            # Renormalising scales every kept probability alike, so min-p's ratio to the max is unchanged.
            if info.max_top_k > 0:
                probs = fi.top_k_renorm_probs(probs, top_ks)
            if info.need_top_p:
                probs = fi.top_p_renorm_probs(probs, info.top_ps)
            tokens = fi.min_p_sampling_from_probs(
                probs, info.min_ps, deterministic=True, generator=self.generator
            )
        elif info.max_top_k > 0 or info.need_top_p:
            tokens = fi.top_k_top_p_sampling_from_probs(
                probs,
                top_ks,
                info.top_ps,
                filter_apply_order="top_k_first",
                deterministic=True,
                generator=self.generator,
            )
        else:
            tokens = fi.sampling_from_probs(probs, deterministic=True, generator=self.generator)
        sampled: torch.Tensor = tokens.to(torch.int64)
        if info.seeded_rows:
            # The kernels' draws depend on the whole batch; a seeded row must not, so the torch path
            # (per-row generators) samples those rows again and they replace the kernel's tokens.
            idx = info.seeded_index
            sampled[idx] = self._sample_torch(logits[idx], _seeded_part(info))
        if info.any_greedy:
            sampled = torch.where(info.is_greedy, logits.argmax(dim=-1), sampled)
        return sampled

    def _sample_torch(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        assert info.temperatures is not None and info.top_ks is not None
        assert info.top_ps is not None and info.min_ps is not None
        # A new float32 tensor: the caller's logits are never modified.
        x = torch.div(logits, info.temperatures)
        if x.dtype != torch.float32:
            x = x.float()

        if info.max_top_k > 0:
            k_eff = min(info.max_top_k, x.shape[1])
            top_vals = torch.topk(x, k_eff, dim=-1, sorted=True).values
            x.masked_fill_(x < _kth_value(top_vals, info.top_ks), _NEG_INF)
        if info.need_top_p:
            self._top_p(x, info.top_ps)
        if info.need_min_p:
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); min_p = 0 gives -inf (keeps everything).
            x_max = x.max(dim=-1, keepdim=True).values
            x.masked_fill_(x < x_max + torch.log(info.min_ps).unsqueeze(1), _NEG_INF)

        probs = torch.softmax(x, dim=-1)
        # Exponential race: E = -log(U). U is clamped into (0, 1) so that E is finite and > 0: a dropped
        # token (prob 0) then scores exactly 0 and a kept one scores > 0, never 0/0 or inf/inf.
        u = torch.empty_like(probs)
        if len(info.seeded_rows) < len(info):
            u.uniform_(generator=self.generator)
        for row, seed in info.seeded_rows:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(seed)
            u[row].uniform_(generator=gen)
        noise = u.clamp_(_U_MIN, _U_MAX).log_().neg_()
        tokens = probs.div_(noise).argmax(dim=-1)
        if info.any_greedy:
            assert info.is_greedy is not None
            tokens = torch.where(info.is_greedy, logits.argmax(dim=-1), tokens)
        return tokens

    def _top_p(self, x: torch.Tensor, top_ps: torch.Tensor) -> None:
        """Nucleus filter on ``x`` (already top-k filtered) in place; rows with ``top_p == 1`` untouched.

        Which path a row takes depends only on that row, so a row's result never depends on its batch.
        """
        active = top_ps < 1.0
        probs = torch.softmax(x, dim=-1)  # renormalised after top-k
        m = self.top_p_candidates
        if x.is_cuda or m is None or m >= x.shape[1]:
            x.masked_fill_(_nucleus_drop(x, probs, top_ps) & active.unsqueeze(1), _NEG_INF)
            return
        cand_idx = torch.topk(x, m, dim=-1, sorted=True).indices
        cand_p = probs.gather(1, cand_idx)
        cum = cand_p.cumsum(dim=-1)
        keep = (cum - cand_p) < top_ps.unsqueeze(1)  # mass ahead of the token is still short of top_p
        keep[:, 0] = True
        covered = cum[:, -1] >= top_ps  # the nucleus ends among the candidates
        drop = torch.ones_like(x, dtype=torch.bool).scatter_(1, cand_idx, ~keep)
        x.masked_fill_(drop & (active & covered).unsqueeze(1), _NEG_INF)
        rest = torch.nonzero(active & ~covered).squeeze(1)
        if rest.numel():
            sub = x[rest]
            x[rest] = sub.masked_fill_(_nucleus_drop(sub, probs[rest], top_ps[rest]), _NEG_INF)


_NEG_INF = float("-inf")
_U_MIN = torch.finfo(torch.float32).tiny
_U_MAX = 1.0 - 2.0**-24  # largest float32 below 1


def _kth_value(top_desc: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """[B, 1] each row's k-th largest logit from its sorted top values; -inf where top-k is off."""
    idx = (top_ks.clamp(min=1, max=top_desc.shape[1]) - 1).unsqueeze(1)
    return top_desc.gather(1, idx).masked_fill_((top_ks <= 0).unsqueeze(1), _NEG_INF)


def _nucleus_drop(x: torch.Tensor, probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the tokens outside each row's nucleus, from one full (stable) sort per row."""
    sorted_idx = torch.sort(x, dim=-1, descending=True, stable=True).indices
    sorted_p = probs.gather(1, sorted_idx)
    drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_ps.unsqueeze(1)
    drop[:, 0] = False
    return torch.empty_like(drop).scatter_(1, sorted_idx, drop)


def _load_flashinfer_sampling() -> ModuleType:
    import flashinfer.sampling

    module: ModuleType = flashinfer.sampling
    return module


def _seeded_part(info: SamplingInfo) -> SamplingInfo:
    """The seeded rows of ``info`` as a batch of their own (row j = the j-th of ``info.seeded_rows``).

    The batch-wide filter flags are kept as they are: they only switch a filter on, and a row whose own
    parameter is off passes through that filter unchanged, so every row samples exactly as in the full batch.
    """
    assert info.seeded_index is not None and info.temperatures is not None and info.top_ks is not None
    assert info.top_ps is not None and info.min_ps is not None
    idx = info.seeded_index
    return SamplingInfo(
        batch_size=len(info.seeded_rows),
        temperatures=info.temperatures[idx],
        top_ks=info.top_ks[idx],
        top_ps=info.top_ps[idx],
        min_ps=info.min_ps[idx],
        is_greedy=None,
        all_greedy=False,
        any_greedy=False,  # only sampled rows carry a seed
        max_top_k=info.max_top_k,
        need_top_p=info.need_top_p,
        need_min_p=info.need_min_p,
        seeded_rows=[(j, seed) for j, (_, seed) in enumerate(info.seeded_rows)],
    )
