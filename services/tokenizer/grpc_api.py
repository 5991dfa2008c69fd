"""The gateway's gRPC face: public Generate (server-streaming) and the detokenizer's Deliver stream."""

from __future__ import annotations

import time
from typing import Any

import grpc

from radixserve.common.rpc import pb, pb_grpc, sampling_from_proto
from radixserve.tokenizer import openai_api as api
from radixserve.tokenizer.gateway import ApiError, Gateway
from radixserve.tokenizer.gateway import internal_error as _internal
from radixserve.tokenizer.tracing import RequestTrace

GENERATE_DEFAULT_MAX_TOKENS = 16  # as /v1/completions

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

    async def Deliver(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        via = object()  # this stream: the requests whose text comes through it
        try:
            async for batch in request_iterator:
                self.gw.deliver(batch, via)
        finally:
            # However it ended (a killed detokenizer's stream may look closed, not broken), nothing
            # more comes this way for the requests it was delivering.
            self.gw.delivery_broke(via)
        return pb.DeliverReply()

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        gw = self.gw
        choices = []
        trace = RequestTrace(
            "radixserve.v1.Gateway/Generate",
            {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)},
            {"gen_ai.request.model": request.model or gw.model_name, "radixserve.stream": request.stream},
        )
        usage, reasons, error = None, [], None
        try:
            if request.model and request.model != gw.model_name:
                raise ApiError(
                    404, f"model {request.model!r} is not served here (this server serves {gw.model_name!r})"
                )
            which = request.WhichOneof("input")
            if which == "text":
                ids = gw.encode(request.text)
            elif which == "input_ids":
                ids = list(request.input_ids.ids)
            elif which == "chat":
                ids = gw.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
            else:
                raise ApiError(400, "one of text, input_ids or chat is required")
            if not ids:
                raise ApiError(400, "the input is empty", param=which)
            sp = sampling_from_proto(request.sampling, GENERATE_DEFAULT_MAX_TOKENS)
            s = request.sampling
            skip = s.skip_special_tokens if s.HasField("skip_special_tokens") else True
            trace.child("tokenize", trace.start, time.monotonic())
            choices = await gw.submit(ids, sp, 1, skip, trace=trace)
            text: list[str] = []
            tokens: list[int] = []
            async for got in gw.events(choices):
                trace.result()
                for _, t in got:
                    if t.finish_reason == "abort":
                        raise ApiError(503, t.error or "the request was aborted")
                    pb_usage = None
                    if t.finish_reason:
                        reasons.append(t.finish_reason)
                        usage = api.usage(t.prompt_tokens, t.completion_tokens, t.cached_tokens)
                        pb_usage = pb.Usage(
                            prompt_tokens=t.prompt_tokens,
                            completion_tokens=t.completion_tokens,
                            cached_tokens=t.cached_tokens,
                        )
                    if request.stream:
                        yield pb.GenerateResponse(
                            rid=t.rid,
                            text=t.text,
                            token_ids=t.token_ids,
                            finish_reason=t.finish_reason,
                            usage=pb_usage,
                        )
                    else:
                        text.append(t.text)
                        tokens += t.token_ids
                        if t.finish_reason:
                            yield pb.GenerateResponse(
                                rid=t.rid,
                                text="".join(text),
                                token_ids=tokens,
                                finish_reason=t.finish_reason,
                                usage=pb_usage,
                            )
        except ApiError as e:
            error = e.message
            await context.abort(_TO_GRPC.get(e.status, grpc.StatusCode.INTERNAL), e.message)
        except Exception as e:  # a bug, not bad input: logged with an id the client also gets
            if isinstance(e, grpc.aio.AbortError):
                raise
            err = _internal(gw.metrics, e)
            error = err.message
            await context.abort(grpc.StatusCode.INTERNAL, err.message)
        finally:  # also when the client cancels the call
            if choices:
                gw.release(choices, "client cancelled")
            if usage is None and error is None:
                error = "client cancelled"
            trace.end(usage, reasons, error)
