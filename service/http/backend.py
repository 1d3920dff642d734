"""What the HTTP app reads: the running service's sessions, jobs and cluster.

The reads are the gRPC handlers' own (:mod:`jaxpod.service.api.jobs`,
:meth:`CoordinatorService.slice_holders`), turned into the API's models here. Blocking
ones (SQLite, Ray's node table) are meant to run in a worker thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import jaxpod
from jaxpod.errors import JaxpodError
from jaxpod.jobs import JobState, JobStatus
from jaxpod.proto import tensors
from jaxpod.service.api.coordinator import CoordinatorService
from jaxpod.service.http import models
from jaxpod.service.jobs.manager import JobManager

#: How long the readiness check waits for the job store's write lock.
STORE_CHECK_TIMEOUT_S = 1.0


class NoJobsError(JaxpodError, LookupError):
    """The service runs without a job store."""


@dataclass
class Backend:
    """The service the app shows.

    Attributes:
      service: the gRPC servicer (sessions, jobs, slice holders).
      cluster_state: ``"connecting"``, ``"ready"`` or ``"failed"`` (the cluster).
      snapshot: the cluster's slices as the resolver reads them
        (:func:`jaxpod.service.capacity.resolvers.ray.snapshot`'s first item); called only once
        ready.
      grpc_serving: whether the gRPC server serves (health ``SERVING``).
      provider_kind: what the slices come from, ``"ray"`` (a Ray cluster) or
        ``"processes"`` (simulated hosts as this machine's processes): the name of
        readiness's check of it.
    """

    service: CoordinatorService
    cluster_state: Callable[[], str]
    snapshot: Callable[[], Sequence[Any]]
    grpc_serving: Callable[[], bool]
    metrics: Any = field(default=None)  # a metrics.ServiceMetrics, set by serve()
    provider_kind: str = "ray"
    #: Set when the service stops: open event streams end.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def jobs(self) -> JobManager:
        if self.service.jobs is None:
            raise NoJobsError("This jaxpod service runs without a job store, so it has no "
                              "jobs; start it with `jaxpod serve` (its --state-dir keeps "
                              "them).")
        return self.service.jobs

    # ------------------------------------------------------------------ cluster
    def cluster(self) -> models.Cluster:
        state = cast(models.ClusterState, self.cluster_state())
        slices: list[models.Slice] = []
        if state == "ready":
            holders = self.service.slice_holders()
            slices = [_slice(s, holders.get(s.info.name)) for s in self.snapshot()]
        return models.Cluster(
            state=state, slices=slices,
            free_slices=sum(s.state == "free" for s in slices),
            busy_slices=sum(s.state == "busy" for s in slices),
            num_sessions=len(self.service.sessions), server_version=jaxpod.__version__,
            teams=[models.TeamShare(**share) for share in self.service.team_shares()])

    def sessions(self) -> models.Sessions:
        out = []
        for session in self.service.sessions.all():
            held = [models.SessionSlice(
                slice_id=h.id, accelerator_type=str(h.description["accelerator_type"]),
                slice_names=list(h.description["slice_names"]),
                num_hosts=int(h.description["num_hosts"]))
                for h in list(session.slices.values())]
            out.append(models.SessionInfo(label=tensors.holder_label(session.id),
                                          lease_s=session.lease_s, slices=held,
                                          num_uploads=len(session.blobs)))
        return models.Sessions(sessions=out)

    # ------------------------------------------------------------------ jobs
    def job_revision(self) -> int:
        """The job store's revision (0 without one): see ``JobStore.revision``."""
        jobs = self.service.jobs
        return jobs.store.revision if jobs is not None else 0

    def job_list(self, state: str | None, limit: int, offset: int | None) -> models.JobList:
        """Jobs in creation order, ``limit`` from ``offset`` (``None``: the ``limit``
        newest, what the status page lists)."""
        manager = self.jobs
        counts = manager.store.counts()
        total = sum(counts.values()) if state is None else counts[JobState.parse(state).value]
        offset = max(0, total - limit) if offset is None else offset
        statuses = manager.statuses(state, limit, offset)
        return models.JobList(jobs=[models.summary_of(s) for s in statuses], total=total,
                              limit=limit, offset=offset)

    def job_detail(self, job_id: str, points: int = 0) -> models.JobDetail:
        """The job's detail; ``points``: at most this many points per series (0: all)."""
        manager = self.jobs
        series = manager.store.metrics(job_id, points=points)
        return models.detail_of(manager.details(job_id), series)

    def job_counts(self) -> dict[str, int]:
        """Jobs by state (every state, zeros included)."""
        if self.service.jobs is None:
            return dict.fromkeys((s.value for s in JobState), 0)
        return self.service.jobs.store.counts()

    def unfinished(self) -> list[JobStatus]:
        """Statuses of the jobs not over yet (what per-job metrics cover)."""
        if self.service.jobs is None:
            return []
        manager = self.service.jobs
        return [s for state in JobState if not state.is_terminal
                for s in manager.statuses(state.value)]

    # ------------------------------------------------------------------ readiness
    def readiness(self) -> models.Readiness:
        checks: dict[str, bool] = {}
        reasons: dict[str, str] = {}
        state, kind = self.cluster_state(), self.provider_kind
        what = "the Ray cluster" if kind == "ray" else "the simulated hosts"
        checks[kind] = state == "ready"
        if state == "ready":
            try:
                self.snapshot()
            except Exception as e:
                checks[kind] = False
                reasons[kind] = f"reading {what} failed: {type(e).__name__}: {e}"
        else:
            reasons[kind] = f"{what} {'are' if kind == 'processes' else 'is'} {state}"
        checks["grpc"] = self.grpc_serving()
        if not checks["grpc"]:
            reasons["grpc"] = "the gRPC server is not SERVING (starting or stopping)"
        if self.service.jobs is not None:
            problem = store_writable(self.service.jobs.store.path)
            checks["store"] = problem is None
            if problem:
                reasons["store"] = problem
        return models.Readiness(ready=all(checks.values()), checks=checks, reasons=reasons)


def store_writable(path: Any) -> str | None:
    """``None`` if the job database takes a write lock now, else why not. Nothing is
    written: the transaction is rolled back."""
    try:
        conn = sqlite3.connect(path, timeout=STORE_CHECK_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as e:  # /readyz is open to all: the reason names no path
        return f"the job store (jobs.sqlite in the state dir) is not writable: {e}"
    return None


def _slice(s: Any, holder: str | None) -> models.Slice:
    info = s.info
    state: models.SliceState = "unhealthy" if s.problems else "busy" if holder else "free"
    return models.Slice(
        name=info.name, accelerator_type=info.accelerator_type, topology=info.topology,
        num_hosts=len(info.hosts), expected_hosts=info.expected_hosts,
        chips=sum(h.chips for h in info.hosts), state=state, holder=holder,
        hosts=[models.Host(worker_id=h.worker_id, address=h.address, chips=h.chips,
                           node_id=h.node_id) for h in info.hosts],
        problems=list(s.problems))
