"""The job store: every job, its history, attempts, metrics, logs and result, in SQLite.

One file, ``<state dir>/jobs.sqlite``, in WAL mode, so a coordinator restarted on the
same state dir (or a second process reading it, such as a CLI) sees every committed
job. Large payloads and results live next to it, under ``<state dir>/jobs/<id>/``, and
the database names them by a path relative to the state dir (the dir can be moved).

Every public write is one ``BEGIN IMMEDIATE`` transaction: it either lands whole or not
at all, and concurrent writers from other processes queue on SQLite's lock instead of
failing half-way. State changes go through :func:`~jaxpod.service.jobs.states.check_transition`
inside that transaction, so an illegal one writes nothing.

:class:`JobStore` is the jobs themselves: their rows, state changes, attempts, the
audit log, recovery after a restart and listing. It builds on
:mod:`~jaxpod.service.jobs.store_reports` (what a running job reports: metrics, logs,
goodput, checkpoints, profiles, results), which builds on
:mod:`~jaxpod.service.jobs.store_database` (the file, its schema and migrations, the
transactions); :mod:`~jaxpod.service.jobs.store_rows` reads rows into jaxpod's types.
"""

from __future__ import annotations

import builtins
import itertools
import secrets
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxpod.jobs import Attempt, AuditRecord, JobState, JobStatus, Transition
from jaxpod.service.auth.teams import DEFAULT_TEAM
from jaxpod.service.jobs.codec import JobStoreError
from jaxpod.service.jobs.files import write_file_atomically
from jaxpod.service.jobs.states import Failed, JobStateData, Retrying, Running, check_transition
from jaxpod.service.jobs.store_reports import JobReports
from jaxpod.service.jobs.store_rows import (
    JOB_COLUMNS,
    Recovery,
    check_step,
    default_reason,
    job_status,
    metric_rows,
)

#: Payloads up to this size are kept in the database; larger ones in a file beside it
#: (SQLite handles big blobs, but they bloat the file every reader pages through).
INLINE_PAYLOAD_LIMIT = 1 << 20
#: The audit log keeps its newest records, trimmed every AUDIT_TRIM_EVERY appends; each
#: record's detail is cut at MAX_AUDIT_DETAIL characters.
MAX_AUDIT_RECORDS, AUDIT_TRIM_EVERY, MAX_AUDIT_DETAIL = 100_000, 1_000, 2_000

#: A job row no unfinished fork reads a checkpoint of (retention keeps such a source).
_NO_FORK_WAITS = ("NOT EXISTS (SELECT 1 FROM jobs AS fork WHERE fork.fork_of = jobs.id "
                  "AND fork.finished_at IS NULL)")
#: The reason recorded for jobs a restarted coordinator finds in flight.
RESTART_REASON = "coordinator restarted"


