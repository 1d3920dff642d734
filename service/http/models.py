"""The HTTP API's response bodies (pydantic): what ``service/http/openapi.json`` describes."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import BaseModel, Field, create_model

from jaxpod.jobs import (
    Attempt,
    AuditRecord,
    HostInput,
    JobCheckpoint,
    JobDetails,
    JobProfile,
    JobState,
    JobStatus,
    Transition,
)
from jaxpod.service.auth.tokens import Principal

JobStateName: TypeAlias = JobState
ClusterState = Literal["connecting", "ready", "failed"]
SliceState = Literal["free", "busy", "unhealthy"]


class ErrorBody(BaseModel):
    """Every error answer: a short machine-readable kind and what to do about it."""

    error: str = Field(description="kind: unauthorized, forbidden, not_found, bad_request, "
                                   "unavailable")
    message: str = Field(description="what was wrong and how to fix it")


class Caller(BaseModel):
    """The token a request came with (``local``, an admin, on a service without tokens)."""

    name: str = Field(description="the token's name; owner of what it creates")
    role: Literal["viewer", "submitter", "admin"]
    max_slices: int | None = Field(description="slices it may hold at once (null: no cap)")


def caller_of(who: Principal) -> Caller:
    return Caller.model_validate({"name": who.name, "role": str(who.role),
                                  "max_slices": who.max_slices})


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


class TeamShare(BaseModel):
    team: str
    weight: float
    held: int = Field(description="slices its jobs hold now")
    entitled: float = Field(description="the slices its weight gives it among the "
                                        "active teams")
    borrowed: int = Field(description="slices held beyond those")
    queued: int = Field(description="its jobs waiting")


class Cluster(BaseModel):
    state: ClusterState
    slices: list[Slice]
    free_slices: int
    busy_slices: int
    num_sessions: int
    server_version: str
    teams: list[TeamShare] = Field(default_factory=list,
                                   description="how the teams share the slices (empty: "
                                               "no teams declared)")


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


def derived(cls: type, name: str, *, drop: Sequence[str] = (), **extra: Any) -> Any:
    """A pydantic model with dataclass ``cls``'s fields (less ``drop``; ``extra`` adds
    or replaces fields, as ``create_model`` takes them): the one place the API's models
    are made from the job types of :mod:`jaxpod.jobs`."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: (hints[f.name], ...) for f in dataclasses.fields(cls)
              if f.name not in drop}
    return create_model(name, __doc__=cls.__doc__, **{**fields, **extra})


if TYPE_CHECKING:  # made at run time: mypy sees them as Any
    JobSummary: TypeAlias = Any
    JobDetail: TypeAlias = Any
else:
    JobSummary = derived(
        JobStatus, "JobSummary", drop=("goodput",),
        metrics=(dict[str, float | None],
                 Field(description="each output's latest value (null: NaN)")),
        productive_share=(float | None, Field(description="the productive share of the "
                                                          "job's wall time (goodput)")),
        steps_per_productive_s=(float | None, Field(
            description="steps per productive second (goodput): the step rate with "
                        "compilation, lost work, checkpoints and bookkeeping taken out")))
    JobDetail = create_model(
        "JobDetail", __base__=JobSummary,
        history=(list[Transition], ...),
        attempt_records=(list[Attempt], ...),
        goodput=(dict[str, float], Field(description="seconds by category, wall_s and "
                                                     "productive_share (empty: none yet)")),
        series=(dict[str, list[tuple[int, float | None]]], Field(
            description="each metric: [step, value] by step (null: NaN); with `points`, "
                        "at most that many, evenly spaced in steps, the first and last "
                        "kept")),
        hosts=(list[HostInput], Field(description="each host's input feed in the running "
                                                  "attempt, as last read (empty when none "
                                                  "runs)")),
        checkpoints=(list[JobCheckpoint], Field(description="committed checkpoints, "
                                                            "oldest first")),
        profiles=(list[JobProfile], Field(description="jax.profiler traces taken of it, "
                                                      "oldest first")))


class ForkRequest(BaseModel):
    step: int = Field(ge=0, description="the step of the source's checkpoint to start from")
    steps: int | None = Field(default=None, ge=1,
                              description="the fork's last step (default: the source's)")
    name: str | None = Field(default=None, description="the fork's name")
    priority: int | None = Field(default=None, description="the fork's priority")


class JobList(BaseModel):
    jobs: list[JobSummary]
    total: int = Field(description="jobs matching the filter, over all pages")
    limit: int
    offset: int


class AuditLog(BaseModel):
    records: list[AuditRecord] = Field(description="newest last")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool]
    reasons: dict[str, str] = Field(description="why each failed check failed")


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def steps_per_productive_s(status: JobStatus) -> float | None:
    """Steps per productive second, from the goodput clock (``None`` before any)."""
    productive = (status.goodput or {}).get("productive", 0.0)
    return status.step / productive if productive > 0 and status.step else None


def summary_of(status: JobStatus) -> Any:
    """``status`` as the API's :data:`JobSummary`."""
    return JobSummary.model_validate(_summary_fields(status))


def _summary_fields(status: JobStatus) -> dict[str, Any]:
    fields = {f.name: getattr(status, f.name) for f in dataclasses.fields(status)}
    fields.pop("goodput")
    return {**fields, "metrics": {k: finite(v) for k, v in sorted(status.metrics.items())},
            "productive_share": (status.goodput or {}).get("productive_share"),
            "steps_per_productive_s": steps_per_productive_s(status)}


def detail_of(details: JobDetails, series: dict[str, list[tuple[int, float]]]) -> Any:
    """``details`` and the job's metric series (as the store thinned them) as the API's
    :data:`JobDetail`."""
    return JobDetail.model_validate({
        **_summary_fields(details.status), "history": list(details.history),
        "attempt_records": list(details.attempts), "goodput": dict(details.status.goodput or {}),
        "series": {name: [(step, finite(v)) for step, v in kept]
                   for name, kept in sorted(series.items())},
        "hosts": list(details.hosts), "checkpoints": list(details.checkpoints),
        "profiles": list(details.profiles)})
