"""The gated delta rule and the short causal convolution of a Gated DeltaNet layer, in plain torch.

The reference implementation, every device and dtype (the recurrent state is float32 throughout).
Per value head the state ``S`` is a ``[Dk, Dv]`` matrix; token ``t`` with query ``q``, key ``k``
(both L2-normalised, q also scaled by ``Dk ** -0.5``), value ``v``, log-decay ``g <= 0`` and write
strength ``beta`` in (0, 1) does

    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T        (the delta rule: write only what S mispredicts)
    o  = S^T q

``recurrent_step`` is that, one token for a whole batch (decode). ``chunked`` computes the same for
one sequence ``chunk`` tokens at a time: inside a chunk the writes are condensed into a triangular
solve (the WY form: each token's corrected value ``u`` depends on the earlier tokens' in the same
chunk), so a prompt costs a few matmuls per chunk instead of a loop per token. Both start from a
given state and return the state after the last token, so a prompt may be cut into pieces anywhere
(chunked prefill, prefix snapshots) and give the same outputs up to float rounding.

The convolution is depthwise over the q/k/v channels with a window of ``K`` tokens: a request's
conv state is the ``K - 1`` inputs before its next token, channels first (``[C, K - 1]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (flash-linear-attention's size too)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g, beta ``[B, H]``, state
    ``[B, H, Dk, Dv]`` (float32) -> (output ``[B, H, Dv]``, new state); all float32."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k ``[T, H, Dk]``, v ``[T, H, Dv]``, g, beta ``[T, H]``, state ``[H, Dk, Dv]``
    -> (output ``[T, H, Dv]``, state after the last token); all float32."""
    t = q.shape[0]
    pad = (-t) % chunk  # padding tokens write nothing (beta 0) and decay nothing (g 0)

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, N, C, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.transpose(0, 1).reshape(x.shape[1], -1, chunk, *x.shape[2:])

    qc, kc, vc, gc, bc = (blocks(x) for x in (q, k, v, g, beta))
    cum = gc.cumsum(-1)  # [H, N, C]: log-decay from the chunk's start through each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (what token j's write has decayed by at token i)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = kc * bc[..., None]
    # (I + L) u = beta v - beta k exp(cum) S0, L strictly lower: solved once for the two right sides
    lower = (kb @ kc.transpose(-1, -2)) * decay
    u0 = torch.linalg.solve_triangular(lower, vc * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # within-chunk attention, causal incl. the diagonal
    q_in = qc * cum.exp()[..., None]  # queries read the state from before the chunk, decayed
    last = cum[..., -1:]  # [H, N, 1]
    k_out = kc * (last - cum).exp()[..., None]  # keys as the state at the chunk's end sees them
    out = torch.empty_like(vc)
    for n in range(qc.shape[1]):
        u = u0[:, n] - w[:, n] @ state
        out[:, n] = q_in[:, n] @ state + scores[:, n] @ u
        state = state * last[:, n, :, None].exp() + k_out[:, n].transpose(-1, -2) @ u
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :t].transpose(0, 1), state


def conv_extend(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x ``[T, C]``, state ``[C, K - 1]``, weight ``[C, K]`` -> (silu(conv) ``[T, C]``,
    the padded input ``[C, K - 1 + T]``, whose columns ``p .. p + K - 2`` are the state after
    ``p`` tokens)."""
    padded = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)
    y = F.conv1d(padded[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(y).transpose(0, 1), padded


def conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x ``[B, C]``, state ``[B, C, K - 1]`` -> (silu(conv) ``[B, C]``, new state)."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    return F.silu((window * weight).sum(-1)), window[..., 1:]
