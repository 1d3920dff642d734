"""The job store's rows as jaxpod's types, and the SQL that reads them.

A job's row read as a :class:`~jaxpod.jobs.JobStatus` (:data:`JOB_COLUMNS`,
:func:`job_status`); the records only the store returns (log lines, a stored result,
what recovery found); the metric queries, each an index seek per name or point; and
the checks that turn the values callers pass into columns (or a
:class:`~jaxpod.service.jobs.codec.JobStoreError` that writes nothing).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpod.jobs import JobState, JobStatus
from jaxpod.service.jobs.codec import JobStoreError
from jaxpod.service.jobs.goodput import PRODUCTIVE_SHARE, WALL_S, summary
from jaxpod.service.jobs.states import Cancelled, Failed, JobStateData, Retrying

# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class LogLine:
    """A line the job's code printed; ``seq`` orders lines over hosts (and tails them)."""

    seq: int
    host: int
    line: str
    at: float


@dataclass(frozen=True)
class StoredResult:
    """A finished job's last reduced outputs (its final state is its last checkpoint,
    on the hosts' storage)."""

    outputs: Any
    saved_at: float
    #: The final state, in a job finished by a jaxpod before its hosts checkpointed.
    legacy_state: Any = None


@dataclass(frozen=True)
class Recovery:
    """What :meth:`~jaxpod.service.jobs.store.JobStore.recover` found: every unfinished
    job, to queue again (in creation order), and which of them were in flight (now
    ``RETRYING``)."""

    requeue: tuple[JobStatus, ...]
    resumed: tuple[JobStatus, ...]


#: A job's row as :func:`job_status` reads it: its columns, its attempts so far, the rate
#: of its last attempt that ran steps and ended, and its last transition's reason.
JOB_COLUMNS = ("id, name, accelerator_type, state, step, steps, error, created_at, "
               "started_at, finished_at, owner, priority, pinned, pruned_at, team, "
               "(SELECT COUNT(*) FROM attempts a WHERE a.job_id = jobs.id), "
               "(SELECT (a.step_reached - a.start_step) / (a.ended_at - a.running_at) "
               " FROM attempts a WHERE a.job_id = jobs.id AND a.ended_at > a.running_at "
               " AND a.step_reached > a.start_step ORDER BY a.number DESC LIMIT 1), "
               "(SELECT reason FROM transitions t WHERE t.job_id = jobs.id "
               " ORDER BY t.seq DESC LIMIT 1)")


def job_status(conn: sqlite3.Connection, row: Sequence[Any]) -> JobStatus:
    """The job a :data:`JOB_COLUMNS` row describes, with its latest metrics and stored
    goodput (read in the caller's transaction). A cancelled job's ``error`` is who or
    what cancelled it."""
    (job_id, name, accelerator_type, state, step, steps, error, created_at, started_at,
     finished_at, owner, priority, pinned, pruned_at, team, attempts, steps_per_s,
     last_reason) = row
    metrics = {n: math.nan if v is None else v
               for n, v in conn.execute(LATEST_METRICS, {"job": job_id}).fetchall()}
    totals = dict(conn.execute("SELECT category, seconds FROM goodput WHERE job_id = ? "
                               "ORDER BY category", (job_id,)).fetchall())
    state = JobState(state)
    return JobStatus(
        id=job_id, name=name, state=state, step=step, steps=steps, attempts=attempts,
        queue_position=None, error=last_reason if state is JobState.CANCELLED else error,
        metrics=metrics, goodput=summary(totals) if totals else None, created_at=created_at,
        started_at=started_at, finished_at=finished_at,
        accelerator_type=accelerator_type or "", steps_per_s=steps_per_s, owner=owner,
        priority=priority, pinned=bool(pinned), pruned_at=pruned_at, team=team)


# ------------------------------------------------------------------- metric queries

