"""The job manager: what the job RPCs call. It records submissions, cancels, and shows
jobs as they are now (the store's record with what only this process knows: queue
positions, live goodput and rates); :mod:`~jaxpod.service.jobs.dispatcher` decides
which queued job starts when and runs started ones, each under a
:class:`~jaxpod.service.jobs.controller.JobController`.

State changes reach the store, the goodput clock, the dispatcher and the watchers
through the controller's callbacks (:mod:`~jaxpod.service.jobs.bookkeeping`,
:mod:`~jaxpod.service.jobs.events`): nothing else writes a job's state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from jaxpod import settings
from jaxpod.errors import JobNotRunningError, PermissionDeniedError
from jaxpod.job_wrappers import ForkedStep
from jaxpod.jobs import (
    FORKABLE,
    HostInput,
    HostStacks,
    JobDetails,
    JobProfile,
    JobSpec,
    JobState,
    JobStatus,
)
from jaxpod.proto import stored
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.teams import DEFAULT_TEAM, Team
from jaxpod.service.auth.tokens import Principal
from jaxpod.service.jobs import goodput
from jaxpod.service.jobs.bookkeeping import ForkPinRelease, GoodputKeeper, StoreWriter
from jaxpod.service.jobs.checkpoints import ForkPins, JobCheckpoints
from jaxpod.service.jobs.controller import (
    ControllerParts,
    JobController,
    JobSlices,
    StopSignal,
)
from jaxpod.service.jobs.dispatcher import Dispatcher
from jaxpod.service.jobs.events import JobEvents
from jaxpod.service.jobs.goodput import summary
from jaxpod.service.jobs.policies import PriorityQueues, QueuePolicy, RetryBudgets
from jaxpod.service.jobs.retention import Retention, RetentionPolicy
from jaxpod.service.jobs.runner import JobRun
from jaxpod.service.jobs.states import Cancelled, Pending, Suspended
from jaxpod.service.jobs.store import JobStore
from jaxpod.service.slices.profiles import ProfileRequest
from jaxpod.shipping import ship_object

logger = logging.getLogger(__name__)

#: How long stopping the service waits for running jobs to reach a loop boundary.
JOB_STOP_TIMEOUT = settings.JOB_STOP_TIMEOUT


class JobManager:
    """Records, cancels and shows jobs; its :class:`Dispatcher` starts and runs them.

    Args:
      store: the state dir's job store.
      slices: the slice provider shared with sessions.
      checkpoint_dir: where the hosts write checkpoints, one folder per job (a path
        or URL every host reaches; default ``<state dir>/checkpoints``).
      queue: the queue policy (default: first in, first out per accelerator type).
      quotas: the owners' slice quotas (``None``: none); jobs over theirs wait.
      teams: the declared teams now (the tokens file's); ``None``: none, every job in
        the default team.
      retention: what is kept of finished jobs (default: the settings', as
        ``jaxpod serve`` without ``--retain-days``/``--retain-jobs``).
    """

    def __init__(self, store: JobStore, slices: JobSlices, checkpoint_dir: str | None = None,
                 queue: QueuePolicy | None = None, quotas: SliceQuotas | None = None,
                 teams: Callable[[], Mapping[str, Team]] | None = None,
                 retention: RetentionPolicy | None = None) -> None:
        self.store = store
        self.slices = slices
        self.quotas = quotas
        self.checkpoint_dir = checkpoint_dir or str(store.state_dir / "checkpoints")
        self.fork_pins = ForkPins(self.checkpoint_dir)
        self._fork_release = ForkPinRelease(store, self.fork_pins)
        self.events = JobEvents()
        self.goodput = GoodputKeeper(store)
        self.dispatcher = Dispatcher(
            slices, queue if queue is not None else PriorityQueues(), quotas,
            self.events, self._controller, teams if teams is not None else dict)
        if quotas is not None:
            quotas.count_jobs_with(self.dispatcher.slices_of)
        self.retention = Retention(store, retention or RetentionPolicy.from_settings(),
                                   lambda job_id: self.checkpoints(job_id).remove())

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
        for status in recovery.requeue:
            self.goodput.start(status.id, self.store.goodput(status.id), status.created_at)
            self.dispatcher.enqueue(status, stored.spec_from_payload(
                self.store.load_payload(status.id)))
        if recovery.requeue:
            logger.info("queued %d unfinished job(s) again", len(recovery.requeue))
        self.dispatcher.start()
        self.retention.start()

    def close(self, timeout: float | None = None) -> None:
        """Stops dispatching; running jobs checkpoint and stop at their next loop
        boundary and give their slices back, staying ``RUNNING`` in the store (a
        coordinator restarted on the state dir resumes them)."""
        self.retention.close()
        self.dispatcher.close(JOB_STOP_TIMEOUT.resolve(timeout))

    def wake(self) -> None:
        """A slice may have become free (a release): the dispatcher looks again."""
        self.dispatcher.wake()

    @property
    def preemptions(self) -> collections.Counter[str]:
        """Attempts preempted so far, by why (:attr:`Dispatcher.preemptions`)."""
        return self.dispatcher.preemptions

    # ------------------------------------------------------------------ requests
    def submit(self, spec: JobSpec, owner: str = "", team: str = DEFAULT_TEAM) -> JobStatus:
        """Records and queues a job whose spec the caller checked (its accelerator type
        resolved, lower case); ``owner`` names the token that submitted it, ``team``
        that token's team."""
        status = self.store.create_job(
            steps=spec.steps, payload=stored.spec_payload(spec),
            name=spec.name, accelerator_type=spec.accelerator_type, owner=owner,
            priority=spec.priority, team=team)
        self.goodput.start(status.id)
        self.dispatcher.enqueue(status, spec)
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

        def cancelled_in_queue() -> None:
            self.store.transition(job_id, Cancelled(reason))
            self.goodput.stop(job_id)
            self._fork_release.finished(job_id)

        self.dispatcher.cancel(job_id, reason, cancelled_in_queue)
        self.events.changed(job_id)
        return self.status(job_id)

    def suspend(self, job_id: str, reason: str = "suspended by a client") -> JobStatus:
        """Suspends a queued job at once, a running one at its next loop boundary after
        a checkpoint (the returned status may still say ``RUNNING``): it gives its
        slice up and waits, ``SUSPENDED``, until resumed. A suspended job is left as it
        is.

        Raises:
          JobNotRunningError: the job is over (a ``ValueError``).
        """
        status = self.store.get(job_id)
        if status.state.is_terminal:
            raise JobNotRunningError(
                f"suspend: job {job_id} is {status.state.value}: it is over, so there is "
                "nothing to suspend. Fork it from one of its checkpoints to run more "
                "(client.fork).")

        def suspended_in_queue() -> None:
            self.store.transition(job_id, Suspended(reason))
            self.goodput.clock(job_id).switch(goodput.SUSPENDED)
            self.goodput.save(job_id)

        if status.state is not JobState.SUSPENDED:
            self.dispatcher.suspend(job_id, reason, suspended_in_queue)
        self.events.changed(job_id)
        return self.status(job_id)

    def resume(self, job_id: str, reason: str = "resumed by a client") -> JobStatus:
        """Queues a suspended job again; it resumes from its last checkpoint.

        Raises:
          JobNotRunningError: the job is not ``SUSPENDED`` (a ``ValueError``).
        """
        status = self.store.get(job_id)
        if status.state is not JobState.SUSPENDED:
            raise JobNotRunningError(
                f"resume: job {job_id} is {status.state.value}, not SUSPENDED; only a "
                "suspended job resumes (job.suspend() suspends one).")
        spec = stored.spec_from_payload(self.store.load_payload(job_id))
        if self.goodput.totals(job_id) is None:  # suspended under an earlier coordinator
            self.goodput.start(job_id, self.store.goodput(job_id), status.created_at)
        status = self.store.transition(job_id, Pending(0), reason)
        self.goodput.clock(job_id).switch(goodput.QUEUED)
        self.dispatcher.enqueue(status, spec)
        self.events.changed(job_id)
        return self.status(job_id)

    def fork(self, source_id: str, step: int, steps: int | None,
             overrides: Mapping[str, Any], owner: str, team: str = DEFAULT_TEAM
             ) -> JobStatus:
        """Queues a new job, ``owner``'s, that runs steps ``step``..``steps`` of
        ``source_id``'s spec (``overrides``: fields of :data:`~jaxpod.jobs.FORKABLE`)
        from the source's checkpoint of ``step``, read in place; the source is untouched.

        Raises:
          ValueError: the source keeps no checkpoint of ``step``, ``steps`` is not past
            it, or an override is not forkable (the message says which are).
        """
        source = self.store.get(source_id)
        unknown = sorted(set(overrides) - set(FORKABLE))
        if unknown:
            raise ValueError(f"fork: {unknown} cannot be changed in a fork; it may change "
                             f"{', '.join(FORKABLE)} (the input, the state's structure and "
                             "the outputs stay the source's).")
        # Pinned before it is looked for: a running source's hosts delete old steps.
        pending = f"pending-{uuid.uuid4().hex}"
        earlier = self.fork_pins.pin(source_id, pending, step)
        try:
            status, spec = self._create_fork(source, step, steps, overrides, owner, team,
                                             earlier)
        except BaseException:
            self.fork_pins.unpin(source_id, pending)
            raise
        self.fork_pins.rename(source_id, pending, status.id)
        self.store.set_fork_origin(status.id, source_id, step)
        skeleton = self.store.state_skeleton(source_id)
        if skeleton is not None:
            self.store.set_state_skeleton(status.id, skeleton)
        self.goodput.start(status.id)
        self.dispatcher.enqueue(status, spec)
        self.events.changed(status.id)
        logger.info("job %s (%s) forked from job %s at step %d", status.id, status.name,
                    source_id, step)
        return self.status(status.id)

    def _create_fork(self, source: JobStatus, step: int, steps: int | None,
                     overrides: Mapping[str, Any], owner: str, team: str,
                     pinned_before: set[int]) -> tuple[JobStatus, JobSpec]:
        """The fork's row and spec, once its step is found kept, after it was pinned
        (see :meth:`fork`; ``pinned_before``: the source's steps other forks pinned)."""
        source_id = source.id
        checkpoints = self.checkpoints(source_id)
        kept = checkpoints.committed_steps()
        if step not in kept:
            raise ValueError(
                f"fork: job {source_id} keeps no checkpoint of step {step}; it keeps "
                f"{', '.join(map(str, kept)) or 'none'} (job.checkpoints() lists them). "
                "Fork from one of those.")
        # An unfinished source's hosts delete all but the newest `keep` steps as a save
        # starts, maybe before the pin reached them: only a step the next save keeps
        # too is safe (unless another fork pinned it before).
        safe = kept[len(kept) - checkpoints.keep + 1:] if checkpoints.keep > 1 else []
        if not source.state.is_terminal and step not in safe and step not in pinned_before:
            raise ValueError(
                f"fork: job {source_id} is {source.state.value}, and its hosts delete all "
                f"but its newest {checkpoints.keep} checkpoint(s) as they save, so step "
                f"{step} may be going. Fork from "
                + (f"step {' or '.join(map(str, safe))}, or " if safe else "")
                + "any step it keeps once it has finished.")
        spec = stored.spec_from_payload(self.store.load_payload(source_id))
        steps = steps or spec.steps
        if steps <= step:
            raise ValueError(f"fork: steps={steps} must be past the step it starts from "
                             f"({step}); pass steps=N with N > {step}.")
        changes = dict(overrides)
        if "step_fn" in changes:  # the fork's function in the source's step
            changes["step_fn"] = ship_object(
                ForkedStep(changes["step_fn"], spec.step_fn, dict(spec.runtime_versions or {})),
                "the fork's step", "").payload
        changes["name"] = changes.get("name") or f"{source.name}@{step}"
        spec = dataclasses.replace(spec, steps=steps, **changes)
        return self.store.create_job(
            steps=spec.steps, payload=stored.spec_payload(spec), name=spec.name,
            accelerator_type=source.accelerator_type, owner=owner, priority=spec.priority,
            team=team), spec

    def pin(self, job_id: str, pinned: bool = True) -> JobStatus:
        """Keeps the job whole for ever (``pinned``), or lets retention prune it once it
        is finished and past the limits."""
        self.store.set_pinned(job_id, pinned)
        self.events.changed(job_id)
        return self.status(job_id)

    # ------------------------------------------------------------------ reads
    def status(self, job_id: str) -> JobStatus:
        """The job as it is now (its queue position and live figures included).

        Raises:
          jaxpod.JobNotFoundError: no job has that id.
        """
        return self._live(self.store.get(job_id), self.dispatcher.positions())

    def statuses(self, state: str | None = None, limit: int | None = None,
                 offset: int = 0) -> list[JobStatus]:
        """Jobs in creation order (``state`` filters; ``limit`` and ``offset`` page)."""
        positions = self.dispatcher.positions()  # one snapshot: no position twice
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
        run = self._running(job_id, "a profile traces a running job's steps. Profile it "
                                    f"while `jaxpod job {job_id}` says RUNNING.")
        run.profiling.ask(request)
        profile = request.wait()  # bounded: the seconds + JAXPOD_JOB_PROFILE_WAIT_S
        self.store.add_profile(job_id, profile)
        return profile

    def stacks(self, job_id: str) -> list[HostStacks]:
        """Every thread's Python stack on each host of the job's running attempt, read
        now (its hosts answer while they run a loop).

        Raises:
          JobNotRunningError: the job is not running on a slice (a ``ValueError``).
        """
        return self._running(
            job_id, "stacks are read from the hosts of a running attempt. Ask again while "
                    f"`jaxpod job {job_id}` says RUNNING; a hung loop's stacks are in "
                    f"`jaxpod logs {job_id}`.").stacks()

    def host_inputs(self, job_id: str) -> tuple[HostInput, ...]:
        """Each host's input feed in the job's running attempt, as last read (empty when
        no attempt runs on a slice)."""
        run = self._run_now(job_id)
        return run.hosts if run is not None else ()

    def _run_now(self, job_id: str) -> JobRun | None:
        controller = self.dispatcher.controller(job_id)
        return controller.run_now if controller is not None else None

    def _running(self, job_id: str, why: str) -> JobRun:
        """The job's running attempt; else ``JobNotRunningError`` saying the job's state
        and ``why`` it must run."""
        status = self.store.get(job_id)
        run = self._run_now(job_id)
        if run is None:
            raise JobNotRunningError(f"Job {job_id} is {status.state.value}, not running on a "
                                     f"slice: {why}")
        return run

    def result(self, job_id: str, with_state: bool = True) -> dict[str, Any]:
        """A SUCCEEDED job's result to stream: its outputs and (``with_state``) its final
        state, read from its last checkpoint in blocks as the stream goes.

        Raises:
          ValueError: the job did not succeed (it has no result).
        """
        status = self.store.get(job_id)
        kept = self.store.load_result(job_id)
        if status.pruned_at is not None:
            raise ValueError(
                f"Job {status.id} {status.state.value} and was pruned by retention at "
                f"{time.ctime(status.pruned_at)}: its result and checkpoints are gone; its "
                "status keeps its last metrics. Pin jobs whose results you will want "
                "(job.pin()), or raise jaxpod serve's --retain-jobs/--retain-days.")
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
        return self.dispatcher.holders()

    def queued(self) -> dict[str, int]:
        """Queued jobs by accelerator type."""
        return self.dispatcher.queued()

    def _live(self, status: JobStatus, positions: dict[str, int]) -> JobStatus:
        """``status`` as stored, with what only this process knows now: its queue
        position, its running clock's goodput, its running attempt's rate and
        stragglers."""
        totals = self.goodput.totals(status.id)
        controller = self.dispatcher.controller(status.id)
        run = controller.run_now if controller is not None else None
        return dataclasses.replace(
            status, queue_position=positions.get(status.id),
            wait_reason=self.dispatcher.why_waiting(status, positions.get(status.id)),
            goodput=summary(totals) if totals else status.goodput,
            steps_per_s=run.rate.steps_per_s() if run is not None else status.steps_per_s,
            stragglers=tuple(h.host for h in run.hosts if h.straggler) if run else ())

    # ------------------------------------------------------------------ running
    def checkpoints(self, job_id: str) -> JobCheckpoints:
        """The job's checkpoint directory (a fork's reads its source's first)."""
        return JobCheckpoints(self.checkpoint_dir, job_id, self.store.fork_origin(job_id))

    def _controller(self, job_id: str, spec: JobSpec) -> JobController:
        parts = ControllerParts(
            store=self.store, slices=self.slices, checkpoints=self.checkpoints(job_id),
            clock=self.goodput.clock(job_id), on_release=self.wake,
            on_progress=lambda: self._progressed(job_id))
        return JobController(
            job_id, spec, parts,
            RetryBudgets(spec.max_retries_preemption, spec.max_retries_failure),
            callbacks=(StoreWriter(self.store), self.goodput, self.dispatcher, self.events,
                       self._fork_release),
            stop=StopSignal())

    def _progressed(self, job_id: str) -> None:
        """A loop was recorded: watchers wake; goodput is saved now and then."""
        self.events.changed(job_id)
        self.goodput.progressed(job_id)
