"""The gateway's gRPC face: public Generate (server-streaming) and the detokenizer's Deliver stream.

A Generate call's lifecycle (submit, results, abort on cancel, usage) is its RequestSession's
(session.py); this module turns a GenerateRequest into a session and its outputs into
GenerateResponses: one per delivery when streaming, else one with the whole text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from radixserve.common.rpc import pb, pb_grpc
from radixserve.common.sampling import SamplingParams
from radixserve.common.wire import sampling_from_proto
from radixserve.tokenizer.auth import MISSING_GRPC
from radixserve.tokenizer.errors import ApiError, validate_sampling
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api.requests import COMPLETIONS_DEFAULT_MAX_TOKENS, logit_bias_ids
from radixserve.tokenizer.session import Output, RequestSession
from radixserve.tokenizer.tracing import inference_span

_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GatewayService(pb_grpc.GatewayServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def Deliver(
        self, request_iterator: AsyncIterator[pb.TextBatch], context: grpc.aio.ServicerContext
    ) -> pb.DeliverReply:
        via = object()  # this stream: the requests whose text comes through it
        try:
            async for batch in request_iterator:
                self.gw.deliver(batch, via)
        finally:
            # However it ended (a killed detokenizer's stream may look closed, not broken), nothing
            # more comes this way for the requests it was delivering.
            self.gw.delivery_broke(via)
        return pb.DeliverReply()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        gw = self.gw
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        refused = gw.api_keys.refusal(metadata, MISSING_GRPC)  # Deliver needs none: pod to pod
        if refused is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refused)
        name, genai = inference_span("text_completion", request.model or gw.model_name, gw.model_name)
        attributes = {**genai, "rpc.system": "grpc", "rpc.method": "radixserve.v1.Gateway/Generate"}
        session = RequestSession(
            gw, name, metadata, {**attributes, "radixserve.stream": request.stream}, gone="client cancelled"
        )
        session.trace.annotate({"gen_ai.response.id": session.rid})  # GenerateResponse.rid
        try:
            async with session:
                ids = self._input_ids(request)
                sp = sampling_from_proto(request.sampling, COMPLETIONS_DEFAULT_MAX_TOKENS)
                await self._check_sampling(sp)
                s = request.sampling
                skip = s.skip_special_tokens if s.HasField("skip_special_tokens") else True
                session.trace.child("tokenize", session.trace.start, time.monotonic())
                await session.submit([ids], sp, 1, skip, deadline_s=context.time_remaining())
                whole = pb.GenerateResponse()  # a non-streamed call's one response, built up
                parts: list[str] = []  # its text (joined once: protobuf strings do not grow in place)
                async for outputs in session:
                    for o in outputs:
                        if request.stream:
                            yield _response(session, o, pb.GenerateResponse(text=o.text))
                            continue
                        parts.append(o.text)
                        if _response(session, o, whole).finish_reason:
                            whole.text = "".join(parts)
                            yield whole
        except ApiError as e:  # an unexpected exception is one too (a 500: INTERNAL), see RequestSession
            await context.abort(_TO_GRPC.get(e.status, grpc.StatusCode.INTERNAL), e.message)

    async def _check_sampling(self, sp: SamplingParams) -> None:
        """SamplingParams.validate's ranges, then what it cannot know: the model's vocabulary, and
        whether the constraint compiles (a 400 here rather than a failure on the scheduler). Validated
        first: its bounds (the spec's size among them) hold before llguidance sees the spec."""
        validate_sampling(sp)
        logit_bias_ids(sp.logit_bias, self.gw.text.vocab_size)
        if sp.constraint is not None:
            await self.gw.text.check_constraint(sp.constraint, "constraint")

    def _input_ids(self, request: pb.GenerateRequest) -> list[int]:
        gw = self.gw
        if request.model:  # empty: the one model served here
            gw.check_model(request.model)
        which = request.WhichOneof("input")
        if which == "text":
            ids = gw.encode(request.text)
        elif which == "input_ids":
            ids = list(request.input_ids.ids)
        elif which == "chat":
            ids = gw.text.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
        else:
            raise ApiError(400, "one of text, input_ids or chat is required")
        if not ids:
            raise ApiError(400, "the input is empty", param=which)
        return ids


def _response(session: RequestSession, o: Output, into: pb.GenerateResponse) -> pb.GenerateResponse:
    """``o``'s tokens added to ``into`` (a fresh one per delivery when streaming: the delivery alone;
    else the whole response so far; its text is the caller's). Logprobs are the detokenizer's, passed
    on as they came; the prompt's come with the first delivery. The last (finished) one carries the
    usage."""
    into.rid = session.rid
    into.token_ids.extend(o.token_ids)
    if o.logprobs is not None:
        into.logprobs.SetInParent()  # present (the request asked) even when this brought no tokens
        into.logprobs.logprob.extend(o.logprobs.logprob)
        into.logprobs.top.extend(o.logprobs.top)
    if o.prompt_logprobs is not None:
        into.prompt_logprobs.CopyFrom(o.prompt_logprobs)
    if o.finish_reason is not None:
        u = session.usage()
        into.finish_reason = o.finish_reason
        into.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
            )
        )
    return into
