"""Conversions between the engine's types and the gRPC contract's messages (proto/radixserve/v1):
sampling parameters and log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.common.rpc import pb
from radixserve.common.sampling import Constraint, SamplingParams


def sampling_to_proto(sp: SamplingParams, skip_special_tokens: bool = True) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        stop_token_ids=list(sp.stop_token_ids),
        stop=list(sp.stop),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=skip_special_tokens,
        logit_bias=dict(sp.logit_bias),
        include_stop_str=sp.include_stop_str,
    )
    for name, default in _OPTIONAL.items():
        if getattr(sp, name) != default:
            setattr(msg, name, getattr(sp, name))
    if sp.constraint is not None:
        msg.constraint.kind = sp.constraint.kind
        msg.constraint.spec = sp.constraint.spec
    return msg


# Optional proto fields, set only away from SamplingParams' default: name -> default.
_OPTIONAL = {
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "min_new_tokens": 0,
}


def sampling_from_proto(msg: pb.SamplingParams, default_max_new_tokens: int | None = None) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults (max_new_tokens: the given default)."""
    sp = SamplingParams()
    if default_max_new_tokens is not None:
        sp.max_new_tokens = default_max_new_tokens
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", *_OPTIONAL):
        if msg.HasField(name):
            setattr(sp, name, getattr(msg, name))
    sp.stop_token_ids = tuple(msg.stop_token_ids)
    sp.stop = tuple(msg.stop)
    sp.ignore_eos = msg.ignore_eos
    sp.include_stop_str = msg.include_stop_str
    sp.logit_bias = tuple(sorted(msg.logit_bias.items()))
    if msg.HasField("constraint"):
        sp.constraint = Constraint(msg.constraint.kind, msg.constraint.spec)
    return sp


def logprobs_to_proto(entries: Sequence[tuple[float, list[int], list[float]] | None]) -> pb.Logprobs:
    """(logprob, top ids, top logprobs) per token as a ``Logprobs``; None (a prompt's first token,
    which nothing predicts) is NaN with no alternatives."""
    msg = pb.Logprobs()
    alternatives = any(e is not None and e[1] for e in entries)
    for e in entries:
        msg.logprob.append(float("nan") if e is None else e[0])
        if alternatives:
            msg.top.add(token_ids=e[1] if e else (), logprobs=e[2] if e else ())
    return msg
