"""The job controller: one job's life from its first allocation to a final state, as an
explicit state machine (the shape of Ray Train v2's ``TrainController``).

:meth:`JobController.run` starts the job's first attempt (``ALLOCATING``), then calls
:meth:`~JobController._step` until the job is over: each step takes the current state
(:mod:`~jaxpod.service.jobs.states`, each carrying its data) and returns the next one,
and :meth:`~JobController._set_state` hands every change to the callbacks, which keep
the store, the goodput clock and the job's watchers up to date: nothing else writes a
state. What follows a failed attempt is the :class:`~jaxpod.service.jobs.policies.
FailurePolicy`'s decision. Every wait has a named time-out: a job that cannot get a
slice within ``JAXPOD_JOB_ALLOCATION_TIMEOUT_S`` goes to ``RETRYING`` saying so.

One controller runs in one thread; :class:`StopSignal` asks it to stop between loops
(a cancel, or the service stopping: then the job checkpoints and is left ``RUNNING``
for the next coordinator, with no state change).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jaxpod import settings
from jaxpod.errors import AllocationTimeoutError
from jaxpod.jobs import JobSpec
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.jobs import goodput, memory_plan
from jaxpod.service.jobs.checkpoints import JobCheckpoints
from jaxpod.service.jobs.goodput import GoodputClock
from jaxpod.service.jobs.memory_plan import MemoryPlan, memory_checkpoints_on
from jaxpod.service.jobs.policies import Failure, FailureKind, FailurePolicy, GiveUp
from jaxpod.service.jobs.runner import (
    SLICE_FAILURES,
    JobRun,
    MemoryRestoreError,
    Preempted,
    RunContext,
    Stopped,
)
from jaxpod.service.jobs.states import (
    Allocating,
    Cancelled,
    Failed,
    JobStateData,
    Pending,
    Retrying,
    Running,
    Succeeded,
    Suspended,
)
from jaxpod.service.jobs.store import JobStore
from jaxpod.timeouts import Deadline

logger = logging.getLogger(__name__)

#: How long one try to acquire a slice waits before the job looks whether it was
#: cancelled (another holder may have taken the slice that looked free).
JOB_ACQUIRE_TRY = settings.JOB_ACQUIRE_TRY
#: How long a job tries to acquire a slice before it goes to RETRYING saying so.
JOB_ALLOCATION_TIMEOUT = settings.JOB_ALLOCATION_TIMEOUT
#: How long an elastic job waits for its type again before it queues for any it accepts.
JOB_ELASTIC_WAIT = settings.JOB_ELASTIC_WAIT
#: What ends an attempt as a preemption: a notice, a lost host or a broken slice.
PREEMPTIONS: tuple[type[BaseException], ...] = (Preempted, *SLICE_FAILURES)
#: The reason recorded for a job stopped by the service's shutdown.
SHUTDOWN = "the service stopped"


class StopKind(enum.Enum):
    """How a stopped job goes on."""

    #: Cancelled (or the service stops: :attr:`StopSignal.shutting_down`).
    CANCEL = "cancel"
    #: It gives its slice to another job and waits in the queue again.
    YIELD = "yield"
    #: It waits off its slice until resumed (``job.suspend()``).
    SUSPEND = "suspend"
    #: Its ``max_runtime_s`` is up: it ends, cancelled.
    DEADLINE = "deadline"


class StopSignal:
    """Asks a controller to stop between loops, saying why (the first reason wins, but
    a cancel or shutdown overrides a stop that checkpoints first). Every kind but a
    cancel checkpoints first, so the job loses no step."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason = ""
        self.kind = StopKind.CANCEL

    def request(self, reason: str, *, yielding: bool = False,
                kind: StopKind | None = None) -> None:
        kind = kind or (StopKind.YIELD if yielding else StopKind.CANCEL)
        with self._lock:
            if not self._event.is_set() or (self.kind is not StopKind.CANCEL
                                            and kind is StopKind.CANCEL):
                self.reason, self.kind = reason, kind
                self._event.set()

    @property
    def yielding(self) -> bool:
        """The job gives its slice to another and waits again (it checkpoints first)."""
        return self._event.is_set() and self.kind is StopKind.YIELD

    @property
    def checkpoints_first(self) -> bool:
        """The job checkpoints before it stops: all but a cancel."""
        return self.shutting_down or self.kind is not StopKind.CANCEL

    @property
    def ends_the_job(self) -> bool:
        """The job ends when it stops (a cancel, or its run time up), not the service."""
        return (self._event.is_set() and not self.shutting_down
                and self.kind in (StopKind.CANCEL, StopKind.DEADLINE))

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Waits up to ``timeout``; whether a stop was asked for."""
        return self._event.wait(timeout)

    @property
    def shutting_down(self) -> bool:
        """The service is stopping: the job checkpoints and stays in flight."""
        return self.reason == SHUTDOWN


@dataclass(frozen=True)
class AttemptEnd:
    """An attempt that ended with a state change: why, and the step it reached."""

    number: int
    cause: str
    step_reached: int


@dataclass(frozen=True)
class StateChange:
    """One change of a job's state. ``new`` is ``None`` when the job is left in flight
    (the service stops); ``ended`` is the attempt that ended with it, if one did."""

    job_id: str
    old: JobStateData | None
    new: JobStateData | None
    reason: str | None = None
    ended: AttemptEnd | None = None


class StateCallback(Protocol):
    """Told of every state change, in order, on the controller's thread."""

    def after_state_change(self, change: StateChange) -> None: ...


