"""The exceptions jaxpod raises.

Every error jaxpod raises itself derives from :class:`JaxpodError`; exceptions raised
by user code (a step function, a dataset function) keep their own type and message.
Each class pickles by its constructor arguments so it survives a trip across Ray
actors and processes.
"""

from __future__ import annotations

from typing import Any


class JaxpodError(Exception):
    """Base class of every error jaxpod raises on its own behalf."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class EndOfDataError(JaxpodError, StopIteration):
    """A distributed iterator has no more input.

    Also a ``StopIteration``, so ``for`` loops and ``next(it, default)`` end cleanly.
    """


class AllocationTimeoutError(JaxpodError, TimeoutError):
    """A whole slice could not be reserved within the allocation time-out."""


class AllocationCancelledError(JaxpodError):
    """An allocation was cancelled before it completed; nothing stays reserved."""


class WorkerStartError(JaxpodError):
    """A host worker did not start or did not join its replica group in time."""


class WorkerLostError(JaxpodError, ConnectionError):
    """A host worker stopped answering in the middle of an operation (its process died or
    its slice was released); that slice's replica group is unusable."""


class VersionMismatchError(JaxpodError):
    """Two ends of jaxpod (client/coordinator/worker) run incompatible versions."""


class SessionError(JaxpodError):
    """A session, strategy or client that is closed, expired or unknown to the service."""


class HandleError(JaxpodError, ValueError):
    """A remote value, dataset or iterator that was freed or belongs to someone else."""


class MessageTooLargeError(JaxpodError, ValueError):
    """A request or result over the service's message size limit."""


class MalformedRequestError(JaxpodError, ValueError):
    """A request whose bytes are not the message its method takes (a client of another
    protocol version, a corrupted or hostile message)."""


class ServiceUnavailableError(JaxpodError, ConnectionError):
    """The jaxpod service cannot be reached (not started, stopped, or unreachable)."""


class AuthenticationError(JaxpodError, PermissionError):
    """The service refused the client's token."""


class PermissionDeniedError(JaxpodError, PermissionError):
    """The service knows the client's token, but its role (or ownership) does not
    allow the call; the message names the role needed."""


class QuotaExceededError(JaxpodError):
    """The token's ``max_slices`` leaves no room for the slices asked for; the message
    says how many it holds."""


class DeadlineExceededError(JaxpodError, TimeoutError):
    """A call to the service did not finish within its deadline."""


class OperationTimeoutError(JaxpodError, TimeoutError):
    """Some host did not answer an operation in time; the group is no longer usable."""


class UnknownFunctionError(JaxpodError, KeyError):
    """A function id that was never defined on a worker, or was evicted from its cache
    (the caller defines the function again)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown function"


class PeerHostError(JaxpodError):
    """This host stopped an operation because another host of its slice failed it (the
    hosts agreed to stop together instead of waiting for each other)."""


class SliceResetError(JaxpodError):
    """The slice's hosts fell out of step (one did not answer an operation in time) and
    its workers were restarted: every value, dataset and iterator on it is gone; the
    slice itself works again. ``host_stacks``: each host's Python stacks as read just
    before the restart, when an operation timed out (``None``: not read)."""

    host_stacks: list[str] | None = None


class DependencyFailedError(JaxpodError):
    """An operation that was not run because it uses a result of an earlier operation
    that failed (asynchronous dispatch: both were sent before the failure was known).
    ``op`` is the failed operation's number on its slice."""

    def __init__(self, message: str, op: int) -> None:
        super().__init__(message, op)
        self.op = op

    def __str__(self) -> str:
        return str(self.args[0])


class AsyncPredictionError(JaxpodError):
    """An asynchronously dispatched operation's outputs differed from those of its
    earlier calls with the same argument shapes (its function's trace-time Python
    depends on more than them), so the handles already returned were wrong."""


class UnknownHandleError(HandleError, KeyError):
    """A value id that a worker never issued, or has freed (or lost with a reset)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown handle"


class JobNotFoundError(JaxpodError, KeyError):
    """A job id that the service's job store has never recorded.

    Built from the id (and where it was looked up), so it pickles by its arguments like
    every other jaxpod error.
    """

    def __init__(self, job_id: str, where: str = "") -> None:
        super().__init__(job_id, where)
        self.job_id = job_id

    def __str__(self) -> str:
        where = f" in {self.args[1]}" if len(self.args) > 1 and self.args[1] else ""
        return (f"No job with id {self.args[0]!r}{where}. List the known jobs with "
                "`jaxpod jobs` or `client.jobs()` and pass one of their ids.")


class JobNotRunningError(JaxpodError, ValueError):
    """What needs a job's running attempt (a profile, its hosts' stacks) asked of a job
    that is not running on a slice; the message says its state and what to do."""


class JobFailedError(JaxpodError):
    """``result()`` of a job that ended ``FAILED``; ``error`` is the recorded reason (the
    user's exception type, message and remote traceback, or what the service saw)."""

    def __init__(self, job_id: str, error: str) -> None:
        super().__init__(job_id, error)
        self.job_id = job_id
        self.error = error

    def __str__(self) -> str:
        return f"Job {self.args[0]} failed: {self.args[1]}"


class JobCancelledError(JaxpodError):
    """``result()`` of a job that ended ``CANCELLED``; ``reason`` says who or what did;
    ``checkpoint`` is its last checkpoint (a ``jaxpod.JobCheckpoint``; ``None``: none),
    which holds its state at that step."""

    def __init__(self, job_id: str, reason: str, checkpoint: Any = None) -> None:
        super().__init__(job_id, reason)
        self.job_id = job_id
        self.reason = reason
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        where = ("it has no result and no checkpoint" if self.checkpoint is None else
                 f"it has no result, but its last checkpoint, at step "
                 f"{self.checkpoint.step}, holds its state: {self.checkpoint.path} "
                 "(job.checkpoints() lists them)")
        return f"Job {self.args[0]} was cancelled ({self.args[1]}); {where}."
