"""Exceptions to gRPC statuses, so the client can raise the same exception again.

The status code says what kind of failure it was and the details what to fix. Two
binary trailers carry the rest: ``jaxpod-error-bin``, the exception pickled with
cloudpickle (for an exception raised on a worker, the worker's own pickle, forwarded
untouched so user-defined exception classes come back as the client's classes), and
``jaxpod-traceback-bin``, the remote traceback.
"""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import grpc

from jaxpod import errors
from jaxpod.proto.tensors import ERROR_TRAILER, TRACEBACK_TRAILER

#: Keeps trailers under the metadata limit both sides set (``MAX_METADATA_BYTES``).
_MAX_TRAILER_BYTES = 256 * 1024

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.QuotaExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.SessionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.VersionMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.HandleError, grpc.StatusCode.NOT_FOUND),
    (errors.MessageTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.EndOfDataError, grpc.StatusCode.OUT_OF_RANGE),
    (errors.AllocationTimeoutError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.AllocationCancelledError, grpc.StatusCode.CANCELLED),
    (errors.WorkerStartError, grpc.StatusCode.UNAVAILABLE),
    # The service stopping, or its cluster failing to start: clients may come back.
    (errors.ServiceUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.OperationTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.WorkerLostError, grpc.StatusCode.ABORTED),
    (errors.SliceResetError, grpc.StatusCode.ABORTED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (IndexError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]:
    """The status code, details and trailers that describe ``error``."""
    code = next((c for t, c in _CODES if isinstance(error, t)), grpc.StatusCode.UNKNOWN)
    remote = getattr(error, "jaxpod_remote", None)
    pickled = getattr(remote, "pickled", None)
    traceback = getattr(remote, "traceback", "") or ""
    if pickled is None:
        try:
            pickled = cloudpickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            pickled = None
    message = str(error) or type(error).__name__
    details = f"{type(error).__name__}: {message}"
    trailers: list[tuple[str, Any]] = []
    if pickled is not None and len(pickled) <= _MAX_TRAILER_BYTES:
        trailers.append((ERROR_TRAILER, pickled))
    if traceback:
        trailers.append((TRACEBACK_TRAILER, traceback.encode()[-_MAX_TRAILER_BYTES:]))
    return code, details, tuple(trailers)
