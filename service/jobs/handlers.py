"""The job RPCs of the ``Coordinator`` service (a mixin of ``CoordinatorService``).

Requests are checked here, before anything is recorded: a spec the workers could not
run (no step function, both inputs, an unknown reduce op or accelerator type, another
runtime than the service's) is refused with what was received and how to fix it, and
nothing is queued. What only the workers can tell (a step that does not return
``(state, outputs)``) ends the job ``FAILED`` with the reason.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from jaxpod.jobs import check_outputs
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.jobs.goodput import summary
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.jobs.states import JobState
from jaxpod.service.jobs.store import JobRecord
from jaxpod.shipping import runtime_versions
from jaxpod.timeouts import Deadline, Timeout

_T = TypeVar("_T")

#: A watch re-reads its job at least this often (a change recorded by another process
#: on the same state dir has no event here).
WATCH_RECHECK = Timeout("JAXPOD_JOB_WATCH_RECHECK_S", 5.0)
#: How long CancelJob waits for a running job to stop at its next loop boundary before
#: answering with the state it is in (it stops all the same, later).
CANCEL_WAIT = Timeout("JAXPOD_JOB_CANCEL_WAIT_S", 10.0)


class JobsServicer:
    """``SubmitJob`` ... ``GetJobLogs``; the class using it provides ``jobs``,
    ``slices`` and ``_blocking``."""

    jobs: JobManager | None
    slices: Any

    async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        raise NotImplementedError  # provided by CoordinatorService

    def _stream(self, compute: Callable[[], Any]) -> AsyncIterator[Any]:
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
        _check_spec(request)
        accelerator_type = await self._blocking(self._resolve_type, request)
        record = await self._blocking(manager.submit, request, accelerator_type)
        return await self._blocking(self._status, record.id, False)

    async def GetJob(self, request: pb.JobRequest, context: Any) -> pb.JobStatus:
        self._manager()
        return await self._blocking(self._status, request.job_id, request.detail)

    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.JobList:
        manager = self._manager()
        if request.limit < 0 or request.offset < 0:
            raise ValueError(f"ListJobs: limit and offset must be >= 0; got limit="
                             f"{request.limit}, offset={request.offset}.")

        statuses = await self._blocking(list_statuses, manager, request.state or None,
                                        request.limit or None, request.offset)
        return pb.JobList(jobs=statuses)

    async def WatchJob(self, request: pb.JobRequest, context: Any
                       ) -> AsyncIterator[pb.JobStatus]:
        manager = self._manager()
        async for status in watch_statuses(manager, request.job_id, self._blocking):
            yield status

    async def CancelJob(self, request: pb.JobRequest, context: Any) -> pb.JobStatus:
        return await cancel_and_wait(self._manager(), request.job_id, self._blocking)

    def GetJobResult(self, request: pb.JobRequest, context: Any) -> AsyncIterator[Any]:
        manager = self._manager()

        def result() -> dict[str, Any]:
            record = manager.store.get(request.job_id)
            stored = manager.store.load_result(request.job_id)
            if record.state is not JobState.SUCCEEDED or stored is None:
                raise ValueError(
                    f"Job {record.id} is {record.state.value}: only a SUCCEEDED job has a "
                    "result. Wait for it (job.wait()), or read job.status().error.")
            return {"state": stored.state, "outputs": stored.outputs}

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
        lines = await self._blocking(manager.store.logs, request.job_id, request.after)
        return pb.JobLogs(lines=[pb.LogLine(seq=x.seq, host=x.host, line=x.line, at=x.at)
                                 for x in lines])

    # ------------------------------------------------------------------ helpers
    def _resolve_type(self, spec: pb.JobSpec) -> str:
        """The job's accelerator type, checked against the cluster: a job of a type
        the cluster lacks would wait forever."""
        slices = self.slices.cluster()
        counts: dict[str, int] = {}
        for s in slices:
            counts[s.accelerator_type.lower()] = counts.get(s.accelerator_type.lower(), 0) + 1
        wanted = spec.accelerator_type.strip().lower()
        if not wanted:
            if not slices:
                raise ValueError("submit: the cluster has no slices yet, so no accelerator "
                                 "type can be chosen for the job; pass accelerator_type=.")
            wanted = slices[0].accelerator_type.lower()
        have = counts.get(wanted, 0)
        num_slices = spec.num_slices or 1
        if have < num_slices:
            known = ", ".join(f"{t} x{n}" for t, n in sorted(counts.items())) or "none"
            raise ValueError(
                f"submit: the job asks for {num_slices} {wanted!r} slice(s), but this "
                f"service's cluster has {have} (its slices: {known}). Pass one of its "
                "accelerator types, or fewer slices.")
        return wanted

    def _status(self, job_id: str, detail: bool) -> pb.JobStatus:
        return job_status(self._manager(), job_id, detail)


# Reads shared by the gRPC handlers and the HTTP API (jaxpod.service.http), so both
# show a job the same way. Blocking ones run in a worker thread (they read SQLite).
_Blocking = Callable[..., Awaitable[Any]]


def job_status(manager: JobManager, job_id: str, detail: bool = False) -> pb.JobStatus:
    """The job as ``GetJob`` answers it; ``detail`` adds its history, attempts, the
    running attempt's host input figures and its checkpoints.

    Raises:
      jaxpod.JobNotFoundError: no job has that id.
    """
    status = status_of_record(manager, manager.store.get(job_id), manager.queue_positions())
    if detail:
        status.history.extend(
            pb.JobTransition(from_state=t.from_state.value if t.from_state else "",
                             to_state=t.to_state.value, at=t.at, reason=t.reason)
            for t in manager.store.history(job_id))
        status.attempt_records.extend(
            pb.JobAttempt(number=a.number, started_at=a.started_at,
                          ended_at=a.ended_at or 0.0, cause=a.cause or "",
                          step_reached=a.step_reached or 0)
            for a in manager.store.attempts(job_id))
        status.hosts.extend(
            pb.HostInput(host=h.host, input_wait_s=h.input_wait_s,
                         input_queue_depth=h.input_queue_depth)
            for h in manager.host_inputs(job_id))
        status.checkpoints.extend(
            pb.JobCheckpoint(step=step, path=path, saved_at=saved_at)
            for step, path, saved_at in manager.checkpoints(job_id))
    return status


def list_statuses(manager: JobManager, state: str | None = None, limit: int | None = None,
                  offset: int = 0) -> list[pb.JobStatus]:
    """Jobs in creation order as ``ListJobs`` answers them (``state`` filters; ``limit``
    and ``offset`` page)."""
    records = manager.store.list(state, limit, offset)
    positions = manager.queue_positions()  # one snapshot: no position twice
    return [status_of_record(manager, r, positions) for r in records]


def status_of_record(manager: JobManager, record: JobRecord, positions: dict[str, int]
                     ) -> pb.JobStatus:
    """``record`` as a ``JobStatus`` (``positions``: a :meth:`JobManager.queue_positions`)."""
    position = positions.get(record.id)
    error = record.error or ""
    if record.state is JobState.CANCELLED:
        error = manager.store.history(record.id)[-1].reason
    return pb.JobStatus(
        job_id=record.id, state=record.state.value, name=record.name,
        accelerator_type=record.accelerator_type or "", step=record.step,
        steps=record.steps, attempts=record.attempts,
        queue_position=-1 if position is None else position, error=error,
        metrics=manager.store.latest_metrics(record.id),
        created_at=record.created_at, started_at=record.started_at or 0.0,
        finished_at=record.finished_at or 0.0, goodput=_goodput(manager, record.id),
        steps_per_s=manager.steps_per_s(record) or 0.0)


async def watch_statuses(manager: JobManager, job_id: str, blocking: _Blocking,
                         recheck_s: float | None = None
                         ) -> AsyncGenerator[pb.JobStatus, None]:
    """The job's status now, then each time it changes, until it is over (``WatchJob``;
    the HTTP event stream). ``blocking`` runs a blocking read off the event loop."""
    last: pb.JobStatus | None = None
    while True:
        version = manager.events.version(job_id)
        status = await blocking(job_status, manager, job_id, False)
        if status != last:
            yield status
            last = status
        if JobState(status.state).is_terminal:
            return
        await manager.events.wait(job_id, version, WATCH_RECHECK.resolve(recheck_s))


async def cancel_and_wait(manager: JobManager, job_id: str, blocking: _Blocking
                          ) -> pb.JobStatus:
    """Cancels the job and answers once it stopped, or after ``CANCEL_WAIT`` with the
    state it is in then (a running job stops at its next loop boundary all the same)."""
    deadline = Deadline(CANCEL_WAIT.seconds())
    await blocking(manager.cancel, job_id)
    while True:  # until the job stops, or the deadline: the answer says which
        version = manager.events.version(job_id)
        status = await blocking(job_status, manager, job_id, False)
        if JobState(status.state).is_terminal or deadline.expired():
            return status
        await manager.events.wait(job_id, version, deadline.remaining())


def _goodput(manager: JobManager, job_id: str) -> dict[str, float]:
    totals = manager.goodput(job_id)
    return summary(totals) if totals else {}


def _check_spec(spec: pb.JobSpec) -> None:
    """Refuses a spec no worker could run; the message says what to fix."""
    if not spec.step_fn:
        raise ValueError("submit: the job has no step function; pass step_fn.")
    if spec.steps < 1:
        raise ValueError(f"submit: steps must be >= 1; got {spec.steps}.")
    for name in ("steps_per_run", "num_slices", "max_retries_preemption",
                 "max_retries_failure", "checkpoint_every"):
        if getattr(spec, name) < 0:
            raise ValueError(f"submit: {name} must be >= 0; got {getattr(spec, name)}.")
    if spec.steps_per_run == 0:
        spec.steps_per_run = 1
    if spec.num_slices == 0:
        spec.num_slices = 1
    if spec.dataset and spec.dataset_fn:
        raise ValueError("submit: pass dataset or dataset_fn, not both.")
    checked = check_outputs(dict(spec.outputs))
    spec.outputs.clear()
    spec.outputs.update(checked)
    mine = runtime_versions()
    theirs = dict(spec.runtime_versions)
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: client {a}, service {b}" for k, (a, b) in diff.items())
        raise ValueError(f"submit: the job was pickled by another runtime than the "
                         f"service's ({detail}); submit it from the service's versions.")