class JobStore(JobReports):
    """The jobs of one state dir. Thread-safe: one connection, one lock (SQLite
    serialises writers anyway); other processes may open the same dir at the same time.
    """

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        # Counts committed submissions and state changes (see :attr:`revision`).
        self._revisions = itertools.count(1)
        self._revision = 0
        super().__init__(state_dir, clock)

    # ------------------------------------------------------------------ jobs

    def create_job(self, *, steps: int, payload: bytes, name: str | None = None,
                   accelerator_type: str | None = None, job_id: str | None = None,
                   owner: str = "", priority: int = 0, team: str = DEFAULT_TEAM
                   ) -> JobStatus:
        """Record a new ``PENDING`` job; ``payload`` is its spec (the submitted
        ``JobSpec`` message, which the store does not read); ``name`` defaults to its
        id; ``owner`` is the name of the token that submitted it and ``team`` that
        token's team; ``priority`` its place among the queued (higher first)."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise JobStoreError(f"steps must be an int >= 1; got {steps!r}.")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise JobStoreError(f"payload must be bytes; got {type(payload).__name__}.")
        job_id = job_id or secrets.token_hex(6)
        now = self._clock()
        inline, rel_path = self._place_payload(job_id, bytes(payload))
        try:
            with self._write() as conn:
                conn.execute(
                    "INSERT INTO jobs (id, name, accelerator_type, payload, payload_path,"
                    " created_at, state, steps, owner, priority, team)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, name or job_id, accelerator_type,
                     None if inline is None else b"", rel_path, now,
                     JobState.PENDING.value, steps, owner, priority, team))
                if inline is not None:
                    conn.execute("INSERT INTO payloads (job_id, payload) VALUES (?, ?)",
                                 (job_id, inline))
                conn.execute("INSERT INTO transitions (job_id, from_state, to_state, at, reason)"
                             " VALUES (?, NULL, ?, ?, 'submitted')",
                             (job_id, JobState.PENDING.value, now))
                created = self._get(conn, job_id)
        except BaseException:
            if rel_path is not None:
                (self.state_dir / rel_path).unlink(missing_ok=True)
            raise
        self._changed()
        return created

    def _place_payload(self, job_id: str, payload: bytes) -> tuple[bytes | None, str | None]:
        if len(payload) <= INLINE_PAYLOAD_LIMIT:
            return payload, None
        rel = Path("jobs") / job_id / "payload.bin"
        write_file_atomically(self.state_dir / rel, lambda f: f.write(payload))
        return None, rel.as_posix()

    def load_payload(self, job_id: str) -> bytes:
        """The payload shipped with the job (from the database or its file)."""
        with self._read() as conn:
            row = conn.execute("SELECT (SELECT payload FROM payloads WHERE job_id = id), "
                               "payload_path, pruned_at FROM jobs WHERE id = ?",
                               (job_id,)).fetchone()
        if row is None:
            raise self._not_found(job_id)
        if row[2] is not None:
            raise JobStoreError(f"Job {job_id}'s spec was removed by retention at "
                                f"{time.ctime(row[2])}; pin jobs (job.pin()) to keep it.")
        return bytes(row[0]) if row[1] is None else (self.state_dir / row[1]).read_bytes()

    def get(self, job_id: str) -> JobStatus:
        """The job as stored (``queue_position`` and live figures are the manager's)."""
        with self._read() as conn:
            return self._get(conn, job_id)

    def _get(self, conn: sqlite3.Connection, job_id: str) -> JobStatus:
        row = conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise self._not_found(job_id)
        return job_status(conn, row)

    # ------------------------------------------------------------------ state

    def transition(self, job_id: str, new: JobStateData, reason: str | None = None) -> JobStatus:
        """Move the job to ``new`` (validated against the state machine) and record the
        change with its time and reason, atomically; returns the updated record.

        ``reason`` defaults to what ``new`` carries (a failure's error, a cancellation's
        or retry's cause).
        """
        with self._write() as conn:
            self._transition(conn, job_id, new, reason)
            changed = self._get(conn, job_id)
        self._changed()
        return changed

    @property
    def revision(self) -> int:
        """A number that grows with every submission and state change once committed
        (not with progress, metrics or logs): a read that starts after it was ``r``
        reflects every such change acknowledged before."""
        return self._revision

    def _changed(self) -> None:
        self._revision = next(self._revisions)  # next() of a count is atomic

    def _transition(self, conn: sqlite3.Connection, job_id: str, new: JobStateData,
                    reason: str | None) -> None:
        old = self._require(conn, job_id)
        check_transition(old, new.state)
        now = self._clock()
        sets = ["state = ?"]
        args: list[Any] = [new.state.value]
        if isinstance(new, Running):
            sets += ["step = ?", "started_at = COALESCE(started_at, ?)"]
            args += [new.step, now]
            conn.execute("UPDATE attempts SET running_at = ?, start_step = ? "
                         "WHERE job_id = ? AND number = ?", (now, new.step, job_id, new.attempt))
        if isinstance(new, Failed):
            sets.append("error = ?")
            args.append(new.error)
        if new.state.is_terminal:
            sets.append("finished_at = ?")
            args.append(now)
        conn.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))
        conn.execute("INSERT INTO transitions (job_id, from_state, to_state, at, reason) "
                     "VALUES (?, ?, ?, ?, ?)",
                     (job_id, old.value, new.state.value, now,
                      default_reason(new) if reason is None else reason))

    def history(self, job_id: str) -> builtins.list[Transition]:
        """Every state change of the job, oldest first (the first is the submission)."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT from_state, to_state, at, reason FROM transitions "
                                "WHERE job_id = ? ORDER BY seq", (job_id,)).fetchall()
        return [Transition(None if r[0] is None else JobState(r[0]), JobState(r[1]), r[2], r[3])
                for r in rows]

    def set_step(self, job_id: str, step: int) -> None:
        """Record progress: ``step`` steps are done."""
        check_step(step)
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE jobs SET step = ? WHERE id = ?", (step, job_id))

    # ------------------------------------------------------------------ attempts

    def record_attempt(self, job_id: str) -> int:
        """Start the job's next attempt; returns its number (1 for the first)."""
        with self._write() as conn:
            self._require(conn, job_id)
            (number,) = conn.execute("SELECT COALESCE(MAX(number), 0) + 1 FROM attempts "
                                     "WHERE job_id = ?", (job_id,)).fetchone()
            conn.execute("INSERT INTO attempts (job_id, number, started_at) VALUES (?, ?, ?)",
                         (job_id, number, self._clock()))
            return int(number)

    def end_attempt(self, job_id: str, number: int, *, cause: str, step_reached: int) -> None:
        """End an open attempt with its ``cause`` ("succeeded", "preempted", ...)."""
        check_step(step_reached)
        with self._write() as conn:
            self._require(conn, job_id)
            row = conn.execute("SELECT ended_at FROM attempts WHERE job_id = ? AND number = ?",
                               (job_id, number)).fetchone()
            if row is None or row[0] is not None:
                what = "was never started" if row is None else "has already ended"
                raise JobStoreError(f"Attempt {number} of job {job_id!r} {what}; end only "
                                    "the attempt record_attempt() returned, once.")
            conn.execute("UPDATE attempts SET ended_at = ?, cause = ?, step_reached = ? "
                         "WHERE job_id = ? AND number = ?",
                         (self._clock(), cause, step_reached, job_id, number))

    def set_attempt_type(self, job_id: str, accelerator_type: str) -> None:
        """The running attempt (the newest) runs on ``accelerator_type``, and so does the
        job now (an elastic job moves between types)."""
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE attempts SET accelerator_type = ? WHERE job_id = ? AND "
                         "number = (SELECT MAX(number) FROM attempts WHERE job_id = ?)",
                         (accelerator_type, job_id, job_id))
            conn.execute("UPDATE jobs SET accelerator_type = ? WHERE id = ?",
                         (accelerator_type, job_id))

    def first_loop_done(self, job_id: str, programs: tuple[int, int] | None = None) -> None:
        """The running attempt (the newest) did its first loop of steps now, having
        loaded and compiled ``programs`` (``None``: not known)."""
        loaded, compiled = programs or (None, None)
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE attempts SET first_step_at = COALESCE(first_step_at, ?), "
                         "programs_loaded = COALESCE(programs_loaded, ?), "
                         "programs_compiled = COALESCE(programs_compiled, ?) "
                         "WHERE job_id = ? AND number = (SELECT MAX(number) FROM attempts "
                         "WHERE job_id = ?)", (self._clock(), loaded, compiled, job_id, job_id))

    def attempts(self, job_id: str) -> builtins.list[Attempt]:
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT number, started_at, ended_at, cause, step_reached, "
                                "running_at, start_step, first_step_at, programs_loaded, "
                                "programs_compiled, accelerator_type FROM attempts "
                                "WHERE job_id = ? ORDER BY number", (job_id,)).fetchall()
        return [Attempt(*r) for r in rows]

    # ------------------------------------------------------------------ audit

    def record_audit(self, who: str, action: str, target: str, detail: str = "") -> None:
        """Appends to the audit log, keeping its newest :data:`MAX_AUDIT_RECORDS`."""
        with self._write() as conn:
            seq = conn.execute("INSERT INTO audit (at, who, action, target, detail) VALUES "
                               "(?, ?, ?, ?, ?)", (self._clock(), who, action, target,
                                                   detail[:MAX_AUDIT_DETAIL])).lastrowid
            if seq is not None and seq % AUDIT_TRIM_EVERY == 0:
                conn.execute("DELETE FROM audit WHERE seq <= ?", (seq - MAX_AUDIT_RECORDS,))

    def audit(self, limit: int = 100, before: int = 0) -> builtins.list[AuditRecord]:
        """The newest ``limit`` audit records (with ``seq < before`` if given), oldest
        first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT seq, at, who, action, target, detail FROM audit WHERE seq < ? "
                "ORDER BY seq DESC LIMIT ?", (min(before or 2**62, 2**62), limit)).fetchall()
        return [AuditRecord(*row) for row in reversed(rows)]

    # ------------------------------------------------------------------ retention

    def set_pinned(self, job_id: str, pinned: bool) -> JobStatus:
        """Pin the job (retention never prunes it) or unpin it.

        Raises:
          JobStoreError: pinning a job retention already pruned (what it lost is gone).
        """
        with self._write() as conn:
            self._require(conn, job_id)
            (pruned_at,) = conn.execute("SELECT pruned_at FROM jobs WHERE id = ?",
                                        (job_id,)).fetchone()
            if pinned and pruned_at is not None:
                raise JobStoreError(
                    f"Job {job_id} was pruned by retention at {time.ctime(pruned_at)}: its "
                    "logs, spec, result and checkpoints are gone, so there is nothing "
                    "left to pin. Pin a job before it finishes, or while it is among the "
                    "newest finished ones (jaxpod serve --retain-jobs/--retain-days).")
            conn.execute("UPDATE jobs SET pinned = ? WHERE id = ?", (int(pinned), job_id))
            return self._get(conn, job_id)

    def prunable(self, *, finished_before: float, keep_newest: int, limit: int
                 ) -> builtins.list[str]:
        """Finished jobs retention should prune, oldest first, at most ``limit``: not
        pinned, not pruned, with no unfinished fork reading their checkpoint, and
        finished before ``finished_before`` or not among the ``keep_newest`` finished
        last."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT id FROM jobs WHERE pruned_at IS NULL AND finished_at IS NOT NULL "
                f"AND pinned = 0 AND {_NO_FORK_WAITS} AND (finished_at < :before "
                "OR finished_at < COALESCE("
                " (SELECT finished_at FROM jobs WHERE finished_at IS NOT NULL "
                "  ORDER BY finished_at DESC LIMIT 1 OFFSET :keep - 1), -1)) "
                "ORDER BY finished_at LIMIT :limit",
                {"before": finished_before, "keep": max(keep_newest, 1), "limit": limit}
            ).fetchall()
        return [r[0] for r in rows]

    def prune(self, job_id: str, metric_points: int) -> bool:
        """Cut a finished job down to what says what it was and how it ended: its row,
        the first and last of its history, its attempts and goodput, ``metric_points``
        points of each metric (the last included). Its logs, spec, stored result,
        checkpoint and profile records go, and its files in the state dir. Returns
        whether it was pruned (not if it is pinned, unfinished or pruned already)."""
        with self._write() as conn:
            row = conn.execute(f"SELECT pinned, pruned_at, finished_at, {_NO_FORK_WAITS} "
                               "FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row[0] or row[1] is not None or row[2] is None or not row[3]:
                return False
            summary = metric_rows(conn, job_id, -1, metric_points)
            conn.execute("DELETE FROM metrics WHERE job_id = ?", (job_id,))
            conn.executemany("INSERT INTO metrics (job_id, name, step, value) "
                             "VALUES (?, ?, ?, ?)", [(job_id, *r) for r in summary])
            conn.execute("DELETE FROM transitions WHERE job_id = :job AND seq NOT IN ("
                         "(SELECT MIN(seq) FROM transitions WHERE job_id = :job), "
                         "(SELECT MAX(seq) FROM transitions WHERE job_id = :job))",
                         {"job": job_id})
            for table in ("logs", "checkpoints", "profiles", "results", "payloads"):
                conn.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            conn.execute("UPDATE jobs SET payload = x'', payload_path = NULL, "
                         "state_skeleton = NULL, pruned_at = ? WHERE id = ?",
                         (self._clock(), job_id))
        # After the commit: no row names these files any more.
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        return True

    def trim_audit(self, before: float) -> int:
        """Deletes the audit records older than ``before``; returns how many."""
        with self._write() as conn:
            return conn.execute("DELETE FROM audit WHERE at < ?", (before,)).rowcount

    # ------------------------------------------------------------------ listing, recovery

    def recover(self) -> Recovery:
        """For a coordinator starting on this state dir: every job the last one left in
        flight (``ALLOCATING``, ``RUNNING``) moves to ``RETRYING`` (its open attempt
        ends, cause :data:`RESTART_REASON`), and every unfinished job is returned to be
        queued again, in creation order (the manager resumes each from its latest
        checkpoint, or starts it over)."""
        with self._write() as conn:
            stuck = [r[0] for r in conn.execute(
                "SELECT id FROM jobs WHERE state IN (?, ?) ORDER BY seq",
                (JobState.ALLOCATING.value, JobState.RUNNING.value)).fetchall()]
            for job_id in stuck:
                self._transition(conn, job_id, Retrying(0, RESTART_REASON), RESTART_REASON)
            conn.execute("UPDATE attempts SET ended_at = ?, cause = ?, step_reached = "
                         "(SELECT step FROM jobs WHERE jobs.id = attempts.job_id) "
                         "WHERE ended_at IS NULL", (self._clock(), RESTART_REASON))
            resumed = tuple(self._get(conn, job_id) for job_id in stuck)
            waiting = conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN (?, ?) "
                                   "ORDER BY seq", (JobState.PENDING.value,
                                                    JobState.RETRYING.value)).fetchall()
            requeue = tuple(job_status(conn, r) for r in waiting)
        self._changed()
        return Recovery(requeue=requeue, resumed=resumed)

    def counts(self) -> dict[str, int]:
        """How many jobs are in each state (every state, zeros included): one indexed
        count, not a read of every job."""
        counts = dict.fromkeys((s.value for s in JobState), 0)
        with self._read() as conn:
            for state, count in conn.execute(
                    "SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall():
                counts[state] = int(count)
        return counts

    def list(self, state: JobState | str | None = None, limit: int | None = None,
             offset: int = 0) -> builtins.list[JobStatus]:
        """Jobs in creation order, optionally only those in ``state``; ``limit`` and
        ``offset`` page through them."""
        if (limit is not None and limit < 0) or offset < 0:
            raise JobStoreError(f"limit and offset must be >= 0; got {limit=}, {offset=}.")
        where, args = "", []
        if state is not None:
            where, args = "WHERE state = ?", [JobState.parse(state).value]
        with self._read() as conn:
            rows = conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs {where} ORDER BY seq "
                                "LIMIT ? OFFSET ?",
                                (*args, -1 if limit is None else limit, offset)).fetchall()
            return [job_status(conn, r) for r in rows]

