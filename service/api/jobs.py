"""The job RPCs of the ``Coordinator`` service (a mixin of ``CoordinatorService``).

Requests are checked here, before anything is recorded: a spec the workers could not
run (no step function, both inputs, an unknown reduce op or accelerator type, another
runtime than the service's) is refused with what was received and how to fix it, and
nothing is queued. What only the workers can tell (a step that does not return
``(state, outputs)``) ends the job ``FAILED`` with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from jaxpod import settings
from jaxpod.jobs import (
    FORKABLE,
    TERMINAL_STATES,
    HostStacks,
    JobProfile,
    JobSpec,
    JobState,
    JobStatus,
    check_outputs,
    check_profile_seconds,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto.job_messages import from_message, to_message
from jaxpod.service.api.stopping import Stopping
from jaxpod.service.auth.tokens import Principal
from jaxpod.service.jobs.manager import JobManager
from jaxpod.shipping import runtime_versions
from jaxpod.timeouts import Deadline

_T = TypeVar("_T")

#: A watch re-reads its job at least this often (a change recorded by another process
#: on the same state dir has no event here).
WATCH_RECHECK = settings.JOB_WATCH_RECHECK
#: How long CancelJob waits for a running job to stop at its next loop boundary before
#: answering with the state it is in (it stops all the same, later).
CANCEL_WAIT = settings.JOB_CANCEL_WAIT
#: The most audit records one ListAudit answer holds.
MAX_AUDIT_PAGE = 10_000
#: The most log lines one GetJobLogs answer holds, and about the most bytes: a long
#: job's log (stacks of every host included) comes in pages, never one huge message.
LOG_PAGE_LINES = 10_000
LOG_PAGE_BYTES = 1 << 20


class JobsServicer:
    """``SubmitJob`` ... ``ProfileJob``, ``ListAudit``; the class using it provides ``jobs``,
    ``slices``, ``stopping`` and ``_blocking``."""

    jobs: JobManager | None
    slices: Any
    stopping: Stopping

    async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        raise NotImplementedError  # provided by CoordinatorService

    def _stream(self, compute: Callable[[], Any]) -> AsyncIterator[Any]:
        raise NotImplementedError  # provided by CoordinatorService

    def caller(self, context: Any) -> Principal:
        raise NotImplementedError  # provided by CoordinatorService

    def _manager(self) -> JobManager:
        if self.jobs is None:
            raise NotImplementedError(
                "This jaxpod service runs without a job store, so it takes no jobs; start "
                "it with `jaxpod serve` (its --state-dir keeps the jobs).")
        return self.jobs

    # ------------------------------------------------------------------ requests
    async def SubmitJob(self, request: pb.JobSpec, context: Any) -> pb.JobStatus:
        manager = self._manager()
        spec = check_spec(from_message(JobSpec, request))
        caller = self.caller(context)
        who = caller.name
        if manager.quotas is not None:
            manager.quotas.check_fits(who, spec.num_slices, "SubmitJob")
        spec = await self._blocking(self._resolve_types, spec)
        status = await self._blocking(manager.submit, spec, who, caller.team)
        await self._blocking(manager.audit, who, "submit", status.id,
                             f"{status.name} on {status.accelerator_type}")
        return to_message(status)

    async def GetJob(self, request: pb.JobRequest, context: Any) -> pb.JobDetails:
        manager = self._manager()
        if request.detail:
            return to_message(await self._blocking(manager.details, request.job_id))
        return pb.JobDetails(status=to_message(
            await self._blocking(manager.status, request.job_id)))

    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.JobList:
        manager = self._manager()
        if request.limit < 0 or request.offset < 0:
            raise ValueError(f"ListJobs: limit and offset must be >= 0; got limit="
                             f"{request.limit}, offset={request.offset}.")
        statuses = await self._blocking(manager.statuses, request.state or None,
                                        request.limit or None, request.offset)
        return pb.JobList(jobs=[to_message(s) for s in statuses])

    async def WatchJob(self, request: pb.JobRequest, context: Any
                       ) -> AsyncIterator[pb.JobStatus]:
        statuses = watch_statuses(self._manager(), request.job_id, self._blocking)
        while (status := await self.stopping.next(statuses, "WatchJob")) is not None:
            yield to_message(status)

    async def CancelJob(self, request: pb.JobRequest, context: Any) -> pb.JobStatus:
        return to_message(await cancel_and_wait(self._manager(), request.job_id,
                                                self._blocking, self.caller(context)))

    async def SuspendJob(self, request: pb.JobRequest, context: Any) -> pb.JobStatus:
        return to_message(await suspend_or_resume(self._manager(), request.job_id, False,
                                                  self._blocking, self.caller(context)))

    async def ResumeJob(self, request: pb.JobRequest, context: Any) -> pb.JobStatus:
        return to_message(await suspend_or_resume(self._manager(), request.job_id, True,
                                                  self._blocking, self.caller(context)))

    async def ForkJob(self, request: pb.ForkJobRequest, context: Any) -> pb.JobStatus:
        overrides = from_message(JobSpec, request.overrides)
        changes = {name: getattr(overrides, name) for name in request.override
                   if hasattr(overrides, name)}
        unknown = sorted(set(request.override) - set(changes))
        if unknown:
            raise ValueError(f"fork: no spec field {unknown[0]!r}; forkable: "
                             f"{', '.join(FORKABLE)}.")
        return to_message(await fork_job(self._manager(), request.job_id, request.step,
                                         request.steps or None, changes, self._blocking,
                                         self.caller(context)))

    async def PinJob(self, request: pb.PinJobRequest, context: Any) -> pb.JobStatus:
        return to_message(await pin_job(self._manager(), request.job_id, request.pinned,
                                        self._blocking, self.caller(context)))

    def GetJobResult(self, request: pb.JobRequest, context: Any) -> AsyncIterator[Any]:
        manager, caller = self._manager(), self.caller(context)

        def result() -> Any:
            manager.check_owner(request.job_id, caller, "GetJobResult")
            return manager.result(request.job_id, with_state=not request.without_state)

        return self._stream(result)

    async def GetJobMetrics(self, request: pb.JobRequest, context: Any) -> pb.JobMetrics:
        manager = self._manager()
        series = await self._blocking(manager.store.metrics, request.job_id)
        return pb.JobMetrics(series=[
            pb.MetricSeries(name=name, steps=[s for s, _ in points],
                            values=[v for _, v in points])
            for name, points in series.items()])

    async def GetJobLogs(self, request: pb.JobLogsRequest, context: Any) -> pb.JobLogs:
        manager = self._manager()
        await self._blocking(manager.check_owner, request.job_id, self.caller(context),
                             "GetJobLogs")
        limit = request.limit or LOG_PAGE_LINES
        if not 1 <= limit <= LOG_PAGE_LINES or request.after < 0:
            raise ValueError(f"GetJobLogs: limit must be 1-{LOG_PAGE_LINES} (0: "
                             f"{LOG_PAGE_LINES}) and after >= 0; got limit={request.limit}, "
                             f"after={request.after}.")
        lines = await self._blocking(manager.store.logs, request.job_id, request.after,
                                     limit + 1)
        page: list[pb.LogLine] = []
        size = 0
        for x in lines[:limit]:  # a page stays far under the message limit
            size += len(x.line.encode()) + 32
            if page and size > LOG_PAGE_BYTES:
                break
            page.append(pb.LogLine(seq=x.seq, host=x.host, line=x.line, at=x.at))
        return pb.JobLogs(lines=page, more=len(page) < len(lines))

    async def GetJobStacks(self, request: pb.JobRequest, context: Any) -> pb.JobStacks:
        stacks = await job_stacks(self._manager(), request.job_id, self._blocking,
                                  self.caller(context))
        return pb.JobStacks(hosts=[to_message(s) for s in stacks])

    async def ProfileJob(self, request: pb.ProfileJobRequest, context: Any
                         ) -> pb.JobProfile:
        return to_message(await profile_job(self._manager(), request.job_id,
                                            request.seconds, self._blocking,
                                            self.caller(context)))

    async def ListAudit(self, request: pb.AuditRequest, context: Any) -> pb.AuditLog:
        limit = request.limit or 100
        if not 1 <= limit <= MAX_AUDIT_PAGE or request.before < 0:
            raise ValueError(f"ListAudit: limit must be 1-{MAX_AUDIT_PAGE} (0: 100) and "
                             f"before >= 0; got limit={request.limit}, "
                             f"before={request.before}.")
        records = await self._blocking(self._manager().store.audit, limit, request.before)
        return pb.AuditLog(records=[to_message(r) for r in records])

    # ------------------------------------------------------------------ helpers
    def _resolve_types(self, spec: JobSpec) -> JobSpec:
        """``spec`` with its accelerator types checked against the cluster (a job of a
        type the cluster lacks would wait forever) and in lower case; no type: the
        cluster's first."""
        slices = self.slices.cluster()
        counts: dict[str, int] = {}
        hosts: dict[str, int] = {}
        for s in slices:
            kind = s.accelerator_type.lower()
            counts[kind] = counts.get(kind, 0) + 1
            hosts[kind] = s.num_hosts
        wanted = [t.strip().lower() for t in spec.preferences()]
        if wanted == [""]:
            if not slices:
                raise ValueError("submit: the cluster has no slices yet, so no accelerator "
                                 "type can be chosen for the job; pass accelerator_type=.")
            wanted = [slices[0].accelerator_type.lower()]
        known = ", ".join(f"{t} x{n}" for t, n in sorted(counts.items())) or "none"
        for kind in wanted:
            have = counts.get(kind, 0)
            if have < spec.num_slices:
                raise ValueError(
                    f"submit: the job asks for {spec.num_slices} {kind!r} slice(s), but this "
                    f"service's cluster has {have} (its slices: {known}). Pass "
                    f"{'only ' if len(wanted) > 1 else ''}accelerator types it has, or "
                    "fewer slices.")
        if spec.dataset_fn and len({hosts[k] for k in wanted}) > 1:
            raise ValueError(
                f"submit: an elastic job over {wanted} (slices of "
                f"{sorted({hosts[k] for k in wanted})} hosts) cannot use dataset_fn: each "
                "host reads its own input there, and its position means nothing on another "
                "number of hosts. Pass dataset= (global batches, whose position every host "
                "shares), or only types with as many hosts each.")
        return spec.replace(accelerator_type=wanted[0],
                            accelerator_types=tuple(wanted) if len(wanted) > 1 else None)