class JobSlices(Protocol):
    """Where jobs get slices: the coordinator's slice provider."""

    def acquire(self, request: SliceRequest, slice_id: str) -> Any: ...

    def has_free(self, accelerator_type: str, num_slices: int) -> bool: ...

    def cluster(self) -> list[ClusterSlice]: ...


@dataclass(frozen=True)
class ControllerParts:
    """What a controller works with, besides its job.

    Attributes:
      store: the job store (attempt numbers, progress, metrics, logs, results).
      slices: where its slices come from.
      checkpoints: the job's checkpoints.
      clock: the job's goodput clock.
      on_progress: called after each loop the runner recorded.
      on_release: called after the job gave its slice back.
    """

    store: JobStore
    slices: JobSlices
    checkpoints: JobCheckpoints
    clock: GoodputClock
    on_progress: Callable[[], None]
    on_release: Callable[[], None]


class JobController:
    """Runs job ``job_id`` (see the module).

    Args:
      job_id: the job.
      spec: what was submitted.
      parts: what it works with.
      failure_policy: decides what follows a failed attempt.
      callbacks: told of every state change, in this order.
      stop: asks it to stop.
    """

    def __init__(self, job_id: str, spec: JobSpec, parts: ControllerParts,
                 failure_policy: FailurePolicy, callbacks: Sequence[StateCallback],
                 stop: StopSignal) -> None:
        self.job_id = job_id
        self.spec = spec
        self._parts = parts
        self._policy = failure_policy
        self._callbacks = tuple(callbacks)
        self.stop = stop
        self.state: JobStateData | None = None
        #: The attempt running on a slice now (``None`` between attempts).
        self.run_now: JobRun | None = None
        #: The names of the slices it holds now.
        self.slice_names: tuple[str, ...] = ()
        #: Restoring an in-memory checkpoint failed: later attempts read storage.
        self._memory_failed = False

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Runs the job until it is over, left in flight by the service stopping, or
        back in the queue (``PENDING``: it yielded its slice to a job of higher
        priority)."""
        state: JobStateData | None = Allocating(self._parts.store.record_attempt(self.job_id))
        self._set_state(state)
        try:
            while state is not None and not (state.state.is_terminal
                                             or isinstance(state, Pending | Suspended)):
                state = self._step(state)
        except Exception:
            logger.exception("job %s: its controller failed", self.job_id)
            self._set_state(Failed("the jaxpod service failed running the job:\n"
                                   + traceback.format_exc()))

    def _step(self, state: JobStateData) -> JobStateData | None:
        """One step of the state machine: the state after ``state`` (set already)."""
        if isinstance(state, Allocating):
            return self._allocate(state)
        if isinstance(state, Running):
            return self._run(state)
        if isinstance(state, Retrying):
            return self._back_off(state)
        raise AssertionError(f"no step from {state}")

    def _set_state(self, new: JobStateData | None, reason: str | None = None,
                   ended: AttemptEnd | None = None) -> JobStateData | None:
        change = StateChange(self.job_id, self.state, new, reason, ended)
        self.state = new
        for callback in self._callbacks:
            callback.after_state_change(change)
        return new

    # ------------------------------------------------------------------ states
    def _allocate(self, state: Allocating) -> JobStateData | None:
        """A slice within ``JOB_ALLOCATION_TIMEOUT``, then ``RUNNING`` from the latest
        checkpoint; each try waits ``JOB_ACQUIRE_TRY`` (a session may take the slice
        that looked free), and a stop is seen between tries. An elastic job that finds
        no slice of its type within ``JOB_ELASTIC_WAIT`` queues again for any type it
        accepts (``PENDING``)."""
        spec = self.spec
        kind = spec.accelerator_type or ""
        self._parts.store.set_attempt_type(self.job_id, kind)
        elastic = spec.elastic
        request = SliceRequest(
            accelerator_type=kind, num_slices=spec.num_slices,
            steps_per_run=spec.steps_per_run,
            computation_shape=tuple(spec.computation_shape or ()),
            timeout_s=(min(JOB_ACQUIRE_TRY.seconds(), JOB_ELASTIC_WAIT.seconds()) if elastic
                       else JOB_ACQUIRE_TRY.seconds()))
        deadline = Deadline(JOB_ALLOCATION_TIMEOUT.seconds())
        elastic_deadline = Deadline(JOB_ELASTIC_WAIT.seconds())
        step = self._parts.store.get(self.job_id).step
        while not self.stop.is_set():
            try:
                held = self._parts.slices.acquire(request, f"job-{self.job_id}-{state.attempt}")
            except AllocationTimeoutError as e:
                if elastic and elastic_deadline.expired():
                    reason = (f"no {kind} slice within {JOB_ELASTIC_WAIT.seconds():g}s "
                              f"({JOB_ELASTIC_WAIT.env_var}): queued for any of "
                              f"{', '.join(spec.preferences())}")
                    return self._set_state(Pending(0), reason,
                                           ended=AttemptEnd(state.attempt, reason, step))
                if deadline.expired():
                    return self._after_failure(state.attempt, step, Failure(
                        FailureKind.NO_SLICE, f"no {kind} slice within "
                        f"{JOB_ALLOCATION_TIMEOUT.seconds():g}s "
                        f"({JOB_ALLOCATION_TIMEOUT.env_var}): {e}"))
                logger.info("job %s: no free %s slice yet; waiting", self.job_id, kind)
                continue
            except SLICE_FAILURES as e:  # its workers did not start: try another slice
                return self._after_failure(state.attempt, step, Failure(
                    FailureKind.PREEMPTION, describe_error(e)), e)
            except (ValueError, TypeError) as e:  # the slice refused the job's shape
                return self._after_failure(state.attempt, step, Failure(
                    FailureKind.ERROR, "the job's slice could not be set up as it asks: "
                    + describe_error(e)), e)
            resume = self._parts.checkpoints.latest_step()
            memory = self._memory_plan(held, resume)
            if memory is not None:
                return self._set_state(
                    Running(state.attempt, memory.step, held=held, resume=memory.step,
                            memory=memory), f"resuming from {memory.describe()}")
            return self._set_state(
                Running(state.attempt, resume or 0, held=held, resume=resume),
                f"resuming from the checkpoint at step {resume}" if resume is not None
                else None)
        return self._stopped(state.attempt, step)

    def _memory_plan(self, held: Any, persistent: int | None) -> MemoryPlan | None:
        """The in-memory checkpoint to resume from: the newest whole one the slice's
        nodes hold, if it is at least as new as the persistent one (``None``: none, the
        job keeps none, or restoring one failed before)."""
        if self._memory_failed or not memory_checkpoints_on(self.spec):
            return None
        try:
            held_by = held.engine.memory_holdings(self.job_id, self.spec.mesh)
        except SLICE_FAILURES:
            raise
        except Exception as e:  # the persistent tier is always there
            logger.warning("job %s: reading the hosts' in-memory checkpoints failed: %s",
                           self.job_id, describe_error(e))
            return None
        newer_than = None if persistent is None else persistent - 1
        return memory_plan.plan(held_by, newer_than)

    def _run(self, state: Running) -> JobStateData | None:
        """The attempt's steps on its slice; the slice is given back however it ends."""
        held, store = state.held, self._parts.store
        attempts = store.attempts(self.job_id)
        reached = max((a.step_reached or 0 for a in attempts), default=0)
        ran = [a.accelerator_type for a in attempts[:-1] if a.running_at is not None]
        now_on = attempts[-1].accelerator_type if attempts else None
        moved_from = ran[-1] if ran and ran[-1] and ran[-1] != now_on else None
        run = JobRun(self.job_id, self.spec, held.engine, RunContext(
            store=store, checkpoints=self._parts.checkpoints, resume=state.resume,
            stop=self.stop, clock=self._parts.clock, on_progress=self._parts.on_progress,
            redo_until=reached, moved_from=moved_from, memory=state.memory))
        self.slice_names, self.run_now = tuple(held.description["slice_names"]), run
        deadline = self._runtime_limit(attempts)
        try:
            try:
                finished = run.run()
            except Stopped:
                return self._stopped(state.attempt, run.step)
            except PREEMPTIONS as e:
                failure, error = Failure(FailureKind.PREEMPTION, describe_error(e)), e
                self._memory_failed |= isinstance(e, MemoryRestoreError)
            except Exception as e:
                failure, error = Failure(FailureKind.ERROR, describe_error(e)), e
                if self._policy.gives_up_on(failure):  # no attempt follows to use them
                    run.drop_memory()
            else:
                return self._set_state(Succeeded(finished), ended=AttemptEnd(
                    state.attempt, "succeeded", finished.steps))
            self._parts.clock.switch(goodput.RECOVERING)  # giving up the slice included
        finally:
            if deadline is not None:
                deadline.cancel()
            self.slice_names, self.run_now = (), None
            try:
                held.release()
            except Exception:
                logger.exception("job %s: releasing its slice failed", self.job_id)
            self._parts.on_release()
        # Only now is what storage kept read: the slice's hosts are stopped, so none
        # can still commit a checkpoint (a survivor finishes one whose every part was
        # written before its peer was lost), and the step the failure names is the
        # step the next attempt resumes from.
        return self._after_failure(state.attempt, run.step, failure, error, run.memorized)

    def _runtime_limit(self, attempts: Sequence[Any]) -> threading.Timer | None:
        """Ends the job at its ``max_runtime_s`` (its attempts' running time before this
        one counted): it checkpoints at its next loop boundary and ends ``CANCELLED``."""
        limit = self.spec.max_runtime_s
        if limit is None:
            return None
        now = time.time()
        used = sum((a.ended_at or now) - a.running_at for a in attempts[:-1]
                   if a.running_at is not None)
        reason = (f"max_runtime_s={limit:g} reached: the job ran its time and ended with "
                  "a checkpoint of its last loop")
        timer = threading.Timer(max(0.0, limit - used), self.stop.request, (reason,),
                                {"kind": StopKind.DEADLINE})
        timer.daemon = True
        timer.start()
        return timer

    def _back_off(self, state: Retrying) -> JobStateData | None:
        if state.backoff_s and self.stop.wait(state.backoff_s):
            return self._stopped(None, self._parts.store.get(self.job_id).step)
        if self.stop.is_set():
            return self._stopped(None, self._parts.store.get(self.job_id).step)
        return self._set_state(Allocating(self._parts.store.record_attempt(self.job_id)))

    # ------------------------------------------------------------------ endings
    def _after_failure(self, attempt: int, step: int, failure: Failure,
                       error: BaseException | None = None, memorized: int | None = None
                       ) -> JobStateData | None:
        """Ends the attempt, saying how far it got and what the next one redoes (and
        ``error``'s type, or the notice), then retries or fails as the policy decides.
        ``memorized``: the last step the hosts kept in memory."""
        checkpoints = self._parts.checkpoints
        self._parts.clock.switch(goodput.RECOVERING)  # giving up the slice included
        kept = checkpoints.kept()  # the storage knows what the hosts finished
        self._parts.store.set_checkpoints(self.job_id, kept)
        resume_at = max(kept, default=0)
        what = (f"preemption notice ({error.notice})" if isinstance(error, Preempted)
                else type(error).__name__ if error is not None else failure.error)
        cause = (f"{failure.kind.value}: {what}; {max(0, step - resume_at)} step(s) lost, "
                 f"the next attempt starts at step {resume_at}")
        if memorized is not None and memorized > resume_at and not self._memory_failed:
            cause = (f"{failure.kind.value}: {what}; the next attempt starts at step "
                     f"{memorized} from the hosts' memory if its copies survived "
                     f"({max(0, step - memorized)} step(s) lost), else at step {resume_at} "
                     f"from storage ({max(0, step - resume_at)} lost)")
        logger.warning("job %s attempt %d %s", self.job_id, attempt, cause)
        ended = AttemptEnd(attempt, cause, step)
        if self.stop.is_set():
            return self._stopped(attempt, step, ended)
        decision = self._policy.decide(failure)
        if isinstance(decision, GiveUp):
            return self._set_state(Failed(decision.error), ended=ended)
        return self._set_state(Retrying(attempt, cause, decision.backoff_s), ended=ended)

    def _stopped(self, attempt: int | None, step: int,
                 ended: AttemptEnd | None = None) -> JobStateData | None:
        """Cancelled, left in flight when the service stops (no state change), or back
        in the queue when it yielded to a job of higher priority (not a retry: its
        budget is untouched, and it checkpointed first, so no step is lost)."""
        reason = self.stop.reason or "cancelled"
        if ended is None and attempt is not None:
            ended = AttemptEnd(attempt, reason, step)
        if self.stop.shutting_down:
            return self._set_state(None, ended=ended)
        if self.stop.checkpoints_first:
            self._parts.store.set_checkpoints(self.job_id, self._parts.checkpoints.kept())
        if self.stop.kind is StopKind.YIELD:
            return self._set_state(Pending(0), reason, ended=ended)
        if self.stop.kind is StopKind.SUSPEND:
            return self._set_state(Suspended(reason), ended=ended)
        return self._set_state(Cancelled(reason), ended=ended)


def describe_error(error: BaseException) -> str:
    """What users see of a job's exception: its type, message and the notes the
    replica group attached (the remote traceback and which hosts failed)."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") \
        else f"{kind.__module__}.{kind.__qualname__}"
    notes = "\n".join(getattr(error, "__notes__", ()))
    return f"{name}: {error}" + (f"\n{notes}" if notes else "")
