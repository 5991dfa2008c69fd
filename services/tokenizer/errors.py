"""The errors a client sees, the same for both front ends: an HTTP status with OpenAI's error body, or
the matching gRPC status (grpc_api.py maps one to the other)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TypedDict

import grpc

from radixserve.common.sampling import SamplingError, SamplingParams
from radixserve.tokenizer.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    error: ErrorDetail


class ApiError(Exception):
    """An error a client sees: HTTP status + OpenAI error body, or the matching gRPC status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """``retry_after``: seconds the client should wait before retrying (HTTP's Retry-After; a 503
        without one gets the default)."""
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> ErrorBody:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(metrics: GatewayMetrics, exc: BaseException, rid: str | None = None) -> ApiError:
    """An unexpected exception as the error a client sees: a 500 naming the request's id (a new id
    where no request was made yet), logged under that id and counted."""
    error_id = rid if rid is not None else uuid.uuid4().hex[:12]
    metrics.internal_errors.inc()
    log.error("internal error %s: %r", error_id, exc, exc_info=exc)
    return ApiError(
        500, f"internal error {error_id} (logged); this is a bug, not your request", "server_error"
    )


_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


def error_from_grpc(e: grpc.aio.AioRpcError, where: str) -> ApiError:
    """A scheduler's refusal as the client's error: its own words for a 4xx, ``where`` named for a 5xx."""
    status, type_ = _FROM_GRPC.get(e.code(), (500, "server_error"))
    msg = e.details() or e.code().name
    return ApiError(status, msg if status < 500 else f"{where}: {msg}", type_)


def retryable(message: str) -> ApiError:
    """A 503 the client may retry as it is (another scheduler, or the same one back, can serve it)."""
    return ApiError(503, message, "server_error")


class ClientErrorLog:
    """Each refused request (4xx) at info level, with its path, field and reason, so an operator can
    see why a client fails without the client's help; at most ``per_second`` lines a second (a
    misbehaving client must not flood the log), the rest counted and reported with the next line."""

    def __init__(self, per_second: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = per_second
        self._clock = clock
        self._tokens = per_second
        self._last = clock()
        self.suppressed = 0

    def refused(self, method: str, path: str, e: ApiError) -> bool:
        """Log ``e`` if the budget allows; returns whether it was logged."""
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1:
            self.suppressed += 1
            return False
        self._tokens -= 1
        more = f" ({self.suppressed} more not logged)" if self.suppressed else ""
        self.suppressed = 0
        field = f" field={e.param}" if e.param else ""
        log.info("refused %d %s %s%s: %s%s", e.status, method, path, field, e.message, more)
        return True


_OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams' names where the API's differ


def validate_sampling(sp: SamplingParams) -> None:
    """SamplingParams.validate, a failure a 400 naming the field: the same ranges and words for HTTP,
    gRPC and the Engine."""
    try:
        sp.validate()
    except SamplingError as e:
        raise ApiError(400, str(e), param=_OPENAI_NAMES.get(e.param, e.param)) from e
