"""The job manager: queues, the dispatcher, and one runner thread per job on a slice.

Jobs wait in a FIFO queue per accelerator type (``PENDING``, with a visible position).
The dispatcher hands the head of a queue a slice as soon as one of its type is free
(warm, or idle in the cluster): the job moves to ``ALLOCATING`` and a runner thread
acquires the slice through the same provider as interactive sessions, runs the job
(``RUNNING``) and gives the slice back (kept warm for the next job or session). Only one
job per type allocates at a time, so jobs start in submission order.

Every state change goes through the :class:`~jaxpod.service.jobs.store.JobStore` (which
checks it against the state machine) and wakes the watchers through :class:`JobEvents`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

from jaxpod.errors import AllocationTimeoutError
from jaxpod.jobs import HostInput
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.jobs import goodput
from jaxpod.service.jobs.checkpoints import JobCheckpoints
from jaxpod.service.jobs.goodput import GoodputClock
from jaxpod.service.jobs.runner import SLICE_FAILURES, Finished, JobRun, Preempted, Stopped
from jaxpod.service.jobs.states import (
    Allocating,
    Cancelled,
    Failed,
    Retrying,
    Running,
    Succeeded,
)
from jaxpod.service.jobs.store import JobRecord, JobStore
from jaxpod.service.sessions import HeldSlice
from jaxpod.timeouts import Timeout

logger = logging.getLogger(__name__)

#: How long one try to acquire a slice for a job waits before the job checks whether it
#: was cancelled (another holder may have taken the slice that looked free).
JOB_ACQUIRE_TRY = Timeout("JAXPOD_JOB_ACQUIRE_TRY_S", 10.0)
#: The dispatcher looks for free slices on every release and submission, and at least
#: this often (capacity can also appear outside this service: a node joining).
DISPATCH_RECHECK = Timeout("JAXPOD_JOB_DISPATCH_RECHECK_S", 1.0)
#: How long stopping the service waits for running jobs to reach a loop boundary.
JOB_STOP_TIMEOUT = Timeout("JAXPOD_JOB_STOP_TIMEOUT_S", 30.0)
#: The reason recorded for a job stopped by the service's shutdown.
SHUTDOWN = "the service stopped"
#: The first wait before a preempted job's next attempt; it doubles with every
#: preemption, up to JOB_RETRY_BACKOFF_MAX.
JOB_RETRY_BACKOFF = Timeout("JAXPOD_JOB_RETRY_BACKOFF_S", 0.5)
JOB_RETRY_BACKOFF_MAX = Timeout("JAXPOD_JOB_RETRY_BACKOFF_MAX_S", 60.0)


def _backoff(preemptions: int) -> float:
    return min(JOB_RETRY_BACKOFF.seconds() * 2 ** (preemptions - 1),
               JOB_RETRY_BACKOFF_MAX.seconds())


class JobSlices(Protocol):
    """Where jobs get slices: the coordinator's slice provider."""

    def acquire(self, request: pb.AcquireSliceRequest, slice_id: str) -> HeldSlice: ...

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        """Whether an acquire of that shape would find a slice without waiting."""
        ...

    def cluster(self) -> list[pb.ClusterSlice]: ...


class JobEvents:
    """Tells watchers (asyncio tasks on the RPC loop) that a job changed.

    Each job has a version that every change bumps; a watcher reads the job, then
    waits for a version newer than the one it read, so no change is missed between
    reading and waiting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: collections.Counter[str] = collections.Counter()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def version(self, job_id: str) -> int:
        with self._lock:
            return self._versions[job_id]

    def changed(self, job_id: str) -> None:
        with self._lock:
            self._versions[job_id] += 1
            waiters = self._waiters.pop(job_id, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future)

    async def wait(self, job_id: str, version: int, timeout: float) -> None:
        """Returns once the job's version is past ``version``, or after ``timeout``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._versions[job_id] != version:
                return
            self._waiters.setdefault(job_id, []).append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            with self._lock:
                waiters = self._waiters.get(job_id, [])
                if (loop, future) in waiters:
                    waiters.remove((loop, future))


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Active:
    """A job that left its queue: its runner thread, and why it should stop."""

    job_id: str
    accelerator_type: str
    thread: threading.Thread
    stop: threading.Event
    reason: str = ""
    slice_names: tuple[str, ...] = ()
    run: JobRun | None = None  # the attempt running on a slice now