# Reads shared by the gRPC handlers and the HTTP API (jaxpod.service.http), so both
# show a job the same way. Blocking ones run in a worker thread (they read SQLite).
_Blocking = Callable[..., Awaitable[Any]]


async def watch_statuses(manager: JobManager, job_id: str, blocking: _Blocking,
                         recheck_s: float | None = None
                         ) -> AsyncGenerator[JobStatus, None]:
    """The job's status now, then each time it changes, until it is over (``WatchJob``;
    the HTTP event stream). ``blocking`` runs a blocking read off the event loop."""
    last: JobStatus | None = None
    while True:
        version = manager.events.version(job_id)
        status = await blocking(manager.status, job_id)
        if status != last:
            yield status
            last = status
        if status.state.is_terminal:
            return
        await manager.events.wait(job_id, version, WATCH_RECHECK.resolve(recheck_s))


async def profile_job(manager: JobManager, job_id: str, seconds: float,
                      blocking: _Blocking, caller: Principal) -> JobProfile:
    """A profile of the running job, if ``caller`` owns it (or is an admin); answers
    once the hosts wrote it (the gRPC and HTTP edges share it)."""
    check_profile_seconds(seconds)
    await blocking(manager.check_owner, job_id, caller, "profile")
    await blocking(manager.audit, caller.name, "profile", job_id, f"{seconds:g} s")
    return await blocking(manager.profile, job_id, seconds)


