"""What decides for the job controller and the job manager, each behind a ``Protocol``
(as Ray Train injects its failure and scaling policies), so another policy replaces one
without touching the code that asks it.

* :class:`FailurePolicy`: whether an attempt that ended badly is retried, and after how
  long. :class:`RetryBudgets` is the default: a preempted slice or lost host counts
  against ``max_retries_preemption`` (waiting longer each time), an exception in the
  job's code against ``max_retries_failure``, a slice not found in time against
  nothing.
* :class:`QueuePolicy`: the order of the queued jobs, and each job's place.
  :class:`PriorityQueues` is the default: one queue per accelerator type, by
  priority, then first in, first out.

Which queued job takes a free slice, and which running job gives its slice up, is the
fair-share scheduler's (:mod:`jaxpod.service.jobs.fair_share`): it follows the queue's
order within each team.
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
from dataclasses import dataclass
from typing import Protocol

from jaxpod import settings

#: The first wait before a preempted job's next attempt; it doubles with every
#: preemption, up to JOB_RETRY_BACKOFF_MAX.
JOB_RETRY_BACKOFF = settings.JOB_RETRY_BACKOFF
JOB_RETRY_BACKOFF_MAX = settings.JOB_RETRY_BACKOFF_MAX


class FailureKind(enum.Enum):
    """Why an attempt ended without finishing the job."""

    #: The slice failed: a lost host or worker, a group out of step, a preemption notice.
    PREEMPTION = "preempted"
    #: The job's code raised.
    ERROR = "failed"
    #: No slice of its type could be acquired within the allocation time-out.
    NO_SLICE = "no slice"


@dataclass(frozen=True)
class Failure:
    """An attempt that ended badly: why, and what users see of it."""

    kind: FailureKind
    error: str


@dataclass(frozen=True)
class Retry:
    """Try again, after ``backoff_s``."""

    backoff_s: float


@dataclass(frozen=True)
class GiveUp:
    """The job fails, with ``error``."""

    error: str


class FailurePolicy(Protocol):
    """Decides what follows an attempt that ended badly (one policy object per job)."""

    def decide(self, failure: Failure) -> Retry | GiveUp: ...

    def gives_up_on(self, failure: Failure) -> bool:
        """Whether :meth:`decide` would give up on ``failure`` now (it counts nothing)."""


class RetryBudgets:
    """Retries within a job's budgets (see the module)."""

    def __init__(self, max_preemptions: int, max_failures: int) -> None:
        self._budgets = {FailureKind.PREEMPTION: ("max_retries_preemption", max_preemptions),
                         FailureKind.ERROR: ("max_retries_failure", max_failures)}
        self._used: collections.Counter[FailureKind] = collections.Counter()

    def gives_up_on(self, failure: Failure) -> bool:
        if failure.kind is FailureKind.NO_SLICE:
            return False
        return self._used[failure.kind] + 1 > self._budgets[failure.kind][1]

    def decide(self, failure: Failure) -> Retry | GiveUp:
        used = self._used[failure.kind] = self._used[failure.kind] + 1
        if failure.kind is FailureKind.NO_SLICE:
            return Retry(JOB_RETRY_BACKOFF.seconds())
        name, budget = self._budgets[failure.kind]
        if used > budget:
            if failure.kind is FailureKind.ERROR:
                return GiveUp(failure.error)
            return GiveUp(f"{failure.kind.value} {used} times, more than {name}={budget}; "
                          f"the last time: {failure.error}")
        if failure.kind is FailureKind.PREEMPTION:
            return Retry(min(JOB_RETRY_BACKOFF.seconds() * 2 ** (used - 1),
                             JOB_RETRY_BACKOFF_MAX.seconds()))
        return Retry(0.0)


class QueuePolicy(Protocol):
    """The jobs waiting for slices, and which may start next."""

    def push(self, job_id: str, accelerator_type: str, priority: int = 0,
             first: bool = False) -> None:
        """Queues a job (a new one, or one recovered on start, in creation order);
        ``first``: at the head of its priority (it yielded its slice to a higher one)."""

    def remove(self, job_id: str) -> bool:
        """Takes a job out (it starts, or it was cancelled); whether it was queued."""

    def ranks(self) -> dict[str, tuple[int, int]]:
        """Every queued job's sort key, lower first: ``(-priority, order pushed)``."""

    def positions(self) -> dict[str, int]:
        """Every queued job's position (0 is next), at one moment."""

    def waiting_types(self) -> list[str]:
        """The accelerator types some queued job waits for."""


class PriorityQueues:
    """One queue per accelerator type, by priority (higher first), then in the order
    pushed: equal priorities are first in, first out. An elastic job is pushed to the
    queue of each type it accepts; its position is its best. Not thread-safe: the job
    manager calls it under its lock."""

    def __init__(self) -> None:
        self._queues: dict[str, list[tuple[int, int, str]]] = {}  # (-priority, order, id)
        self._order = itertools.count(1)

    def push(self, job_id: str, accelerator_type: str, priority: int = 0,
             first: bool = False) -> None:
        order = next(self._order)
        bisect.insort(self._queues.setdefault(accelerator_type, []),
                      (-priority, -order if first else order, job_id))

    def remove(self, job_id: str) -> bool:
        found = False
        for queue in self._queues.values():  # an elastic job waits in several
            for i, (_, _, queued) in enumerate(queue):
                if queued == job_id:
                    del queue[i]
                    found = True
                    break
        return found

    def ranks(self) -> dict[str, tuple[int, int]]:
        return {job_id: (priority, order) for queue in self._queues.values()
                for priority, order, job_id in queue}

    def waiting_types(self) -> list[str]:
        return [t for t, queue in self._queues.items() if queue]

    def positions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for queue in self._queues.values():
            for i, (_, _, job_id) in enumerate(queue):
                out[job_id] = min(i, out.get(job_id, i))
        return out
