"""The job manager: the queue, the dispatcher, one controller per started job, and the
reads that show jobs as they are now.

Jobs wait in the :class:`~jaxpod.service.jobs.policies.QueuePolicy` (``PENDING``, with a
visible position). The dispatcher wakes on every submission, release, cancel and end of
an allocation (and every ``JAXPOD_JOB_DISPATCH_RECHECK_S``, for capacity that appears
outside this service: a node joining) and hands a queued job a free slice's type: a
:class:`~jaxpod.service.jobs.controller.JobController` then runs it to its end in a
thread of its own. Only one job per accelerator type allocates at a time, so jobs start
in queue order.

State changes reach the store, the goodput clock and the watchers through the
controller's callbacks (:mod:`~jaxpod.service.jobs.bookkeeping`,
:mod:`~jaxpod.service.jobs.events`): nothing else writes a job's state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from jaxpod import settings
from jaxpod.errors import PermissionDeniedError
from jaxpod.jobs import HostInput, JobDetails, JobProfile, JobSpec, JobState, JobStatus
from jaxpod.proto import stored
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.tokens import Principal
from jaxpod.service.jobs.bookkeeping import GoodputKeeper, StoreWriter
from jaxpod.service.jobs.checkpoints import JobCheckpoints
from jaxpod.service.jobs.controller import (
    SHUTDOWN,
    ControllerParts,
    JobController,
    JobSlices,
    StateChange,
    StopSignal,
)
from jaxpod.service.jobs.events import JobEvents
from jaxpod.service.jobs.goodput import summary
from jaxpod.service.jobs.policies import (
    FailureKind,
    LowerPriorityYields,
    PreemptionPolicy,
    PriorityQueues,
    QueuePolicy,
    RetryBudgets,
    RunningJob,
)
from jaxpod.service.jobs.states import (
    Allocating,
    Cancelled,
    Pending,
    Retrying,
    Running,
)
from jaxpod.service.jobs.store import JobStore
from jaxpod.service.slices.profiles import ProfileRequest

logger = logging.getLogger(__name__)

#: The dispatcher looks for free slices on every release and submission, and at least
#: this often (capacity can also appear outside this service: a node joining).
DISPATCH_RECHECK = settings.JOB_DISPATCH_RECHECK
#: How long stopping the service waits for running jobs to reach a loop boundary.
JOB_STOP_TIMEOUT = settings.JOB_STOP_TIMEOUT


class JobManager:
    """Queues, starts, runs, cancels and shows jobs.

    Args:
      store: the state dir's job store.
      slices: the slice provider shared with sessions.
      checkpoint_dir: where the hosts write checkpoints, one folder per job (a path
        or URL every host reaches; default ``<state dir>/checkpoints``).
      queue: the queue policy (default: first in, first out per accelerator type).
      quotas: the owners' slice quotas (``None``: none); jobs over theirs wait.
      preemption: which running job yields its slice to a queued one of higher
        priority (default: the lowest priority below the waiting job's).
    """

    def __init__(self, store: JobStore, slices: JobSlices, checkpoint_dir: str | None = None,
                 queue: QueuePolicy | None = None, quotas: SliceQuotas | None = None,
                 preemption: PreemptionPolicy | None = None) -> None:
        self.store = store
        self.slices = slices
        self.quotas = quotas
        if quotas is not None:
            quotas.count_jobs_with(self.slices_of)
        self.checkpoint_dir = checkpoint_dir or str(store.state_dir / "checkpoints")
        self.events = JobEvents()
        self.goodput = GoodputKeeper(store)
        self._queue = queue if queue is not None else PriorityQueues()
        self._preemption = preemption if preemption is not None else LowerPriorityYields()
        self._yielding: dict[str, str] = {}  # a job giving its slice up -> to which job
        self._started: dict[str, float] = {}  # started jobs -> when (monotonic)
        #: Attempts preempted so far, by why: ``priority`` (a job of higher priority
        #: took the slice) or ``slice`` (a notice, a lost host, a broken slice).
        self.preemptions: collections.Counter[str] = collections.Counter()
        self._lock = threading.Condition()
        self._specs: dict[str, JobSpec] = {}  # queued jobs' specs
        self._owners: dict[str, str] = {}  # queued and started jobs' owners
        self._wait_reasons: dict[str, str] = {}  # queued jobs held back by their quota
        self._active: dict[str, JobController] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._allocating: set[str] = set()  # accelerator types with a job acquiring
        self._kicked = False
        self._closed = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="jaxpod-jobs",
                                             daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Recovers the state dir's jobs (unfinished ones queue again) and starts
        dispatching."""
        recovery = self.store.recover()
        for status in recovery.requeue:  # steps committed after the last one recorded
            self.store.set_checkpoints(status.id, self.checkpoints(status.id).kept())
        for status in recovery.resumed:
            latest = self.checkpoints(status.id).latest_step()
            logger.warning("job %s was in flight when the last coordinator stopped: %s",
                           status.id, f"resuming from its checkpoint at step {latest}"
                           if latest is not None else "no checkpoint: starting it over")
        with self._lock:
            for status in recovery.requeue:
                self.goodput.start(status.id, self.store.goodput(status.id), status.created_at)
                self._enqueue(status, stored.spec_from_payload(
                    self.store.load_payload(status.id)))
        if recovery.requeue:
            logger.info("queued %d unfinished job(s) again", len(recovery.requeue))
        self._dispatcher.start()

    def close(self, timeout: float | None = None) -> None:
        """Stops dispatching; running jobs checkpoint and stop at their next loop
        boundary and give their slices back, staying ``RUNNING`` in the store (a
        coordinator restarted on the state dir resumes them)."""
        with self._lock:
            self._closed = True
            for controller in self._active.values():
                controller.stop.request(SHUTDOWN)
            threads = list(self._threads.items())
            self._kick()
        limit = JOB_STOP_TIMEOUT.resolve(timeout)
        for job_id, thread in threads:
            thread.join(limit)
            if thread.is_alive():
                logger.warning("job %s did not stop within %.0fs", job_id, limit)
        if self._dispatcher.is_alive():
            self._dispatcher.join(limit)

    def wake(self) -> None:
        """A slice may have become free (a release): the dispatcher looks again."""
        with self._lock:
            self._kick()

    def _kick(self) -> None:
        """Under the lock: something the dispatcher looks at changed. The flag keeps a
        change made while it is not waiting (it is checking for free slices) from being
        missed until its next recheck."""
        self._kicked = True
        self._lock.notify_all()

    # ------------------------------------------------------------------ requests
    def submit(self, spec: JobSpec, owner: str = "") -> JobStatus:
        """Records and queues a job whose spec the caller checked (its accelerator type
        resolved, lower case); ``owner`` names the token that submitted it."""
        status = self.store.create_job(
            steps=spec.steps, payload=stored.spec_payload(spec),
            name=spec.name, accelerator_type=spec.accelerator_type, owner=owner,
            priority=spec.priority)
        with self._lock:
            self.goodput.start(status.id)
            self._enqueue(status, spec)
            self._kick()
        self.events.changed(status.id)
        logger.info("job %s (%s) queued for %s", status.id, status.name,
                    spec.accelerator_type)
        return self.status(status.id)

    def check_owner(self, job_id: str, caller: Principal, what: str) -> None:
        """Raises :class:`PermissionDeniedError` unless ``caller`` owns the job or is an
        admin (:class:`JobNotFoundError` for an unknown id)."""
        owner = self.store.get(job_id).owner
        if not caller.owns(owner):
            raise PermissionDeniedError(
                f"{what}: job {job_id} belongs to {owner or 'nobody recorded'!r}, and the "
                f"token {caller.name!r} ({caller.role}) acts only on its own jobs; only "
                "the job's owner or an admin may do that.")

    def audit(self, who: str, action: str, target: str, detail: str = "") -> None:
        """Appends to the audit log; a failure is logged, never raised: the action it
        records already happened (a submission that raised here would be sent again)."""
        try:
            self.store.record_audit(who, action, target, detail)
        except Exception:
            logger.exception("the audit log missed: %s %s %s", who, action, target)

    def cancel(self, job_id: str, reason: str = "cancelled by a client") -> JobStatus:
        """Cancels a queued job at once, a running one at its next loop boundary (the
        returned status may still say ``RUNNING``); a finished job is left as it is."""
        self.store.get(job_id)  # an unknown id is an error, not a no-op
        moved: list[str] = []
        with self._lock:
            before = self._queue.positions()
            if self._queue.remove(job_id):
                self._specs.pop(job_id, None)
                self._owners.pop(job_id, None)
                moved = [j for j, p in before.items() if p > before[job_id]]
                self.store.transition(job_id, Cancelled(reason))
                self.goodput.stop(job_id)
            elif job_id in self._active:
                self._active[job_id].stop.request(reason)
        for changed in (job_id, *moved):
            self.events.changed(changed)
        return self.status(job_id)

    # ------------------------------------------------------------------ reads
    def status(self, job_id: str) -> JobStatus:
        """The job as it is now (its queue position and live figures included).

        Raises:
          jaxpod.JobNotFoundError: no job has that id.
        """
        return self._live(self.store.get(job_id), self._positions())

    def statuses(self, state: str | None = None, limit: int | None = None,
                 offset: int = 0) -> list[JobStatus]:
        """Jobs in creation order (``state`` filters; ``limit`` and ``offset`` page)."""
        positions = self._positions()  # one snapshot: no position twice
        return [self._live(s, positions) for s in self.store.list(state, limit, offset)]

    def details(self, job_id: str) -> JobDetails:
        """The job in full: its status, history, attempts, the running attempt's host
        input figures, its checkpoints and its profiles."""
        status = self.status(job_id)
        return JobDetails(
            status, tuple(self.store.history(job_id)), tuple(self.store.attempts(job_id)),
            self.host_inputs(job_id), tuple(self.store.checkpoints(job_id)),
            tuple(self.store.profiles(job_id)))

    def profile(self, job_id: str, seconds: float) -> JobProfile:
        """A ``jax.profiler`` trace of ``seconds`` on every host of the job's running
        attempt, started at its next loop boundary; answers once the hosts wrote it
        (see :mod:`jaxpod.service.slices.profiles`).

        Raises:
          ValueError: the job is not running on a slice, or its attempt ended first.
          TimeoutError: the trace was not written in time (its loops are too long).
        """
        request = ProfileRequest(seconds)
        status = self.store.get(job_id)
        controller = self._active.get(job_id)
        run = controller.run_now if controller is not None else None
        if run is None:
            raise ValueError(
                f"Job {job_id} is {status.state.value}, not running on a slice: a profile "
                "traces a running job's steps. Profile it while `jaxpod job "
                f"{job_id}` says RUNNING.")
        run.profiling.ask(request)
        profile = request.wait()
        self.store.add_profile(job_id, profile)
        return profile

    def host_inputs(self, job_id: str) -> tuple[HostInput, ...]:
        """Each host's input feed in the job's running attempt, as last read (empty when
        no attempt runs on a slice)."""
        controller = self._active.get(job_id)
        run = controller.run_now if controller is not None else None
        return run.hosts if run is not None else ()

    def result(self, job_id: str, with_state: bool = True) -> dict[str, Any]:
        """A SUCCEEDED job's result to stream: its outputs and (``with_state``) its final
        state, read from its last checkpoint in blocks as the stream goes.

        Raises:
          ValueError: the job did not succeed (it has no result).
        """
        status = self.store.get(job_id)
        kept = self.store.load_result(job_id)
        if status.state is not JobState.SUCCEEDED or kept is None:
            raise ValueError(
                f"Job {status.id} is {status.state.value}: only a SUCCEEDED job has a "
                "result. Wait for it (job.wait()), or read job.status().error.")
        state = kept.legacy_state if with_state else None
        skeleton = self.store.state_skeleton(job_id)
        saved = self.store.checkpoints(job_id)
        if with_state and skeleton is not None and saved:
            numbered = stored.skeleton_from(skeleton)
            state = self.checkpoints(job_id).state(saved[-1].step, numbered,
                                                   stored.stream_order(numbered))
        return {"state": state, "outputs": kept.outputs}

    def holders(self) -> dict[str, str]:
        """Slice name -> the job holding it."""
        with self._lock:
            return {name: f"job {job_id}" for job_id, c in self._active.items()
                    for name in c.slice_names}

    def _positions(self) -> dict[str, int]:
        with self._lock:
            return self._queue.positions()

    def _live(self, status: JobStatus, positions: dict[str, int]) -> JobStatus:
        """``status`` as stored, with what only this process knows now: its queue
        position, its running clock's goodput and its running attempt's rate."""
        totals = self.goodput.totals(status.id)
        controller = self._active.get(status.id)
        run = controller.run_now if controller is not None else None
        return dataclasses.replace(
            status, queue_position=positions.get(status.id),
            wait_reason=self._why_waiting(status, positions.get(status.id)),
            goodput=summary(totals) if totals else status.goodput,
            steps_per_s=run.rate.steps_per_s() if run is not None else status.steps_per_s)

    def _why_waiting(self, status: JobStatus, position: int | None) -> str | None:
        """What a queued job waits for, as its status says it."""
        if status.state is not JobState.PENDING or position is None:
            return None
        quota = self._wait_reasons.get(status.id)
        if quota is not None:
            return f"over quota: {quota}"
        if position > 0:
            return (f"behind {position} queued job(s) of its type (higher priority, or "
                    "submitted earlier)")
        giving = [v for v, for_job in list(self._yielding.items()) if for_job == status.id]
        if giving:
            return f"job {giving[0]} is giving its slice up (checkpointing first)"
        return f"no free {status.accelerator_type or 'slice'} slice"

    # ------------------------------------------------------------------ queueing
    def _enqueue(self, status: JobStatus, spec: JobSpec) -> None:
        self._queue.push(status.id, status.accelerator_type, spec.priority)
        self._specs[status.id] = spec
        self._owners[status.id] = status.owner

    def queued(self) -> dict[str, int]:
        """Queued jobs by accelerator type."""
        with self._lock:
            return dict(collections.Counter(s.accelerator_type or "" for s in self._specs.values()))

    def slices_of(self, owner: str) -> int:
        """The slices ``owner``'s started jobs hold or are acquiring."""
        with self._lock:
            return sum(c.spec.num_slices for job_id, c in self._active.items()
                       if self._owners.get(job_id) == owner)

    def _over_quota(self) -> set[str]:
        """The queued jobs their owners' quotas hold back now; each one's reason is kept
        for its status (a change is an event)."""
        if self.quotas is None:
            return set()
        with self._lock:
            queued = [(job_id, self._owners.get(job_id, ""), spec.num_slices)
                      for job_id, spec in self._specs.items()]
        verdicts: dict[tuple[str, int], str | None] = {}  # one count per owner and size
        for _, owner, wanted in queued:
            if (owner, wanted) not in verdicts:
                verdicts[owner, wanted] = self.quotas.over(owner, wanted)
        reasons = {job_id: why for job_id, owner, wanted in queued
                   if (why := verdicts[owner, wanted]) is not None}
        with self._lock:
            changed = {j for j in set(reasons) | set(self._wait_reasons)
                       if reasons.get(j) != self._wait_reasons.get(j)}
            self._wait_reasons = reasons
        for job_id in changed:
            self.events.changed(job_id)
        return set(reasons)

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._kicked = False
            held_back = self._over_quota()
            with self._lock:
                candidates = self._queue.candidates(self._allocating, held_back)
            started = False
            for accelerator_type, job_id in candidates:
                spec = self._specs.get(job_id)
                if spec is None:
                    continue
                try:
                    free = self.slices.has_free(accelerator_type, spec.num_slices)
                except Exception:
                    logger.exception("checking for free %s slices failed", accelerator_type)
                    free = False
                if free:
                    started |= self._start_within_quota(accelerator_type, job_id, spec)
                else:
                    self._preempt_for(accelerator_type, job_id, spec)
            with self._lock:
                if not (self._closed or started or self._kicked):
                    self._lock.wait(DISPATCH_RECHECK.seconds())

    def _preempt_for(self, accelerator_type: str, job_id: str, spec: JobSpec) -> None:
        """Asks a running job of lower priority (the preemption policy's choice) to give
        its slice to ``job_id``: it checkpoints at its next loop boundary, releases the
        slice and queues again. One job of a type yields at a time."""
        with self._lock:
            if any(self._active[j].spec.accelerator_type == accelerator_type
                   for j in self._yielding if j in self._active):
                return  # a slice of the type is being given up already
            running = [RunningJob(j, c.spec.accelerator_type or "", c.spec.priority,
                                  c.spec.num_slices, self._started.get(j, 0.0))
                       for j, c in self._active.items() if isinstance(c.state, Running)]
            victim = self._preemption.victim(spec.priority, accelerator_type, running)
            if victim is None:
                return
            self._yielding[victim] = job_id
            controller = self._active[victim]
        reason = (f"preempted by job {job_id} (priority {spec.priority} over "
                  f"{controller.spec.priority}): checkpointed, it waits for a slice again")
        logger.info("job %s %s", victim, reason)
        controller.stop.request(reason, yielding=True)

    def _start_within_quota(self, accelerator_type: str, job_id: str, spec: JobSpec) -> bool:
        if self.quotas is None:
            return self._start(accelerator_type, job_id)
        started = [False]

        def start() -> None:
            started[0] = self._start(accelerator_type, job_id)

        owner = self._owners.get(job_id, "")
        return self.quotas.admit(owner, spec.num_slices, start) is None and started[0]

    def _start(self, accelerator_type: str, job_id: str) -> bool:
        with self._lock:
            if self._closed or job_id not in self._specs or not self._queue.remove(job_id):
                return False  # cancelled meanwhile
            spec = self._specs.pop(job_id)
            self._allocating.add(accelerator_type)  # before the dispatcher looks again
            self._started[job_id] = time.monotonic()
            controller = self._controller(job_id, spec)
            thread = threading.Thread(target=self._run, args=(controller,),
                                      name=f"jaxpod-job-{job_id}", daemon=True)
            self._active[job_id], self._threads[job_id] = controller, thread
        for other in self._queue_snapshot():  # their positions moved up
            self.events.changed(other)
        thread.start()
        return True

    def _queue_snapshot(self) -> list[str]:
        with self._lock:
            return list(self._queue.positions())

    # ------------------------------------------------------------------ running
    def checkpoints(self, job_id: str) -> JobCheckpoints:
        """The job's checkpoint directory."""
        return JobCheckpoints(self.checkpoint_dir, job_id)

    def _controller(self, job_id: str, spec: JobSpec) -> JobController:
        parts = ControllerParts(
            store=self.store, slices=self.slices, checkpoints=self.checkpoints(job_id),
            clock=self.goodput.clock(job_id), on_release=self.wake,
            on_progress=lambda: self._progressed(job_id))
        return JobController(
            job_id, spec, parts,
            RetryBudgets(spec.max_retries_preemption, spec.max_retries_failure),
            callbacks=(StoreWriter(self.store), self.goodput, self, self.events),
            stop=StopSignal())

    def after_state_change(self, change: StateChange) -> None:
        """Keeps one job per accelerator type acquiring a slice at a time: no other job
        of its type starts while one is ``ALLOCATING`` (jobs start in queue order)."""
        controller = self._active.get(change.job_id)
        if controller is None:
            return
        with self._lock:
            kind = controller.spec.accelerator_type or ""
            if isinstance(change.new, Allocating):
                self._allocating.add(kind)
            elif isinstance(change.old, Allocating):
                self._allocating.discard(kind)
            if isinstance(change.new, Retrying) and change.new.cause.startswith(
                    FailureKind.PREEMPTION.value):
                self.preemptions["slice"] += 1
            if isinstance(change.new, Pending):  # it yielded: first of its priority again
                self.preemptions["priority"] += 1
                self._yielding.pop(change.job_id, None)
                self._specs[change.job_id] = controller.spec
                self._queue.push(change.job_id, kind, controller.spec.priority, first=True)
            self._kick()

    def _run(self, controller: JobController) -> None:
        job_id = controller.job_id
        try:
            controller.run()
        finally:
            with self._lock:
                if self._active.get(job_id) is controller:  # not started again since
                    del self._active[job_id]
                    self._threads.pop(job_id, None)
                    self._started.pop(job_id, None)
                self._yielding.pop(job_id, None)
                if job_id not in self._specs and job_id not in self._active:
                    self._owners.pop(job_id, None)  # over, not queued again
                self._kick()
        if isinstance(controller.state, Pending):  # the queue's positions moved
            for other in self._queue_snapshot():
                self.events.changed(other)

    def _progressed(self, job_id: str) -> None:
        """A loop was recorded: watchers wake; goodput is saved now and then."""
        self.events.changed(job_id)
        self.goodput.progressed(job_id)