class JobManager:
    """Queues, starts, runs and cancels jobs.

    Args:
      store: the state dir's job store.
      slices: the slice provider shared with sessions.
    """

    def __init__(self, store: JobStore, slices: JobSlices) -> None:
        self.store = store
        self.slices = slices
        self.events = JobEvents()
        self._lock = threading.Condition()
        self._queues: dict[str, collections.deque[str]] = {}
        self._specs: dict[str, pb.JobSpec] = {}
        self._active: dict[str, _Active] = {}
        self._allocating: set[str] = set()  # accelerator types with a job acquiring
        # Each unfinished job's goodput clock, on the store's clock (time.time), so its
        # categories add up to finished_at - created_at.
        self._clocks: dict[str, GoodputClock] = {}
        self._goodput_saved: dict[str, float] = {}  # job -> when last stored (monotonic)
        self._closed = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="jaxpod-jobs",
                                             daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Recovers the state dir's jobs (PENDING ones queue again) and starts
        dispatching."""
        recovery = self.store.recover()
        for record in recovery.resumed:
            latest = self._checkpoints(record.id).steps()
            logger.warning("job %s was in flight when the last coordinator stopped: %s",
                           record.id, f"resuming from its checkpoint at step {latest[-1]}"
                           if latest else "no checkpoint: starting it over")
        now = time.time()
        with self._lock:
            for record in recovery.requeue:
                # The time the last coordinator did not record (and its downtime) goes
                # to recovering.
                self._clocks[record.id] = GoodputClock.from_totals(
                    self.store.goodput(record.id), wall_s=now - record.created_at,
                    category=goodput.QUEUED, clock=time.time)
                self._enqueue(record, self._load_spec(record.id))
        if recovery.requeue:
            logger.info("queued %d unfinished job(s) again", len(recovery.requeue))
        self._dispatcher.start()

    def close(self, timeout: float | None = None) -> None:
        """Stops dispatching; running jobs checkpoint and stop at their next loop
        boundary and give their slices back, staying ``RUNNING`` in the store (a
        coordinator restarted on the state dir resumes them)."""
        with self._lock:
            self._closed = True
            active = list(self._active.values())
            for a in active:
                a.reason = a.reason or SHUTDOWN
                a.stop.set()
            self._lock.notify_all()
        limit = JOB_STOP_TIMEOUT.resolve(timeout)
        for a in active:
            a.thread.join(limit)
            if a.thread.is_alive():
                logger.warning("job %s did not stop within %.0fs", a.job_id, limit)
        if self._dispatcher.is_alive():
            self._dispatcher.join(limit)

    def wake(self) -> None:
        """A slice may have become free (a release): the dispatcher looks again."""
        with self._lock:
            self._lock.notify_all()

    # ------------------------------------------------------------------ requests
    def submit(self, spec: pb.JobSpec, accelerator_type: str) -> JobRecord:
        """Records and queues a job whose spec the caller checked; ``accelerator_type``
        is the resolved (lower-case) type."""
        plain = {"steps_per_run": spec.steps_per_run, "num_slices": spec.num_slices,
                 "outputs": dict(spec.outputs),
                 "checkpoint_every": spec.checkpoint_every or None,
                 "max_retries_preemption": spec.max_retries_preemption,
                 "max_retries_failure": spec.max_retries_failure,
                 "has_input": bool(spec.dataset or spec.dataset_fn),
                 "has_state": bool(spec.init_fn)}
        stored = pb.JobSpec()
        stored.CopyFrom(spec)
        stored.accelerator_type = accelerator_type
        record = self.store.create_job(steps=spec.steps, payload=stored.SerializeToString(),
                                       spec=plain, name=spec.name or None,
                                       accelerator_type=accelerator_type)
        with self._lock:
            self._clocks[record.id] = GoodputClock(goodput.QUEUED, clock=time.time)
            self._enqueue(record, stored)
            self._lock.notify_all()
        self.events.changed(record.id)
        logger.info("job %s (%s) queued for %s", record.id, record.name, accelerator_type)
        return record

    def queue_positions(self) -> dict[str, int]:
        """Every queued job's position in its queue (0 is next), at one moment."""
        with self._lock:
            return {job_id: i for queue in self._queues.values()
                    for i, job_id in enumerate(queue)}

    def cancel(self, job_id: str, reason: str = "cancelled by a client") -> JobRecord:
        """Cancels a queued job at once, a running one at its next loop boundary (the
        returned record may still say ``RUNNING``); a finished job is left as it is."""
        record = self.store.get(job_id)
        moved: list[str] = []
        with self._lock:
            queue = self._queues.get(record.accelerator_type or "")
            if queue is not None and job_id in queue:
                moved = list(queue)[queue.index(job_id) + 1:]  # their positions change
                queue.remove(job_id)
                self._specs.pop(job_id, None)
                record = self.store.transition(job_id, Cancelled(reason))
                self._stop_clock(job_id)
            elif job_id in self._active:
                active = self._active[job_id]
                active.reason = active.reason or reason
                active.stop.set()
        for changed in (job_id, *moved):
            self.events.changed(changed)
        return record

    def checkpoints(self, job_id: str) -> list[tuple[int, str, float]]:
        """The job's committed checkpoints: step, path and save time, oldest first.

        Raises:
          jaxpod.JobNotFoundError: no job has that id.
        """
        self.store.get(job_id)
        return [(step, str(path), saved_at)
                for step, path, saved_at in self._checkpoints(job_id).listed()]

    def holders(self) -> dict[str, str]:
        """Slice name -> the job holding it."""
        with self._lock:
            return {name: f"job {a.job_id}" for a in self._active.values()
                    for name in a.slice_names}

    def host_inputs(self, job_id: str) -> tuple[HostInput, ...]:
        """Each host's input feed in the job's running attempt, as last read (empty when
        no attempt runs on a slice, or before the first read)."""
        with self._lock:
            active = self._active.get(job_id)
            run = active.run if active is not None else None
        return run.hosts if run is not None else ()

    def steps_per_s(self, record: JobRecord) -> float | None:
        """The job's steps per wall-clock second: its running attempt's recent rate,
        else what its last attempt that ran steps did (``None``: no steps ran yet)."""
        with self._lock:
            active = self._active.get(record.id)
            run = active.run if active is not None else None
        if run is not None:
            return run.rate.steps_per_s()
        return record.steps_per_s

    def goodput(self, job_id: str) -> dict[str, float]:
        """The job's goodput totals: live for an unfinished job, else as stored."""
        clock = self._clocks.get(job_id)
        return clock.totals() if clock is not None else self.store.goodput(job_id)

    def _clock(self, job_id: str) -> GoodputClock:
        clock = self._clocks.get(job_id)
        if clock is None:  # not expected: a job always gets one when queued
            clock = self._clocks[job_id] = GoodputClock(goodput.OTHER, clock=time.time)
        return clock

    def _save_goodput(self, job_id: str) -> None:
        with contextlib.suppress(Exception):  # accounting must never fail a job
            self.store.set_goodput(job_id, self._clock(job_id).totals())

    # ------------------------------------------------------------------ queueing
    def _load_spec(self, job_id: str) -> pb.JobSpec:
        return pb.JobSpec.FromString(self.store.load_payload(job_id))

    def _enqueue(self, record: JobRecord, spec: pb.JobSpec) -> None:
        self._queues.setdefault(record.accelerator_type or "", collections.deque()).append(
            record.id)
        self._specs[record.id] = spec

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                ready = [(t, q[0]) for t, q in self._queues.items()
                         if q and t not in self._allocating]
            started = False
            for accelerator_type, job_id in ready:
                spec = self._specs.get(job_id)
                if spec is None:
                    continue
                try:
                    free = self.slices.has_free(accelerator_type, spec.num_slices or 1)
                except Exception:
                    logger.exception("checking for free %s slices failed", accelerator_type)
                    free = False
                if free:
                    started |= self._start(accelerator_type, job_id)
            with self._lock:
                if not self._closed and not started:
                    self._lock.wait(DISPATCH_RECHECK.seconds())

    def _start(self, accelerator_type: str, job_id: str) -> bool:
        with self._lock:
            queue = self._queues.get(accelerator_type)
            if self._closed or not queue or queue[0] != job_id:
                return False  # cancelled meanwhile
            queue.popleft()
            spec = self._specs.pop(job_id)
            self._allocating.add(accelerator_type)
            active = _Active(job_id, accelerator_type, threading.Thread(
                target=self._run, args=(job_id, spec), name=f"jaxpod-job-{job_id}",
                daemon=True), threading.Event())
            self._active[job_id] = active
        # Positions of the jobs behind it moved up.
        for other in list(self._queues.get(accelerator_type, ())):
            self.events.changed(other)
        active.thread.start()
        return True

    # ------------------------------------------------------------------ running
    def _checkpoints(self, job_id: str) -> JobCheckpoints:
        return JobCheckpoints(self.store.job_dir(job_id) / "checkpoints")

    def _run(self, job_id: str, spec: pb.JobSpec) -> None:
        active = self._active[job_id]
        checkpoints = self._checkpoints(job_id)
        failures = preemptions = 0
        try:
            while True:
                attempt = self.store.record_attempt(job_id)
                outcome = self._attempt(job_id, spec, attempt, active, checkpoints)
                if not isinstance(outcome, _Retry):
                    return
                if outcome.preempted:
                    preemptions += 1
                    budget, used, kind = spec.max_retries_preemption, preemptions, "preempted"
                else:
                    failures += 1
                    budget, used, kind = spec.max_retries_failure, failures, "failed"
                if active.stop.is_set():
                    self._stopped(job_id, active)
                    return
                if used > budget:
                    budget_name = ("max_retries_preemption" if outcome.preempted
                                   else "max_retries_failure")
                    self._finish(job_id, Failed(
                        outcome.error if not outcome.preempted else
                        f"{kind} {used} times, more than {budget_name}={budget}; the last "
                        f"time: {outcome.error}"))
                    return
                self._change(job_id, Retrying(attempt, outcome.cause))
                if outcome.preempted and active.stop.wait(_backoff(preemptions)):
                    self._stopped(job_id, active)  # cancelled while backing off
                    return
                with self._lock:
                    self._allocating.add(active.accelerator_type)
        except Exception:
            logger.exception("job %s: the runner failed", job_id)
            self._finish(job_id, Failed("the jaxpod service failed running the job:\n"
                                        + traceback.format_exc()))
        finally:
            checkpoints.close()
            with self._lock:
                self._active.pop(job_id, None)
                self._allocating.discard(active.accelerator_type)
                self._lock.notify_all()

    def _attempt(self, job_id: str, spec: pb.JobSpec, attempt: int, active: _Active,
                 checkpoints: JobCheckpoints) -> _Retry | None:
        """One attempt: allocate, run (from the latest checkpoint), record; ``_Retry``
        when another attempt may follow."""
        clock = self._clock(job_id)
        clock.switch(goodput.ALLOCATING)
        self._change(job_id, Allocating(attempt))
        held = self._acquire(job_id, spec, attempt, active)
        if held is None:
            self.store.end_attempt(job_id, attempt, cause=active.reason or "cancelled",
                                   step_reached=self.store.get(job_id).step)
            self._stopped(job_id, active)
            return None
        try:
            with self._lock:
                self._allocating.discard(active.accelerator_type)
                active.slice_names = tuple(held.description["slice_names"])
                self._lock.notify_all()
            resume = checkpoints.latest()
            self._change(job_id, Running(attempt, resume.step if resume else 0),
                         f"resuming from the checkpoint at step {resume.step}" if resume
                         else "")
            reached = max((a.step_reached or 0 for a in self.store.attempts(job_id)),
                          default=0)
            run = JobRun(job_id, spec, held.engine, self.store, checkpoints, resume,
                         active.stop, lambda: active.reason,
                         lambda: active.reason == SHUTDOWN,
                         lambda: self._progress(job_id), clock, redo_until=reached)
            with self._lock:
                active.run = run
            try:
                finished = run.run()
            except Stopped:
                self.store.end_attempt(job_id, attempt, cause=active.reason,
                                       step_reached=run.step)
                self._stopped(job_id, active)
                return None
            except Preempted as e:
                return self._retry(job_id, attempt, run, checkpoints, e, preempted=True)
            except SLICE_FAILURES as e:
                return self._retry(job_id, attempt, run, checkpoints, e, preempted=True)
            except Exception as e:
                return self._retry(job_id, attempt, run, checkpoints, e, preempted=False)
            self._succeed(job_id, attempt, finished)
            return None
        finally:
            with self._lock:
                active.slice_names, active.run = (), None
            try:
                held.release()
            except Exception:
                logger.exception("job %s: releasing its slice failed", job_id)
            self.wake()

    def _acquire(self, job_id: str, spec: pb.JobSpec, attempt: int, active: _Active
                 ) -> HeldSlice | None:
        """A slice for the job; ``None`` if it was cancelled while waiting. Each try
        waits ``JOB_ACQUIRE_TRY`` (a session may take the slice that looked free)."""
        request = pb.AcquireSliceRequest(
            accelerator_type=spec.accelerator_type, num_slices=spec.num_slices or 1,
            steps_per_run=spec.steps_per_run, timeout_s=JOB_ACQUIRE_TRY.seconds())
        while not active.stop.is_set():
            try:
                return self.slices.acquire(request, f"job-{job_id}-{attempt}")
            except AllocationTimeoutError:
                logger.info("job %s: no free %s slice yet; waiting", job_id,
                            spec.accelerator_type)
        return None

    def _retry(self, job_id: str, attempt: int, run: JobRun, checkpoints: JobCheckpoints,
               error: BaseException, preempted: bool) -> _Retry:
        """Ends the attempt, recording how far it got and what the next one re-does."""
        self._clock(job_id).switch(goodput.RECOVERING)  # giving up the slice included
        with contextlib.suppress(Exception):  # a save in flight: it may still commit
            checkpoints.wait()
        saved = checkpoints.steps()
        resume_at = saved[-1] if saved else 0
        lost = max(0, run.step - resume_at)
        what = (f"preemption notice ({error.notice})" if isinstance(error, Preempted)
                else type(error).__name__)
        cause = (f"{'preempted' if preempted else 'failed'}: {what}; {lost} step(s) lost, "
                 f"the next attempt starts at step {resume_at}")
        self.store.end_attempt(job_id, attempt, cause=cause, step_reached=run.step)
        logger.warning("job %s attempt %d %s", job_id, attempt, cause)
        return _Retry(preempted, describe_error(error), cause)

    def _succeed(self, job_id: str, attempt: int, finished: Finished) -> None:
        self.store.save_result(job_id, finished.state, finished.outputs)
        self.store.end_attempt(job_id, attempt, cause="succeeded", step_reached=finished.steps)
        self._finish(job_id, Succeeded())

    def _stopped(self, job_id: str, active: _Active) -> None:
        if active.reason == SHUTDOWN:  # left in flight: the next coordinator resumes it
            self._save_goodput(job_id)
            return
        self._finish(job_id, Cancelled(active.reason or "cancelled"))

    def _progress(self, job_id: str) -> None:
        """A loop was recorded: watchers wake; goodput is saved now and then."""
        self.events.changed(job_id)
        now = time.monotonic()
        if now - self._goodput_saved.get(job_id, 0.0) >= 1.0:
            self._save_goodput(job_id)
            self._goodput_saved[job_id] = now

    def _stop_clock(self, job_id: str) -> None:
        self._goodput_saved.pop(job_id, None)
        clock = self._clocks.pop(job_id, None)
        if clock is not None:
            with contextlib.suppress(Exception):
                self.store.set_goodput(job_id, clock.stop())

    def _finish(self, job_id: str, state: Failed | Succeeded | Cancelled) -> None:
        # Its last checkpoints stay: they hold a cancelled or failed job's state, and a
        # large state that result(state=False) leaves on the hosts' storage.
        self._stop_clock(job_id)
        self._change(job_id, state)
        logger.info("job %s %s", job_id, state.state.value)

    def _change(self, job_id: str, state: Any, reason: str | None = None) -> None:
        self.store.transition(job_id, state, reason or None)
        if job_id in self._clocks:
            self._save_goodput(job_id)
        self.events.changed(job_id)


@dataclass(frozen=True)
class _Retry:
    """An attempt that ended in a way another attempt may get past."""

    preempted: bool
    error: str
    cause: str


def describe_error(error: BaseException) -> str:
    """What users see of a job's exception: its type, message and the notes the
    replica group attached (the remote traceback and which hosts failed)."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") \
        else f"{kind.__module__}.{kind.__qualname__}"
    notes = "\n".join(getattr(error, "__notes__", ()))
    return f"{name}: {error}" + (f"\n{notes}" if notes else "")

