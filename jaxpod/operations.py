"""The protocol between the coordinator and its host workers: the types both ends share.

Every host operation is defined here once (see below); the worker runs it, the
coordinator's replica-group handle sends it. Values on the workers are named by
:class:`Handle`; what the coordinator dropped rides along as :class:`Dropped`; a new
value is described by :class:`HandleInfo`; an exception raised on a worker comes back
as :class:`RemoteError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpod.errors import JaxpodError


class OperationOrderError(JaxpodError):
    """A worker received an operation out of sequence (one was skipped or reordered)."""


@dataclass(frozen=True)
class Handle:
    """A reference to a ``PerReplica`` value held by every worker of a group."""

    id: int


@dataclass(frozen=True)
class Dropped:
    """Objects the coordinator dropped since its previous operation: freed before the
    next one runs, in the same round trip (a free costs no call of its own)."""

    values: tuple[int, ...] = ()
    iterators: tuple[int, ...] = ()
    datasets: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.values or self.iterators or self.datasets)


@dataclass(frozen=True)
class HandleInfo:
    """What the coordinator learns about a new value: enough to describe it."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    valid_rows: tuple[int, ...] | None


@dataclass(frozen=True)
class RemoteError:
    """An exception raised on a worker, kept with its traceback.

    The original exception object travels when it pickles (so user code's own exception
    types survive); ``traceback`` is the worker-side formatted traceback. ``pickled`` is
    the exception pickled here with ``cloudpickle`` (``None`` if it does not pickle):
    the coordinator forwards those bytes untouched, so a class the client shipped by
    value unpickles on the client as the client's own class (cloudpickle tracks
    classes across such round trips; Ray's serializer would mint a new class).
    """

    error: BaseException
    traceback: str
    pickled: bytes | None = None

    @classmethod
    def of(cls, error: BaseException, tb: str) -> RemoteError:
        import cloudpickle

        try:
            pickled = cloudpickle.dumps(error)
            cloudpickle.loads(pickled)  # e.g. an __init__ that pickle cannot call again
        except Exception as why:  # it could not travel at all: send its description
            error = RuntimeError(f"{type(error).__qualname__}: {error} (this exception "
                                 f"could not be pickled and unpickled: {why})")
            pickled = cloudpickle.dumps(error)
        return cls(error, tb, pickled)
