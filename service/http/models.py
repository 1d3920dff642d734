"""The HTTP API's response bodies (pydantic): what ``service/openapi.json`` describes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, Field

from jaxpod.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from jaxpod.jobs import HostInput

_P = TypeVar("_P")

JobStateName = Literal["PENDING", "ALLOCATING", "RUNNING", "RETRYING", "SUCCEEDED", "FAILED",
                       "CANCELLED"]
ClusterState = Literal["connecting", "ready", "failed"]
SliceState = Literal["free", "busy", "unhealthy"]


class ErrorBody(BaseModel):
    """Every error answer: a short machine-readable kind and what to do about it."""

    error: str = Field(description="kind: unauthorized, forbidden, not_found, bad_request, "
                                   "unavailable")
    message: str = Field(description="what was wrong and how to fix it")


class Host(BaseModel):
    worker_id: int
    address: str
    chips: int
    node_id: str | None = None


class Slice(BaseModel):
    name: str
    accelerator_type: str
    topology: str
    num_hosts: int
    expected_hosts: int
    chips: int
    state: SliceState
    holder: str | None = Field(
        None, description="``job <id>`` or a session's label (a digest: never its id)")
    hosts: list[Host]
    problems: list[str]


class Cluster(BaseModel):
    state: ClusterState
    slices: list[Slice]
    free_slices: int
    busy_slices: int
    num_sessions: int
    server_version: str


class SessionSlice(BaseModel):
    slice_id: str
    accelerator_type: str
    slice_names: list[str]
    num_hosts: int


class SessionInfo(BaseModel):
    label: str = Field(description="a digest of the session's id (the id authorizes its "
                                   "calls, so it is never shown)")
    lease_s: float
    slices: list[SessionSlice]
    num_uploads: int


class Sessions(BaseModel):
    sessions: list[SessionInfo]


class JobSummary(BaseModel):
    id: str
    name: str
    state: JobStateName
    accelerator_type: str
    step: int
    steps: int
    attempts: int
    queue_position: int | None
    error: str | None
    metrics: dict[str, float | None] = Field(description="each output's latest value "
                                                         "(null: NaN)")
    steps_per_s: float | None = Field(
        description="steps per wall-clock second: the running attempt's over its recent "
                    "loops, else the last attempt's over its running time")
    steps_per_productive_s: float | None = Field(
        description="steps per productive second (goodput): the step rate with "
                    "compilation, lost work, checkpoints and bookkeeping taken out")
    productive_share: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None


class JobList(BaseModel):
    jobs: list[JobSummary]
    total: int = Field(description="jobs matching the filter, over all pages")
    limit: int
    offset: int


class Transition(BaseModel):
    from_state: JobStateName | None
    to_state: JobStateName
    at: float
    reason: str


class AttemptInfo(BaseModel):
    number: int
    started_at: float
    ended_at: float | None
    cause: str | None
    step_reached: int | None


class HostInputInfo(BaseModel):
    host: int = Field(description="the host's index in the slice")
    input_wait_s: float = Field(description="seconds its steps waited for input that was "
                                            "not ready yet, in the running attempt")
    input_queue_depth: int = Field(description="chunks of steps_per_run steps its infeed "
                                               "has ready")


class JobDetail(JobSummary):
    history: list[Transition]
    attempt_records: list[AttemptInfo]
    goodput: dict[str, float] = Field(description="seconds by category, wall_s and "
                                                  "productive_share (empty: none yet)")
    series: dict[str, list[tuple[int, float | None]]] = Field(
        description="each metric: [step, value] by step (null: NaN); with `points`, at "
                    "most that many, evenly spaced, the first and last kept")
    hosts: list[HostInputInfo] = Field(
        default_factory=list, description="each host's input feed in the running attempt, "
                                          "as last read (empty when no attempt runs)")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool]
    reasons: dict[str, str] = Field(description="why each failed check failed")


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def steps_per_productive_s(status: pb.JobStatus) -> float | None:
    """Steps per productive second, from the goodput clock (``None`` before any)."""
    productive = status.goodput.get("productive", 0.0)
    return status.step / productive if productive > 0 and status.step else None


def summary_of(status: pb.JobStatus) -> JobSummary:
    return JobSummary(**_summary_fields(status))


def _summary_fields(status: pb.JobStatus) -> dict[str, Any]:
    share = status.goodput.get("productive_share")
    return dict(
        id=status.job_id, name=status.name, state=status.state,
        accelerator_type=status.accelerator_type, step=status.step, steps=status.steps,
        attempts=status.attempts,
        queue_position=None if status.queue_position < 0 else status.queue_position,
        error=status.error or None,
        metrics={k: finite(v) for k, v in sorted(status.metrics.items())},
        steps_per_s=status.steps_per_s or None,
        steps_per_productive_s=steps_per_productive_s(status), productive_share=share,
        created_at=status.created_at, started_at=status.started_at or None,
        finished_at=status.finished_at or None)


def thin(points: Sequence[_P], at_most: int) -> list[_P]:
    """``points`` if there are at most ``at_most`` of them (0: no limit), else
    ``at_most`` of them evenly spaced, the first and the last kept: what a chart of a
    long job draws."""
    n = len(points)
    if at_most <= 0 or n <= at_most:
        return list(points)
    if at_most == 1:
        return [points[-1]]
    return [points[round(i * (n - 1) / (at_most - 1))] for i in range(at_most)]


def detail_of(status: pb.JobStatus, series: dict[str, list[tuple[int, float]]],
              points: int = 0) -> JobDetail:
    """``status`` (read with ``detail``: history, attempts and hosts) and its series."""
    return JobDetail(
        **_summary_fields(status),
        history=[Transition(from_state=t.from_state or None, to_state=t.to_state, at=t.at,
                            reason=t.reason) for t in status.history],
        attempt_records=[AttemptInfo(number=a.number, started_at=a.started_at,
                                     ended_at=a.ended_at or None, cause=a.cause or None,
                                     step_reached=a.step_reached if a.ended_at else None)
                         for a in status.attempt_records],
        goodput=dict(status.goodput),
        series={name: [(step, finite(v)) for step, v in thin(kept, points)]
                for name, kept in sorted(series.items())},
        hosts=host_inputs(status.hosts))


def host_inputs(hosts: Sequence[HostInput | pb.HostInput]) -> list[HostInputInfo]:
    return [HostInputInfo(host=h.host, input_wait_s=h.input_wait_s,
                          input_queue_depth=h.input_queue_depth) for h in hosts]
