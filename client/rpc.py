"""Calls to the service: deadlines, retries of idempotent calls, typed errors.

Every call carries the client's token and a deadline (named, environment-overridable
time-outs). Only calls that are safe to repeat (reads, heartbeats, defining a function
by content hash) are retried, and only when the service was unreachable. A failed
call raises the exception the service reported: the step function's own exception
type and message with the remote traceback as a note, a ``jaxpod`` error, or, for
transport failures, a ``jaxpod`` error saying what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import cloudpickle
import grpc

from jaxpod import errors, settings
from jaxpod.proto.tensors import ERROR_TRAILER, MAX_MESSAGE_BYTES, TRACEBACK_TRAILER
from jaxpod.settings import Setting

#: Operations on a slice (a first call compiles; a step may be long).
CALL_TIMEOUT = settings.CALL_TIMEOUT
#: Acquiring a slice: allocation plus starting its host workers.
ACQUIRE_TIMEOUT = settings.ACQUIRE_TIMEOUT
#: Session bookkeeping (open, heartbeat, close, free, status).
CONTROL_TIMEOUT = settings.CONTROL_TIMEOUT
_RETRY_DELAYS_S = (0.1, 0.5, 2.0)

_T = TypeVar("_T")

_BY_CODE: dict[grpc.StatusCode, type[errors.JaxpodError]] = {
    grpc.StatusCode.UNAVAILABLE: errors.ServiceUnavailableError,
    grpc.StatusCode.CANCELLED: errors.ServiceUnavailableError,  # e.g. the service stopping
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.MessageTooLargeError,
    grpc.StatusCode.NOT_FOUND: errors.HandleError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.SessionError,
}


def error_from(e: grpc.RpcError, what: str, timeout: Setting = CALL_TIMEOUT
               ) -> BaseException:
    """The exception a failed call stands for.

    Args:
      e: the gRPC error (a ``grpc.Call`` too).
      what: the operation, for messages of errors the transport produced.
      timeout: the call's time-out, named when its deadline was exceeded.
    """
    call: Any = e
    trailers = dict(call.trailing_metadata() or ())
    return error_from_parts(call.code(), call.details() or "", trailers.get(ERROR_TRAILER),
                            trailers.get(TRACEBACK_TRAILER), what, timeout)


_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status code numbered ``number`` (an ``OpFailure.code``); ``UNKNOWN`` for a
    number gRPC does not define."""
    return _CODES_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_from_parts(code: grpc.StatusCode, details: str, payload: bytes | None,
                     traceback: bytes | None, what: str, timeout: Setting = CALL_TIMEOUT
                     ) -> BaseException:
    """The exception a failure stands for: the pickled one the service sent
    (``payload``) with the workers' ``traceback`` as a note, or one made from the
    status code and details."""
    error: BaseException | None = None
    if payload:
        try:
            error = cloudpickle.loads(payload)
        except Exception:
            error = None
    if error is None:
        message = _transport_message(code, details, what, timeout)
        error = _BY_CODE.get(code, errors.JaxpodError)(message)
    if traceback:
        error.add_note("Remote traceback (from the jaxpod workers):\n"
                       + traceback.decode(errors="replace"))
    return error


def _transport_message(code: grpc.StatusCode, details: str, what: str,
                       timeout: Setting) -> str:
    if code == grpc.StatusCode.CANCELLED:
        return (f"{what} was cancelled ({details}); the jaxpod service is probably "
                "stopping. Connect again once it is back.")
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"{what}: the jaxpod service is unreachable ({details}). Check that "
                "`jaxpod serve` runs at that address (a service started with --tls-cert "
                "needs jaxpod.connect(tls_ca=...) or $JAXPOD_TLS_CA, the CA that signed "
                "its certificate), or unset JAXPOD_ADDRESS to use the embedded local "
                "service.")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return (f"{what}: {details}. Messages are limited to {MAX_MESSAGE_BYTES} bytes; "
                "large arrays travel as arguments (uploaded in chunks), not inside "
                "functions or datasets.")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"{what} did not finish within its deadline ({details}); raise "
                f"{timeout.env_var} (default {timeout.default_s:g}s) if it legitimately "
                "takes longer.")
    return f"{what} failed: {code.name}: {details}"


def call(method: Callable[..., _T], request: Any, *, what: str, metadata: Any,
         timeout: Setting, idempotent: bool = False) -> _T:
    """Makes a unary call; returns its response or raises the reported exception."""
    timeout_s = timeout.seconds()
    for attempt in range(len(_RETRY_DELAYS_S) + 1):
        try:
            return method(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            if not _retry(e, idempotent, attempt):
                raise error_from(e, what, timeout) from None
    raise AssertionError("unreachable")


def stream(method: Callable[..., Any], request: Any, consume: Callable[[Iterator[Any]], _T],
           *, what: str, metadata: Any, timeout: Setting) -> _T:
    """Makes a server-streaming call and hands the stream to ``consume``.

    Result streams (reduce, gather, fetch...) only read values, so they are retried
    like idempotent calls.
    """
    timeout_s = timeout.seconds()
    for attempt in range(len(_RETRY_DELAYS_S) + 1):
        try:
            return consume(method(request, timeout=timeout_s, metadata=metadata))
        except grpc.RpcError as e:
            if not _retry(e, True, attempt):
                raise error_from(e, what, timeout) from None
    raise AssertionError("unreachable")


def _retry(e: grpc.RpcError, idempotent: bool, attempt: int) -> bool:
    call_: Any = e
    if not idempotent or attempt >= len(_RETRY_DELAYS_S):
        return False
    if call_.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    time.sleep(_RETRY_DELAYS_S[attempt])
    return True