async def job_stacks(manager: JobManager, job_id: str, blocking: _Blocking,
                     caller: Principal) -> list[HostStacks]:
    """Every host's Python stacks of the running job, read now, if ``caller`` owns it
    (or is an admin); the gRPC and HTTP edges share it."""
    await blocking(manager.check_owner, job_id, caller, "stacks")
    return await blocking(manager.stacks, job_id)


async def pin_job(manager: JobManager, job_id: str, pinned: bool, blocking: _Blocking,
                  caller: Principal) -> JobStatus:
    """Pins (or unpins) the job, if ``caller`` owns it (or is an admin); the gRPC and
    HTTP edges share it."""
    what = "pin" if pinned else "unpin"
    await blocking(manager.check_owner, job_id, caller, what)
    status = await blocking(manager.pin, job_id, pinned)
    await blocking(manager.audit, caller.name, what, job_id)
    return status


async def fork_job(manager: JobManager, source: str, step: int, steps: int | None,
                   overrides: dict[str, Any], blocking: _Blocking, caller: Principal
                   ) -> JobStatus:
    """Forks ``source``, if ``caller`` owns it (or is an admin): the fork is the
    caller's, in the caller's team; the gRPC and HTTP edges share it."""
    await blocking(manager.check_owner, source, caller, "fork")
    status = await blocking(manager.fork, source, step, steps, overrides, caller.name,
                            caller.team)
    await blocking(manager.audit, caller.name, "fork", status.id, f"of {source} at {step}")
    return status


