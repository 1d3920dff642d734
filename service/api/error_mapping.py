"""How the ``Coordinator`` handlers' requests are checked and their exceptions answered.

Every RPC of :class:`~jaxpod.service.api.coordinator.CoordinatorService` is wrapped
(:func:`install_error_mapping`): a request that did not parse (:class:`MalformedRequest`,
from :func:`request_deserializer`) is refused, the session it names is checked, and any
exception becomes a gRPC status through :mod:`jaxpod.service.api.status`; a stream
operation's failure becomes its reply's ``OpFailure`` (:func:`op_failure`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from jaxpod.errors import (
    DependencyFailedError,
    EndOfDataError,
    MalformedRequestError,
    PermissionDeniedError,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.service.api.status import status_of

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class _Stopped(Exception):
    """Carries a ``StopIteration`` (e.g. ``EndOfDataError``) out of a worker thread:
    neither a future nor a coroutine may raise one."""

    def __init__(self, error: StopIteration) -> None:
        super().__init__(str(error))
        self.error = error


def no_stop(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, for a worker thread: a ``StopIteration`` leaves as :class:`_Stopped`."""
    try:
        return fn(*args)
    except StopIteration as e:
        if not isinstance(e, EndOfDataError):
            e = EndOfDataError(str(e) or "The distributed dataset has no more input.")
        raise _Stopped(e.with_traceback(None)) from None  # frames would pin the iterator


def op_failure(error: Exception) -> pb.OpFailure:
    """A stream operation's failure, as a failed call's status would carry it."""
    if isinstance(error, _Stopped):
        error = error.error
    code, details, trailers = status_of(error)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        logger.info("a stream operation failed: %s", details)
    parts = dict(trailers)
    return pb.OpFailure(code=code.value[0], details=details,
                        error=parts.get(tensors.ERROR_TRAILER, b""),
                        traceback=parts.get(tensors.TRACEBACK_TRAILER, b""),
                        caused_by=error.op if isinstance(error, DependencyFailedError) else 0)


@dataclass(frozen=True)
class MalformedRequest:
    """What a method's request deserializer gives for bytes that do not parse as its
    message (gRPC would answer ``UNKNOWN`` for the parse error itself): the handler
    refuses it as ``INVALID_ARGUMENT``, naming the method."""

    method: str
    message: str
    error: str

    def refusal(self) -> MalformedRequestError:
        return MalformedRequestError(
            f"{self.method}: the request is not a valid jaxpod.{self.message} message "
            f"({self.error}). Call the service through a jaxpod client of its own version "
            "(jaxpod.connect); other clients must build requests from "
            "proto/coordinator.proto.")


def request_deserializer(method: str, message: type[Any]) -> Callable[[bytes], Any]:
    """``message.FromString``, giving a :class:`MalformedRequest` instead of raising."""
    def deserialize(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception as e:  # DecodeError; whatever else hostile bytes provoke
            return MalformedRequest(method, message.__name__, f"{type(e).__name__}: {e}")

    return deserialize


def _checked(request: Any) -> Any:
    """Raises the refusal of a malformed request; a request stream's items are checked
    as they arrive."""
    if isinstance(request, MalformedRequest):
        raise request.refusal()
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, MalformedRequest):
            raise request.refusal()
        yield request


def _unary(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _checked(request)
            self.check_session(request, context)
            return await handler(self, request, context)
        except Exception as e:
            if isinstance(e, PermissionDeniedError):
                await self.audit_refusal(context, handler.__name__, e)
            await _abort(context, e, handler.__name__)

    return wrapper


def _streaming(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[Any]:
        try:
            request = _checked(request)
            self.check_session(request, context)
            stream = handler(self, request, context)
            async for item in stream:
                yield item
        except Exception as e:
            if isinstance(e, PermissionDeniedError):
                await self.audit_refusal(context, handler.__name__, e)
            await _abort(context, e, handler.__name__)

    return wrapper


async def _abort(context: grpc.aio.ServicerContext, error: Exception, rpc: str) -> None:
    if isinstance(error, grpc.aio.AbortError):
        raise error
    code, details, trailers = status_of(error.error if isinstance(error, _Stopped) else error)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        logger.info("%s failed: %s", rpc, details)
    context.set_trailing_metadata(trailers)
    await context.abort(code, details)


def install_error_mapping(cls: type[Any]) -> None:
    """Wraps each ``Coordinator`` RPC of ``cls`` in the request check and error mapping."""
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        handler = getattr(cls, method.name)
        wrap = _streaming if method.server_streaming else _unary
        setattr(cls, method.name, wrap(handler))

