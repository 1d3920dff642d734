"""The job state machine of DESIGN §3, with every allowed transition in one place.

Modelled on Ray Train v2's ``controller/state.py``: :class:`~jaxpod.jobs.JobState`
names the states, and one small frozen dataclass per state carries the data that only
makes sense in that state (a queue position while ``PENDING``, the attempt number while
``ALLOCATING``, the slice while ``RUNNING``...). The job controller
(:mod:`~jaxpod.service.jobs.controller`) moves a job from one to the next; the store
persists each one's name (and the step, error or reason it carries) and refuses any
move that :data:`TRANSITIONS` does not allow, so an illegal move is an error at the
point it is attempted, never a job record that contradicts its own history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jaxpod.errors import JaxpodError
from jaxpod.jobs import TERMINAL_STATES, JobState

__all__ = ["TERMINAL_STATES", "TRANSITIONS", "Allocating", "Cancelled", "Failed",
           "IllegalTransitionError", "JobState", "JobStateData", "Pending", "Retrying",
           "Running", "Succeeded", "Suspended", "check_transition"]

_S = JobState
#: Every allowed move, and only these. RETRYING -> FAILED: the retry budget can run out
#: while the job waits for a new slice. ALLOCATING -> RETRYING: the coordinator
#: restarted while the job was acquiring its slice. ALLOCATING, RUNNING, RETRYING ->
#: PENDING: a job of higher priority took its slice (it checkpointed first) and it
#: waits in the queue again. Any unfinished state -> SUSPENDED (``job.suspend()``, a
#: running job checkpointing first) -> PENDING (``job.resume()``) or CANCELLED.
TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.ALLOCATING, _S.CANCELLED, _S.SUSPENDED}),
    _S.ALLOCATING: frozenset({_S.RUNNING, _S.FAILED, _S.CANCELLED, _S.RETRYING,
                              _S.PENDING, _S.SUSPENDED}),
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.CANCELLED, _S.RETRYING, _S.PENDING,
                           _S.SUSPENDED}),
    _S.RETRYING: frozenset({_S.ALLOCATING, _S.FAILED, _S.CANCELLED, _S.PENDING,
                            _S.SUSPENDED}),
    _S.SUSPENDED: frozenset({_S.PENDING, _S.CANCELLED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransitionError(JaxpodError, ValueError):
    """A job state change that the state machine does not allow (nothing was recorded)."""


def check_transition(old: JobState, new: JobState) -> None:
    """Raise :class:`IllegalTransitionError` unless ``old -> new`` is allowed."""
    allowed = TRANSITIONS[old]
    if new in allowed:
        return
    if old.is_terminal:
        hint = f"{old.value} is terminal: the job is over; submit a new job to run it again."
    else:
        hint = "allowed from there: " + ", ".join(sorted(s.value for s in allowed)) + "."
    raise IllegalTransitionError(
        f"Illegal job state transition {old.value} -> {new.value}; {hint}")


@dataclass(frozen=True)
class Pending:
    """Queued for a free slice of its type; ``queue_position`` 0 is next."""

    queue_position: int
    state: ClassVar[JobState] = JobState.PENDING


@dataclass(frozen=True)
class Allocating:
    """Acquiring a slice for attempt number ``attempt`` (1 is the first)."""

    attempt: int
    state: ClassVar[JobState] = JobState.ALLOCATING


@dataclass(frozen=True)
class Running:
    """Attempt ``attempt`` runs on its slice; ``step`` steps are done (the attempt
    starts from there). ``held`` is the slice (a ``HeldSlice``), ``resume`` the
    checkpoint step it starts from and ``memory`` (a ``MemoryPlan``) where the hosts'
    in-memory copies of it are when it starts from those: what the controller needs,
    never stored."""

    attempt: int
    step: int
    held: Any = field(default=None, compare=False, repr=False)
    resume: Any = field(default=None, compare=False, repr=False)
    memory: Any = field(default=None, compare=False, repr=False)
    state: ClassVar[JobState] = JobState.RUNNING


@dataclass(frozen=True)
class Retrying:
    """Attempt ``attempt`` ended for ``cause`` (a lost host, a preempted slice, no slice
    in time) and a new one will be allocated after ``backoff_s``."""

    attempt: int
    cause: str
    backoff_s: float = field(default=0.0, compare=False)
    state: ClassVar[JobState] = JobState.RETRYING


@dataclass(frozen=True)
class Suspended:
    """Off its slice until resumed, its last checkpoint kept; ``reason`` says who
    suspended it."""

    reason: str
    state: ClassVar[JobState] = JobState.SUSPENDED


@dataclass(frozen=True)
class Succeeded:
    """All steps ran; ``result`` (the final state and outputs) is to be stored."""

    result: Any = field(default=None, compare=False, repr=False)
    state: ClassVar[JobState] = JobState.SUCCEEDED


@dataclass(frozen=True)
class Failed:
    """Over for good; ``error`` is what users see (the user's exception type, message and
    remote traceback, or the service's reason)."""

    error: str
    state: ClassVar[JobState] = JobState.FAILED


@dataclass(frozen=True)
class Cancelled:
    """Cancelled by ``reason`` (who asked, or why)."""

    reason: str
    state: ClassVar[JobState] = JobState.CANCELLED


#: A state together with its data.
JobStateData = (Pending | Allocating | Running | Retrying | Suspended | Succeeded | Failed
                | Cancelled)