async def suspend_or_resume(manager: JobManager, job_id: str, resume: bool,
                            blocking: _Blocking, caller: Principal) -> JobStatus:
    """Suspends the job (answering once it is ``SUSPENDED``, or after ``CANCEL_WAIT``
    with its state then: a running job checkpoints first) or resumes it, if ``caller``
    owns it (or is an admin); the gRPC and HTTP edges share it."""
    what = "resume" if resume else "suspend"
    deadline = Deadline(CANCEL_WAIT.seconds())
    await blocking(manager.check_owner, job_id, caller, what)
    if resume:
        status = await blocking(manager.resume, job_id, f"resumed by {caller.name}")
        await blocking(manager.audit, caller.name, what, job_id)
        return status
    await blocking(manager.suspend, job_id, f"suspended by {caller.name}")
    await blocking(manager.audit, caller.name, what, job_id)
    while True:  # until it is off its slice, or the deadline: the answer says which
        version = manager.events.version(job_id)
        status = await blocking(manager.status, job_id)
        if status.state in (JobState.SUSPENDED, *TERMINAL_STATES) or deadline.expired():
            return status
        await manager.events.wait(job_id, version, deadline.remaining())


async def cancel_and_wait(manager: JobManager, job_id: str, blocking: _Blocking,
                          caller: Principal) -> JobStatus:
    """Cancels the job, if ``caller`` owns it (or is an admin), and answers once it
    stopped, or after ``CANCEL_WAIT`` with the state it is in then (a running job stops
    at its next loop boundary all the same)."""
    deadline = Deadline(CANCEL_WAIT.seconds())
    await blocking(manager.check_owner, job_id, caller, "cancel")
    await blocking(manager.cancel, job_id, f"cancelled by {caller.name}")
    await blocking(manager.audit, caller.name, "cancel", job_id)
    while True:  # until the job stops, or the deadline: the answer says which
        version = manager.events.version(job_id)
        status = await blocking(manager.status, job_id)
        if status.state.is_terminal or deadline.expired():
            return status
        await manager.events.wait(job_id, version, deadline.remaining())


def check_spec(spec: JobSpec) -> JobSpec:
    """``spec`` checked and with its defaults filled in; a spec no worker could run is
    refused, the message saying what to fix."""
    if not spec.step_fn:
        raise ValueError("submit: the job has no step function; pass step_fn.")
    if spec.steps < 1:
        raise ValueError(f"submit: steps must be >= 1; got {spec.steps}.")
    for name in ("steps_per_run", "num_slices", "max_retries_preemption",
                 "max_retries_failure", "checkpoint_every", "memory_checkpoint_every"):
        value = getattr(spec, name)
        if value is not None and value < 0:
            raise ValueError(f"submit: {name} must be >= 0; got {value}.")
    if spec.dataset and spec.dataset_fn:
        raise ValueError("submit: pass dataset or dataset_fn, not both.")
    for name in ("min_runtime_s", "max_runtime_s"):
        value = getattr(spec, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"submit: {name} must be finite seconds >= 0; got {value}.")
    mine = runtime_versions()
    theirs = dict(spec.runtime_versions or {})
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: client {a}, service {b}" for k, (a, b) in diff.items())
        raise ValueError(f"submit: the job was pickled by another runtime than the "
                         f"service's ({detail}); submit it from the service's versions.")
    return dataclasses.replace(
        spec, steps_per_run=spec.steps_per_run or 1, num_slices=spec.num_slices or 1,
        checkpoint_every=spec.checkpoint_every or None,
        outputs=check_outputs(dict(spec.outputs or {})) or None)