#: A job's metric names by index seeks only: a skip-scan over the primary key
#: (job_id, name, step), one seek per name, however many steps each has.
_METRIC_NAMES = """
WITH RECURSIVE names(name) AS (
    SELECT MIN(name) FROM metrics WHERE job_id = :job
    UNION ALL
    SELECT (SELECT MIN(name) FROM metrics WHERE job_id = :job AND name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
"""
#: Each metric's value at its last step: a seek per name, so its cost does not grow
#: with the job's steps, as a scan of the job's rows would (95 ms at 100,000 steps,
#: read by every job-list refresh while holding the store's lock).
LATEST_METRICS = _METRIC_NAMES + """
SELECT name, (SELECT value FROM metrics WHERE job_id = :job AND name = names.name
              ORDER BY step DESC LIMIT 1)
FROM names WHERE name IS NOT NULL
"""
#: Each metric's points after step :after, by name and step: a range seek per name.
METRICS_AFTER = _METRIC_NAMES + """
SELECT m.name, m.step, m.value FROM names
JOIN metrics m ON m.job_id = :job AND m.name = names.name AND m.step > :after
WHERE names.name IS NOT NULL
ORDER BY m.name, m.step
"""
#: Each metric's first step after :after (NULL if none) and last step: two seeks a name.
METRIC_ENDS = _METRIC_NAMES + """
SELECT name,
       (SELECT step FROM metrics WHERE job_id = :job AND name = names.name
          AND step > :after ORDER BY step LIMIT 1),
       (SELECT step FROM metrics WHERE job_id = :job AND name = names.name
          ORDER BY step DESC LIMIT 1)
FROM names WHERE name IS NOT NULL
"""
#: One metric's points from step :first to :last.
METRIC_RANGE = """
SELECT step, value FROM metrics
WHERE job_id = :job AND name = :name AND step BETWEEN :first AND :last ORDER BY step
"""
#: One metric's first point at or after each of :points steps evenly spaced from :first
#: to :last (both points, so both kept): a seek per point (:points >= 2).
METRIC_TICKS = """
WITH RECURSIVE ticks(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM ticks WHERE i + 1 < :points),
picked(step) AS (
    SELECT DISTINCT (SELECT step FROM metrics WHERE job_id = :job AND name = :name
                       AND step >= :first + (:last - :first) * i / (:points - 1)
                     ORDER BY step LIMIT 1)
    FROM ticks
)
SELECT m.step, m.value FROM picked  -- CROSS JOIN keeps picked outside: a seek per point
CROSS JOIN metrics m ON m.job_id = :job AND m.name = :name AND m.step = picked.step
ORDER BY m.step
"""


# --------------------------------------------------------------------------- values

def check_step(step: int) -> None:
    """Refuses a step that is not an int >= 0."""
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
        raise JobStoreError(f"A step must be an int >= 0; got {step!r}.")


def metric_value(name: object, value: object) -> float:
    """A metric's value as the float stored, or why it cannot be one."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise JobStoreError(
            f"Metric {name!r} must be a real number (a scalar); got "
            f"{type(value).__name__} {value!r:.80}. Reduce it to one number per step."
        ) from None


def goodput_category(name: object) -> str:
    """A goodput category's name, refusing the summary's own keys."""
    if not isinstance(name, str) or not name or name in (WALL_S, PRODUCTIVE_SHARE):
        raise JobStoreError(f"A goodput category must be a category name (not empty, not "
                            f"the summary's wall_s or productive_share); got {name!r}.")
    return name


def goodput_seconds(name: str, seconds: object) -> float:
    """A category's seconds as the float stored: finite and >= 0."""
    try:
        value = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise JobStoreError(f"Goodput seconds must be finite and >= 0; got {seconds!r} "
                            f"for {name!r}.")
    return value


def default_reason(new: JobStateData) -> str:
    """The reason a change to ``new`` records when the caller gives none."""
    if isinstance(new, Failed):
        return new.error
    if isinstance(new, Cancelled):
        return new.reason
    if isinstance(new, Retrying):
        return new.cause
    return ""


def metric_rows(conn: sqlite3.Connection, job_id: str, after: int, points: int
                ) -> list[tuple[str, int, float | None]]:
    """The ``(name, step, value)`` rows
    :meth:`~jaxpod.service.jobs.store_reports.JobReports.metrics` reads, in the caller's
    transaction (``None``: NaN)."""
    if points == 0:
        return list(conn.execute(METRICS_AFTER, {"job": job_id, "after": after}))
    rows: list[tuple[str, int, float | None]] = []
    for name, first, last in conn.execute(
            METRIC_ENDS, {"job": job_id, "after": after}).fetchall():
        if first is None:
            continue
        if points == 1:
            first = last
        span = {"job": job_id, "name": name, "first": first, "last": last, "points": points}
        thinned = last - first + 1 > points
        rows += [(name, step, value) for step, value in conn.execute(
            METRIC_TICKS if thinned else METRIC_RANGE, span)]
    return rows
