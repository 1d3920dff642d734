"""What every host operation is, and what carries it and its replies.

:class:`Operation` is the base of every host operation; an :class:`Envelope` carries one
over the operation channel, numbered in the group's sequence. Besides a result, a host
answers with a :class:`RemoteError` (an exception raised on it), or, for a uniform
operation, with :class:`Digested` (the first host) or a :class:`Digest` (the others).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from jaxpod.errors import JaxpodError
from jaxpod.operations.handles import Dropped

if TYPE_CHECKING:
    from jaxpod.operations.host import Host


class OperationOrderError(JaxpodError):
    """A worker received an operation out of sequence (one was skipped or reordered)."""


class IdRangeError(JaxpodError):
    """An operation sent ahead of another made more objects than the ids it was given."""


class DivergedError(JaxpodError):
    """A host's result of a uniform operation differs from the first host's: the hosts
    are out of lockstep (a step function whose outputs depend on the host)."""


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


@dataclass(frozen=True)
class Digested:
    """The first host's reply to a :attr:`~Operation.uniform` operation of a group of
    several hosts: its result and the result's digest (``None``: it has none, see
    ``jaxpod.worker.result_digest``), which the other hosts' :class:`Digest` replies
    must match."""

    result: Any
    digest: bytes | None


@dataclass(frozen=True)
class Digest:
    """Another host's reply to a :attr:`~Operation.uniform` operation: only its result's
    digest. The coordinator reads a few dozen bytes from each host instead of the
    result (a 1000-leaf state's infos are 38 KB; 10 MB per step from 256 hosts)."""

    digest: bytes


R = TypeVar("R")


class Operation(abc.ABC, Generic[R]):
    """One step that every host of a slice takes, in the same order.

    It takes effect on every host or on none: where it fails on some hosts, what it
    :meth:`created` on the others, and what :meth:`spoils` names, are freed on all.
    """

    #: Whether running it counts as work in the host's busy time (reading the
    #: figures must not move them).
    counts_as_work: ClassVar[bool] = True
    #: Whether it dispatches compiled programs, which may hold collectives: where it
    #: failed on some hosts only, the others may wait in one for ever.
    dispatches: ClassVar[bool] = False
    #: Whether the coordinator may send the next operation before this one's replies:
    #: they are small, and it fails on every host or on none, or else dispatches (a
    #: failure on some hosts then restarts the slice, failing what was sent behind
    #: it). What follows an operation that fails everywhere finds its outputs missing
    #: on every host alike.
    followable: ClassVar[bool] = False
    #: Whether every host's result is the same value (the infos of the values it made,
    #: as hosts in lockstep make them): hosts other than the first answer with a
    #: :class:`Digest`, and one that differs fails as :class:`DivergedError`. Only
    #: operations that dispatch are uniform: a host that diverged restarts the slice.
    uniform: ClassVar[bool] = False

    @abc.abstractmethod
    def apply(self, host: Host) -> R:
        """Runs this operation on ``host``."""

    def created(self, result: R) -> Dropped:
        """What a host that ran it holds because of it (freed if another host failed)."""
        return Dropped()

    def spoils(self) -> Dropped:
        """What cannot be used any more once it failed on some hosts only (an iterator
        that some hosts advanced and others did not)."""
        return Dropped()



@dataclass(frozen=True)
class Envelope:
    """One message of the operation channel: the operation, its number in the
    group's sequence (the worker checks it: a skipped or reordered operation fails
    loudly instead of deadlocking a collective), what to free before it, and the
    first id for the objects it creates (ids come from the coordinator, so that
    every host names them alike whatever failed before)."""

    seq: int
    operation: Operation[Any]
    dropped: Dropped | None = None
    first_id: int = 1
    #: The id past the last it may give (``None``: no limit): the coordinator sent
    #: the next operation, with its own ids, before reading this one's replies.
    id_limit: int | None = None
    #: The next message may arrive before the reply is read: the reply must lend
    #: no memory (a lent buffer lives only until the next message).
    ahead: bool = False
