"""The API's routers, one per resource: cluster, sessions, jobs, health and metrics.

Blocking reads (SQLite, Ray's node table) run in FastAPI's thread pool: plain ``def``
routes, or, for the job list and the cluster that every open page polls, through
:class:`Recent`. The job event stream and cancel wait on the job manager's events on
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from jaxpod import settings
from jaxpod.jobs import MAX_PROFILE_SECONDS, HostInput, HostStacks, JobProfile
from jaxpod.service.api import jobs as handlers
from jaxpod.service.http import models
from jaxpod.service.http.backend import Backend

#: The most jobs one page of ``GET /api/v1/jobs`` holds.
MAX_PAGE = 1000
#: Offsets past this are refused (SQLite takes 64-bit offsets; nobody has this many).
MAX_OFFSET = 1 << 40
#: How old a job list or cluster answer may be (see :class:`Recent`).
CACHE = settings.HTTP_CACHE
#: An answer older than this is never given, even while the next one is being read.
MAX_STALE_S = 5.0
#: The most points per series a chart gets: the page's first render and an event
#: stream's first ``metrics`` event (a long job has one per loop, millions perhaps).
CHART_POINTS = 2000
#: An event stream sends at most one status (the latest) per this many seconds: a job
#: of fast loops changes hundreds of times a second, and each event is a read.
EVENTS_INTERVAL = settings.HTTP_EVENTS_INTERVAL

UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"model": models.ErrorBody, "description": "no valid token or session cookie"},
    403: {"model": models.ErrorBody, "description": "the token's role does not allow it"}}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": models.ErrorBody, "description": "no job has this id"}}
FORBIDDEN: dict[int | str, dict[str, Any]] = {
    403: {"model": models.ErrorBody, "description": "a role too low, another's job (for a "
                                                   "submitter), or a cross-origin change"}}
NOT_RUNNING: dict[int | str, dict[str, Any]] = {
    409: {"model": models.ErrorBody, "description": "the job is not running on a slice"}}


class Recent:
    """Answers shared by the requests that ask within ``CACHE`` seconds, refreshed in
    the background: a room of dashboards polling the job list costs the service one
    read per period, not one per poller, and no poll waits for a read (it gets the
    previous answer while the next is read, unless that one is older than
    ``MAX_STALE_S``). So an answer is at most ``CACHE`` old plus the time of one read,
    and never older than ``MAX_STALE_S``.

    Read your writes (DESIGN §6): with a ``revision`` (a number that grows with every
    change a client is told of: a job submitted, cancelled, changing state), an answer
    whose read started before a change acknowledged before the request is never
    given; the request waits for a read that started after it, which the requests
    arriving meanwhile share."""

    def __init__(self) -> None:
        self._entries: dict[Any, _Entry] = {}

    async def get(self, key: Any, compute: Callable[[], Any],
                  revision: Callable[[], int] = lambda: 0) -> bytes:
        wanted = revision()  # every change acknowledged before this request
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) > 256:  # forget old keys (odd filters, far pages)
                self._entries = {k: e for k, e in self._entries.items()
                                 if now - e.at < MAX_STALE_S}
            entry = self._entries[key] = _Entry()
        while True:
            current = entry.body is not None and entry.revision >= wanted
            if current and now - entry.at < CACHE.seconds():
                assert entry.body is not None
                return entry.body
            if entry.refresh is None:
                entry.refresh = asyncio.ensure_future(self._refresh(entry, compute,
                                                                    revision))
                # Read its failure even when no request awaits it (it served a stale
                # answer): the next request reads again, and asyncio must not warn.
                entry.refresh.add_done_callback(_retrieve)
            if current and now - entry.at < MAX_STALE_S:
                assert entry.body is not None
                return entry.body  # the previous answer; the next one is on its way
            body, read_at = await asyncio.shield(entry.refresh)
            if read_at >= wanted:
                return body
            now = time.monotonic()  # that read started before the change: another

    @staticmethod
    async def _refresh(entry: _Entry, compute: Callable[[], Any],
                       revision: Callable[[], int]) -> tuple[bytes, int]:
        try:
            at, read_at = time.monotonic(), revision()
            body = await _serialized(compute)
            entry.body, entry.at, entry.revision = body, at, read_at
            return body, read_at
        finally:
            entry.refresh = None  # a failure is not kept: the next request reads again


def _retrieve(future: asyncio.Future[tuple[bytes, int]]) -> None:
    if not future.cancelled():
        future.exception()


@dataclasses.dataclass
class _Entry:
    body: bytes | None = None
    at: float = 0.0  # when the read that made ``body`` started (monotonic)
    revision: int = 0  # the revision when that read started
    refresh: asyncio.Future[tuple[bytes, int]] | None = None


async def _serialized(compute: Callable[[], Any]) -> bytes:
    model = await run_in_threadpool(compute)
    return model.model_dump_json().encode()


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


# Coroutines, as they never block (FastAPI runs a plain ``def`` dependency in a thread).
async def backend(request: Request) -> Backend:
    backend: Backend = request.app.state.backend
    return backend


async def recent(request: Request) -> Recent:
    cache: Recent = request.app.state.recent
    return cache


BackendDep = Annotated[Backend, Depends(backend)]
RecentDep = Annotated[Recent, Depends(recent)]
JobId = Annotated[str, Path(description="the job's id, as `jaxpod jobs` lists it")]


async def _blocking(fn: Any, *args: Any) -> Any:
    return await run_in_threadpool(fn, *args)


# ---------------------------------------------------------------------- cluster
cluster = APIRouter(prefix="/api/v1", tags=["cluster"], responses=UNAUTHORIZED)


@cluster.get("/cluster", response_model=models.Cluster, summary="Slices, hosts and holders")
async def get_cluster(backend: BackendDep, recent: RecentDep) -> Response:
    return _json(await recent.get("cluster", backend.cluster))


@cluster.get("/whoami", response_model=models.Caller, summary="Who this token is: its name "
                                                             "and role")
async def whoami(request: Request) -> models.Caller:
    return models.caller_of(request.state.principal)


@cluster.get("/audit", response_model=models.AuditLog,
             summary="Who submitted, cancelled or was refused what (admin only)")
async def get_audit(backend: BackendDep,
                    limit: Annotated[int, Query(ge=1, le=handlers.MAX_AUDIT_PAGE)] = 100,
                    before: Annotated[int, Query(ge=0, le=MAX_OFFSET, description=(
                        "only records with a smaller seq (0: up to the newest)"))] = 0
                    ) -> models.AuditLog:
    records = await _blocking(backend.jobs.store.audit, limit, before)
    return models.AuditLog(records=records)


# ---------------------------------------------------------------------- sessions
sessions = APIRouter(prefix="/api/v1", tags=["sessions"], responses=UNAUTHORIZED)


@sessions.get("/sessions", response_model=models.Sessions, summary="Open client sessions")
def get_sessions(backend: BackendDep) -> models.Sessions:
    return backend.sessions()


# ---------------------------------------------------------------------- jobs
jobs = APIRouter(prefix="/api/v1", tags=["jobs"], responses=UNAUTHORIZED)


@jobs.get("/jobs", response_model=models.JobList, summary="Jobs in creation order")
async def list_jobs(backend: BackendDep, recent: RecentDep,
                    state: Annotated[models.JobStateName | None,
                                     Query(description="only jobs in this state")] = None,
                    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
                    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0) -> Response:
    return _json(await recent.get(("jobs", state, limit, offset),
                                  lambda: backend.job_list(state, limit, offset),
                                  backend.job_revision))


@jobs.get("/jobs/{job_id}", response_model=models.JobDetail, responses=NOT_FOUND,
          summary="A job: history, attempts, metric series, goodput")
def get_job(backend: BackendDep, job_id: JobId,
            points: Annotated[int, Query(ge=0, le=MAX_OFFSET, description=(
                "at most this many points per series, evenly spaced in steps with the "
                "first and last kept (0, the default: every point)"))] = 0
            ) -> models.JobDetail:
    return backend.job_detail(job_id, points)


@jobs.post("/jobs/{job_id}/cancel", response_model=models.JobSummary,
           responses={**NOT_FOUND, **FORBIDDEN},
           summary="Cancel a job; answers once it stopped (or after "
                   "JAXPOD_JOB_CANCEL_WAIT_S with its state then)")
async def cancel_job(request: Request, backend: BackendDep, job_id: JobId
                     ) -> models.JobSummary:
    status = await handlers.cancel_and_wait(backend.jobs, job_id, _blocking,
                                            request.state.principal)
    return models.summary_of(status)


@jobs.post("/jobs/{job_id}/suspend", response_model=models.JobSummary,
           responses={**NOT_FOUND, **FORBIDDEN},
           summary="Suspend a job: it checkpoints and frees its slice until resumed; "
                   "answers once it is SUSPENDED (or after JAXPOD_JOB_CANCEL_WAIT_S)")
async def suspend_job(request: Request, backend: BackendDep, job_id: JobId
                      ) -> models.JobSummary:
    return models.summary_of(await handlers.suspend_or_resume(
        backend.jobs, job_id, False, _blocking, request.state.principal))


@jobs.post("/jobs/{job_id}/resume", response_model=models.JobSummary,
           responses={**NOT_FOUND, **FORBIDDEN},
           summary="Queue a suspended job again (`job.resume()`)")
async def resume_job(request: Request, backend: BackendDep, job_id: JobId
                     ) -> models.JobSummary:
    return models.summary_of(await handlers.suspend_or_resume(
        backend.jobs, job_id, True, _blocking, request.state.principal))


@jobs.post("/jobs/{job_id}/fork", response_model=models.JobSummary,
           responses={**NOT_FOUND, **FORBIDDEN},
           summary="Start a new job, the caller's, from one of a job's checkpoints "
                   "(`client.fork`); answers with the fork")
async def fork_job(request: Request, backend: BackendDep, job_id: JobId,
                   body: models.ForkRequest) -> models.JobSummary:
    overrides = {k: v for k, v in (("name", body.name), ("priority", body.priority))
                 if v is not None}
    return models.summary_of(await handlers.fork_job(
        backend.jobs, job_id, body.step, body.steps, overrides, _blocking,
        request.state.principal))


@jobs.post("/jobs/{job_id}/pin", response_model=models.JobSummary,
           responses={**NOT_FOUND, **FORBIDDEN},
           summary="Pin a job: retention never prunes it (`job.pin()`)")
async def pin_job(request: Request, backend: BackendDep, job_id: JobId) -> models.JobSummary:
    return models.summary_of(await handlers.pin_job(backend.jobs, job_id, True, _blocking,
                                                    request.state.principal))


@jobs.delete("/jobs/{job_id}/pin", response_model=models.JobSummary,
             responses={**NOT_FOUND, **FORBIDDEN},
             summary="Unpin a job: retention prunes it once finished and past the limits")
async def unpin_job(request: Request, backend: BackendDep, job_id: JobId
                    ) -> models.JobSummary:
    return models.summary_of(await handlers.pin_job(backend.jobs, job_id, False, _blocking,
                                                    request.state.principal))


@jobs.post("/jobs/{job_id}/profile", response_model=JobProfile,
           responses={**NOT_FOUND, **FORBIDDEN, **NOT_RUNNING},
           summary="Trace every host of a running job with jax.profiler for `seconds` "
                   "(from its next loop boundary); answers once the trace is written")
async def profile_job(request: Request, backend: BackendDep, job_id: JobId,
                      seconds: Annotated[float, Query(gt=0, le=MAX_PROFILE_SECONDS)] = 5.0
                      ) -> JobProfile:
    return await handlers.profile_job(backend.jobs, job_id, seconds, _blocking,
                                      request.state.principal)


@jobs.get("/jobs/{job_id}/stacks", response_model=list[HostStacks],
          responses={**NOT_FOUND, **FORBIDDEN, **NOT_RUNNING},
          summary="Every thread's Python stack on each host of a running job, read now "
                  "(`jaxpod job stacks ID`)")
async def job_stacks(request: Request, backend: BackendDep, job_id: JobId
                     ) -> list[HostStacks]:
    return await handlers.job_stacks(backend.jobs, job_id, _blocking,
                                     request.state.principal)


@jobs.get("/jobs/{job_id}/events", response_class=StreamingResponse, responses={
    **NOT_FOUND, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                       "description": "server-sent events: `status` (a JobSummary) on a "
                                      "change (the latest; at most one per "
                                      "JAXPOD_HTTP_EVENTS_INTERVAL_S), `metrics` ({name: "
                                      "[[step, value]]}: the points not sent yet), `hosts` "
                                      "({hosts: [HostInput]}: each host's input feed in "
                                      "the running attempt, when it changed), `end` once "
                                      "the job is over"}},
    summary="Server-sent events of the job's status changes and metrics")
async def job_events(backend: BackendDep, job_id: JobId) -> StreamingResponse:
    manager = backend.jobs
    await _blocking(manager.store.get, job_id)  # 404 now, not inside the stream
    return StreamingResponse(_events(backend, job_id), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store",
                                      "X-Accel-Buffering": "no"})


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _events(backend: Backend, job_id: str) -> AsyncIterator[bytes]:
    manager = backend.jobs
    sent: dict[str, int] = {}  # series -> the last step sent
    hosts_sent: tuple[HostInput, ...] = ()

    def new_points() -> dict[str, list[tuple[int, float | None]]]:
        fresh = {}
        # A job records all its scalar outputs at each step it records, so reading
        # after the series sent least far misses nothing (and reads only the tail).
        since = min(sent.values(), default=-1)
        # The first read of a long job's history is thinned for the chart (in the
        # store: seeks, not the whole history); later reads carry the few points of
        # the loops since.
        for name, points in manager.store.metrics(job_id, since, CHART_POINTS).items():
            after = sent.get(name, -1)
            tail = [(step, models.finite(v)) for step, v in points if step > after]
            if tail:
                fresh[name] = tail
                sent[name] = tail[-1][0]
        return fresh

    watch = handlers.watch_statuses(manager, job_id, _blocking)
    # bounded: raced with the next status below, and cancelled when the stream ends
    stop = asyncio.ensure_future(backend.stopping.wait())
    following: asyncio.Future[Any] | None = None
    try:
        while True:
            following = asyncio.ensure_future(anext(watch))
            await asyncio.wait({following, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                return  # the service is stopping
            try:
                status = following.result()  # bounded: done (asyncio.wait above)
            except StopAsyncIteration:
                break
            yield _sse("status", models.summary_of(status).model_dump())
            fresh = await _blocking(new_points)
            if fresh:
                yield _sse("metrics", {"series": fresh})
            hosts = manager.host_inputs(job_id)
            if hosts != hosts_sent:
                yield _sse("hosts", {"hosts": [dataclasses.asdict(h) for h in hosts]})
                hosts_sent = hosts
            if not status.state.is_terminal:
                # Changes meanwhile are coalesced: the next read gets the latest.
                await asyncio.wait({stop}, timeout=EVENTS_INTERVAL.seconds())
        yield _sse("end", {"id": job_id})
    finally:
        # The reader left or the service stops: the read in flight ends before the watch
        # closes (a running generator cannot be closed).
        stop.cancel()
        if following is not None and not following.done():
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await following
        await watch.aclose()


# ---------------------------------------------------------------------- health
health = APIRouter(tags=["health"])


@health.get("/healthz", response_model=models.Health, summary="The process is up")
async def healthz() -> models.Health:
    return models.Health(status="ok")


@health.get("/readyz", response_model=models.Readiness, responses={
    503: {"model": models.Readiness, "description": "not ready: see checks and reasons"}},
    summary="The slice provider (ray or processes) up, gRPC serving, job store writable")
def readyz(backend: BackendDep, response: Response) -> models.Readiness:
    ready = backend.readiness()
    if not ready.ready:
        response.status_code = 503
    return ready


# ---------------------------------------------------------------------- metrics
metrics = APIRouter(tags=["metrics"], responses=UNAUTHORIZED)


@metrics.get("/metrics", response_class=Response, responses={
    200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
          "description": "Prometheus text format"}}, summary="Prometheus metrics")
def get_metrics(backend: BackendDep) -> Response:
    return Response(generate_latest(backend.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
