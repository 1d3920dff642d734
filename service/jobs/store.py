"""The job store: every job, its history, attempts, metrics, logs and result, in SQLite.

One file, ``<state dir>/jobs.sqlite``, in WAL mode, so a coordinator restarted on the
same state dir (or a second process reading it, such as a CLI) sees every committed
job. Large payloads and results live next to it, under ``<state dir>/jobs/<id>/``, and
the database names them by a path relative to the state dir (the dir can be moved).

Every public write is one ``BEGIN IMMEDIATE`` transaction: it either lands whole or not
at all, and concurrent writers from other processes queue on SQLite's lock instead of
failing half-way. State changes go through :func:`~jaxpod.service.jobs.states.check_transition`
inside that transaction, so an illegal one writes nothing.

The schema has a version (table ``schema_version``) and a migration path
(:data:`MIGRATIONS`, applied in order at open, all in one transaction); a database
written by a newer jaxpod is refused rather than misread.
"""

from __future__ import annotations

import builtins
import itertools
import json
import math
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxpod.errors import JobNotFoundError, VersionMismatchError
from jaxpod.jobs import (
    Attempt,
    AuditRecord,
    JobCheckpoint,
    JobProfile,
    JobState,
    JobStatus,
    Transition,
)
from jaxpod.service.jobs.codec import JobStoreError, load_trees, save_trees
from jaxpod.service.jobs.files import write_file_atomically
from jaxpod.service.jobs.goodput import PRODUCTIVE_SHARE, WALL_S, summary
from jaxpod.service.jobs.states import (
    TERMINAL_STATES,
    Cancelled,
    Failed,
    JobStateData,
    Retrying,
    Running,
    check_transition,
)

#: Payloads up to this size are kept in the database; larger ones in a file beside it
#: (SQLite handles big blobs, but they bloat the file every reader pages through).
INLINE_PAYLOAD_LIMIT = 1 << 20
#: The audit log keeps its newest records, trimmed every AUDIT_TRIM_EVERY appends; each
#: record's detail is cut at MAX_AUDIT_DETAIL characters.
MAX_AUDIT_RECORDS, AUDIT_TRIM_EVERY, MAX_AUDIT_DETAIL = 100_000, 1_000, 2_000

#: The reason recorded for jobs a restarted coordinator finds in flight.
RESTART_REASON = "coordinator restarted"

#: How long a write waits for another process's transaction before giving up.
BUSY_TIMEOUT_S = 30.0


class SchemaVersionError(VersionMismatchError):
    """The job database was written by a jaxpod with a newer schema than this one."""


# --------------------------------------------------------------------------- schema

_V1 = [
    """CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order (timestamps can tie)
        id TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        accelerator_type TEXT,                  -- NULL: the service's default type
        spec TEXT NOT NULL,                     -- JSON of the plain submit arguments
        payload BLOB,                           -- the shipped payload, when small
        payload_path TEXT,                      -- else its file, relative to the state dir
        created_at REAL NOT NULL,
        state TEXT NOT NULL,
        step INTEGER NOT NULL DEFAULT 0,
        steps INTEGER NOT NULL,
        error TEXT,
        CHECK ((payload IS NULL) <> (payload_path IS NULL))
    )""",
    """CREATE TABLE transitions (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL REFERENCES jobs(id),
        from_state TEXT,                        -- NULL for the creation (-> PENDING)
        to_state TEXT NOT NULL,
        at REAL NOT NULL,
        reason TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX transitions_by_job ON transitions(job_id, seq)",
    """CREATE TABLE attempts (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        number INTEGER NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        cause TEXT,
        step_reached INTEGER,
        PRIMARY KEY (job_id, number)
    )""",
    """CREATE TABLE metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        name TEXT NOT NULL,
        step INTEGER NOT NULL,
        value REAL,                             -- NULL is NaN (SQLite stores NaN as NULL)
        PRIMARY KEY (job_id, name, step)
    )""",
    """CREATE TABLE logs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL REFERENCES jobs(id),
        host INTEGER NOT NULL,
        line TEXT NOT NULL,
        at REAL NOT NULL
    )""",
    "CREATE INDEX logs_by_job ON logs(job_id, seq)",
    """CREATE TABLE results (
        job_id TEXT PRIMARY KEY REFERENCES jobs(id),
        path TEXT NOT NULL,                     -- .npz (state and outputs), relative path
        saved_at REAL NOT NULL
    )""",
]

_TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL_STATES, key=lambda s: s.value))

# v2: start and finish times on the job row (JobStatus shows them; listing many jobs
# should not scan transitions), backfilled from the history, and an index for list(state).
_V2 = [
    "ALTER TABLE jobs ADD COLUMN started_at REAL",
    "ALTER TABLE jobs ADD COLUMN finished_at REAL",
    """UPDATE jobs SET
        started_at = (SELECT MIN(at) FROM transitions t
                      WHERE t.job_id = jobs.id AND t.to_state = 'RUNNING'),
        finished_at = (SELECT MAX(at) FROM transitions t
                       WHERE t.job_id = jobs.id AND t.to_state IN (""" + _TERMINAL_SQL + "))",
    "CREATE INDEX jobs_by_state ON jobs(state, seq)",
]

# v3: goodput, seconds of the job's wall time by category (jaxpod.service.jobs.goodput).
_V3 = [
    """CREATE TABLE goodput (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        category TEXT NOT NULL,
        seconds REAL NOT NULL,
        PRIMARY KEY (job_id, category)
    )""",
]


# v4: when each attempt started running its steps, and from which step: a finished
# job's rate is its last attempt's steps over that attempt's running time.
_V4 = [
    "ALTER TABLE attempts ADD COLUMN running_at REAL",
    "ALTER TABLE attempts ADD COLUMN start_step INTEGER",
]

# v5: the spec is kept once, in the payload (the JobSpec message), not also as JSON.
_V5 = ["ALTER TABLE jobs DROP COLUMN spec"]

# v6: checkpoints are written by the hosts (orbax); the store records each committed step
# and, once per job, the state's frozen structure, which a resumed attempt restores into.
_V6 = [
    "ALTER TABLE jobs ADD COLUMN state_skeleton BLOB",
    """CREATE TABLE checkpoints (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        step INTEGER NOT NULL,
        path TEXT NOT NULL,                     -- the step's state item (a URL or path)
        saved_at REAL NOT NULL,
        PRIMARY KEY (job_id, step)
    )""",
]


def _statements(statements: Sequence[str]) -> Callable[[sqlite3.Connection], None]:
    # One execute() per statement: executescript() would commit the open transaction
    # and so break the all-or-nothing migration.
    def apply(conn: sqlite3.Connection) -> None:
        for statement in statements:
            conn.execute(statement)
    return apply


# v7: jobs record the name of the token that submitted them.
_V7 = ["ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''"]


# v8: the audit log: who submitted, cancelled or was refused what.
_V8 = ["""CREATE TABLE audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        detail TEXT NOT NULL
    )"""]


# v9: jobs' priorities (higher runs first).
_V9 = ["ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0"]


# v10: jax.profiler traces captured of running jobs.
_V10 = ["""CREATE TABLE profiles (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        started_at REAL NOT NULL,
        path TEXT NOT NULL,                     -- its folder (a URL or path)
        seconds REAL NOT NULL,
        files TEXT NOT NULL,                    -- the trace files, a JSON list
        PRIMARY KEY (job_id, path)
    )"""]


# v11: when each attempt's first loop of steps was done (submit -> first step).
_V11 = ["ALTER TABLE attempts ADD COLUMN first_step_at REAL"]


#: MIGRATIONS[i] takes a database from schema version i to i + 1. Append only: never
#: edit a released one (databases in the field were built by it).
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _statements(_V1), _statements(_V2), _statements(_V3), _statements(_V4),
    _statements(_V5), _statements(_V6), _statements(_V7), _statements(_V8),
    _statements(_V9), _statements(_V10), _statements(_V11)]
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn: sqlite3.Connection) -> int:
    """The schema version recorded in ``conn``'s database (0: an empty database)."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version ("
                 "id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)")
    row = conn.execute("SELECT version FROM schema_version WHERE id = 1").fetchone()
    return 0 if row is None else int(row[0])


def migrate(conn: sqlite3.Connection, target: int = SCHEMA_VERSION, where: str = "") -> int:
    """Bring ``conn``'s database to schema ``target``; returns the version it had.

    Runs inside the caller's transaction, so a failing migration leaves the database as
    it was. A database newer than this jaxpod is refused (:class:`SchemaVersionError`).
    """
    found = schema_version(conn)
    if found > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"The job database {where or '(in memory)'} has schema version {found}, but "
            f"this jaxpod knows versions up to {SCHEMA_VERSION}: it was written by a "
            "newer jaxpod. Upgrade jaxpod to the version that wrote it, or start the "
            "service with another --state-dir (or JAXPOD_STATE_DIR).")
    for version in range(found, target):
        MIGRATIONS[version](conn)
    if target > found:
        conn.execute("INSERT INTO schema_version (id, version) VALUES (1, ?) "
                     "ON CONFLICT (id) DO UPDATE SET version = excluded.version", (target,))
    return found


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
    """What :meth:`JobStore.recover` found: every unfinished job, to queue again (in
    creation order), and which of them were in flight (now ``RETRYING``)."""

    requeue: tuple[JobStatus, ...]
    resumed: tuple[JobStatus, ...]


#: A job's row as :func:`_status` reads it: its columns, its attempts so far, the rate
#: of its last attempt that ran steps and ended, and its last transition's reason.
_JOB_COLUMNS = ("id, name, accelerator_type, state, step, steps, error, created_at, "
                "started_at, finished_at, owner, priority, "
                "(SELECT COUNT(*) FROM attempts a WHERE a.job_id = jobs.id), "
                "(SELECT (a.step_reached - a.start_step) / (a.ended_at - a.running_at) "
                " FROM attempts a WHERE a.job_id = jobs.id AND a.ended_at > a.running_at "
                " AND a.step_reached > a.start_step ORDER BY a.number DESC LIMIT 1), "
                "(SELECT reason FROM transitions t WHERE t.job_id = jobs.id "
                " ORDER BY t.seq DESC LIMIT 1)")


def _status(conn: sqlite3.Connection, row: Sequence[Any]) -> JobStatus:
    """The job a :data:`_JOB_COLUMNS` row describes, with its latest metrics and stored
    goodput (read in the caller's transaction). A cancelled job's ``error`` is who or
    what cancelled it."""
    (job_id, name, accelerator_type, state, step, steps, error, created_at, started_at,
     finished_at, owner, priority, attempts, steps_per_s, last_reason) = row
    metrics = {n: math.nan if v is None else v
               for n, v in conn.execute(_LATEST_METRICS, {"job": job_id}).fetchall()}
    totals = dict(conn.execute("SELECT category, seconds FROM goodput WHERE job_id = ? "
                               "ORDER BY category", (job_id,)).fetchall())
    state = JobState(state)
    return JobStatus(
        id=job_id, name=name, state=state, step=step, steps=steps, attempts=attempts,
        queue_position=None, error=last_reason if state is JobState.CANCELLED else error,
        metrics=metrics, goodput=summary(totals) if totals else None, created_at=created_at,
        started_at=started_at, finished_at=finished_at,
        accelerator_type=accelerator_type or "", steps_per_s=steps_per_s, owner=owner,
        priority=priority)


# --------------------------------------------------------------------------- the store

class JobStore:
    """The jobs of one state dir. Thread-safe: one connection, one lock (SQLite
    serialises writers anyway); other processes may open the same dir at the same time.
    """

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / "jobs.sqlite"
        self._clock = clock
        self._lock = threading.Lock()
        # Counts committed submissions and state changes (see :attr:`revision`).
        self._revisions = itertools.count(1)
        self._revision = 0
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._conn = _connect(self.path)
        try:
            with self._write() as conn:
                migrate(conn, where=str(self.path))
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front: two processes that both read then
        # write can otherwise deadlock (SQLITE_BUSY on the upgrade) half-way through.
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:  # also when COMMIT itself failed
                    self._conn.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        # One read transaction: the queries of one call see one snapshot.
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            finally:
                self._conn.execute("COMMIT")

    # ------------------------------------------------------------------ jobs

    def create_job(self, *, steps: int, payload: bytes, name: str | None = None,
                   accelerator_type: str | None = None, job_id: str | None = None,
                   owner: str = "", priority: int = 0) -> JobStatus:
        """Record a new ``PENDING`` job; ``payload`` is its spec (the submitted
        ``JobSpec`` message, which the store does not read); ``name`` defaults to its
        id; ``owner`` is the name of the token that submitted it; ``priority`` its
        place among the queued (higher first)."""
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
                    " created_at, state, steps, owner, priority)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, name or job_id, accelerator_type, inline, rel_path, now,
                     JobState.PENDING.value, steps, owner, priority))
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
            row = conn.execute("SELECT payload, payload_path FROM jobs WHERE id = ?",
                               (job_id,)).fetchone()
        if row is None:
            raise self._not_found(job_id)
        return bytes(row[0]) if row[1] is None else (self.state_dir / row[1]).read_bytes()

    def get(self, job_id: str) -> JobStatus:
        """The job as stored (``queue_position`` and live figures are the manager's)."""
        with self._read() as conn:
            return self._get(conn, job_id)

    def _get(self, conn: sqlite3.Connection, job_id: str) -> JobStatus:
        row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise self._not_found(job_id)
        return _status(conn, row)

    def _not_found(self, job_id: str) -> JobNotFoundError:
        # Not the file's path: the error travels to clients, who have no use for the
        # server's file system layout.
        return JobNotFoundError(str(job_id), "this service's job store")

    def _require(self, conn: sqlite3.Connection, job_id: str) -> JobState:
        row = conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise self._not_found(job_id)
        return JobState(row[0])

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
                      _default_reason(new) if reason is None else reason))

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
        _check_step(step)
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
        _check_step(step_reached)
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

    def first_loop_done(self, job_id: str) -> None:
        """The running attempt (the newest) did its first loop of steps now."""
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE attempts SET first_step_at = COALESCE(first_step_at, ?) "
                         "WHERE job_id = ? AND number = (SELECT MAX(number) FROM attempts "
                         "WHERE job_id = ?)", (self._clock(), job_id, job_id))

    def attempts(self, job_id: str) -> builtins.list[Attempt]:
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT number, started_at, ended_at, cause, step_reached, "
                                "running_at, start_step, first_step_at FROM attempts "
                                "WHERE job_id = ? ORDER BY number", (job_id,)).fetchall()
        return [Attempt(*r) for r in rows]

    # ------------------------------------------------------------------ metrics, logs

    def add_metrics(self, job_id: str, step: int, values: Mapping[str, Any]) -> None:
        """Record ``values`` (name -> a real number) at ``step``, and ``step`` as the job's
        progress, in one transaction. A step recorded again (a resumed attempt redoing it)
        replaces the earlier values."""
        _check_step(step)
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE jobs SET step = ? WHERE id = ?", (step, job_id))
            # Converted row by row inside the transaction: a bad value rolls back the
            # rows and the step written before it.
            for name, value in values.items():
                conn.execute("INSERT OR REPLACE INTO metrics (job_id, name, step, value) "
                             "VALUES (?, ?, ?, ?)", (job_id, str(name), step,
                                                     _metric_value(name, value)))

    def metrics(self, job_id: str, after: int = -1, points: int = 0
                ) -> dict[str, builtins.list[tuple[int, float]]]:
        """Every metric series of the job: name -> [(step, value)] by step.

        Args:
          after: only the points of later steps (to follow a running job: the read
            costs what it returns, not the job's length).
          points: at most this many points per series (0: every one), as a chart of a
            long job draws it: the first and the last, and between them the first point
            at or after each of ``points - 2`` steps evenly spaced between theirs (1:
            the last only). Each is an index seek, so the read costs the points it
            returns, not the job's length; a series whose steps span at most
            ``points`` steps is read whole (it has at most that many points).
        """
        if points < 0:
            raise ValueError(f"points must be >= 0 (0: every point), got {points}")
        with self._read() as conn:
            self._require(conn, job_id)
            if points == 0:
                rows = conn.execute(_METRICS_AFTER, {"job": job_id, "after": after}
                                    ).fetchall()
            else:
                rows = []
                for name, first, last in conn.execute(
                        _METRIC_ENDS, {"job": job_id, "after": after}).fetchall():
                    if first is None:
                        continue
                    if points == 1:
                        first = last
                    span = {"job": job_id, "name": name, "first": first, "last": last,
                            "points": points}
                    thinned = last - first + 1 > points
                    rows += [(name, step, value) for step, value in conn.execute(
                        _METRIC_TICKS if thinned else _METRIC_RANGE, span)]
        series: dict[str, builtins.list[tuple[int, float]]] = {}
        for name, step, value in rows:
            series.setdefault(name, []).append((step, math.nan if value is None else value))
        return series

    def latest_metrics(self, job_id: str) -> dict[str, float]:
        """Each metric's value at the last step it was recorded."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute(_LATEST_METRICS, {"job": job_id}).fetchall()
        return {name: math.nan if value is None else value for name, value in rows}

    def append_logs(self, job_id: str, host: int, lines: Iterable[str]) -> None:
        now = self._clock()
        with self._write() as conn:
            self._require(conn, job_id)
            conn.executemany("INSERT INTO logs (job_id, host, line, at) VALUES (?, ?, ?, ?)",
                             [(job_id, int(host), str(line), now) for line in lines])

    def logs(self, job_id: str, after: int = 0) -> builtins.list[LogLine]:
        """The job's log lines in the order they were appended; ``after``: only lines with
        a larger ``seq`` (to tail)."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT seq, host, line, at FROM logs WHERE job_id = ? AND "
                                "seq > ? ORDER BY seq", (job_id, after)).fetchall()
        return [LogLine(*r) for r in rows]

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

    # ------------------------------------------------------------------ goodput

    def set_goodput(self, job_id: str, totals: Mapping[str, float]) -> None:
        """Record the job's goodput, seconds by category (a
        :meth:`~jaxpod.service.jobs.goodput.GoodputClock.totals`), replacing what was
        recorded before, in one transaction."""
        rows = [(job_id, _goodput_category(name), _goodput_seconds(name, seconds))
                for name, seconds in totals.items()]
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("DELETE FROM goodput WHERE job_id = ?", (job_id,))
            conn.executemany("INSERT INTO goodput (job_id, category, seconds) "
                             "VALUES (?, ?, ?)", rows)

    def goodput(self, job_id: str) -> dict[str, float]:
        """The job's goodput as last recorded, seconds by category (empty: none yet)."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT category, seconds FROM goodput WHERE job_id = ? "
                                "ORDER BY category", (job_id,)).fetchall()
        return {name: seconds for name, seconds in rows}

    # ------------------------------------------------------------------ checkpoints

    def set_state_skeleton(self, job_id: str, skeleton: bytes) -> None:
        """Record the job's state structure (what a resumed attempt restores into)."""
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE jobs SET state_skeleton = ? WHERE id = ?", (skeleton, job_id))

    def state_skeleton(self, job_id: str) -> bytes | None:
        with self._read() as conn:
            self._require(conn, job_id)
            row = conn.execute("SELECT state_skeleton FROM jobs WHERE id = ?",
                               (job_id,)).fetchone()
        return None if row[0] is None else bytes(row[0])

    def set_checkpoints(self, job_id: str, kept: Mapping[int, str]) -> None:
        """Record the steps the hosts keep committed (step -> the state item's path):
        the job's rows become exactly these (a row already there keeps its time)."""
        now = self._clock()
        with self._write() as conn:
            self._require(conn, job_id)
            conn.executemany("INSERT OR IGNORE INTO checkpoints (job_id, step, path, saved_at) "
                             "VALUES (?, ?, ?, ?)",
                             [(job_id, step, path, now) for step, path in kept.items()])
            marks = ", ".join("?" * len(kept))
            conn.execute(f"DELETE FROM checkpoints WHERE job_id = ? AND step NOT IN ({marks})",
                         (job_id, *kept))

    def checkpoints(self, job_id: str) -> builtins.list[JobCheckpoint]:
        """The job's recorded checkpoints, oldest first."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT step, path, saved_at FROM checkpoints WHERE "
                                "job_id = ? ORDER BY step", (job_id,)).fetchall()
        return [JobCheckpoint(*r) for r in rows]

    def add_profile(self, job_id: str, profile: JobProfile) -> None:
        """Records a profile captured of the job."""
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("INSERT OR REPLACE INTO profiles (job_id, started_at, path, seconds, "
                         "files) VALUES (?, ?, ?, ?, ?)",
                         (job_id, profile.started_at, profile.path, profile.seconds,
                          json.dumps(list(profile.files))))

    def profiles(self, job_id: str) -> builtins.list[JobProfile]:
        """The job's recorded profiles, oldest first."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT path, started_at, seconds, files FROM profiles "
                                "WHERE job_id = ? ORDER BY started_at", (job_id,)).fetchall()
        return [JobProfile(path, at, seconds, tuple(json.loads(files)))
                for path, at, seconds, files in rows]

    # ------------------------------------------------------------------ results

    def save_result(self, job_id: str, outputs: Any) -> Path:
        """Store the job's last reduced outputs (a tree with numpy leaves, as the wire
        carries it: :mod:`~jaxpod.service.jobs.codec`) as ``jobs/<id>/result.npz``;
        returns the file's path."""
        rel = Path("jobs") / job_id / "result.npz"
        with self._write() as conn:
            self._require(conn, job_id)
            save_trees(self.state_dir / rel, {"outputs": outputs})
            conn.execute("INSERT OR REPLACE INTO results (job_id, path, saved_at) "
                         "VALUES (?, ?, ?)", (job_id, rel.as_posix(), self._clock()))
        return self.state_dir / rel

    def load_result(self, job_id: str) -> StoredResult | None:
        """The stored result, or None when the job has none (yet)."""
        with self._read() as conn:
            self._require(conn, job_id)
            row = conn.execute("SELECT path, saved_at FROM results WHERE job_id = ?",
                               (job_id,)).fetchone()
        if row is None:
            return None
        trees = load_trees(self.state_dir / row[0])
        return StoredResult(outputs=trees["outputs"], saved_at=row[1],
                            legacy_state=trees.get("state"))

    def job_dir(self, job_id: str) -> Path:
        """Where the job's files live (a large payload, the result)."""
        return self.state_dir / "jobs" / job_id

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
            waiting = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state IN (?, ?) "
                                   "ORDER BY seq", (JobState.PENDING.value,
                                                    JobState.RETRYING.value)).fetchall()
            requeue = tuple(_status(conn, r) for r in waiting)
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
            rows = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs {where} ORDER BY seq "
                                "LIMIT ? OFFSET ?",
                                (*args, -1 if limit is None else limit, offset)).fetchall()
            return [_status(conn, r) for r in rows]


# --------------------------------------------------------------------------- helpers

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
_LATEST_METRICS = _METRIC_NAMES + """
SELECT name, (SELECT value FROM metrics WHERE job_id = :job AND name = names.name
              ORDER BY step DESC LIMIT 1)
FROM names WHERE name IS NOT NULL
"""
#: Each metric's points after step :after, by name and step: a range seek per name.
_METRICS_AFTER = _METRIC_NAMES + """
SELECT m.name, m.step, m.value FROM names
JOIN metrics m ON m.job_id = :job AND m.name = names.name AND m.step > :after
WHERE names.name IS NOT NULL
ORDER BY m.name, m.step
"""
#: Each metric's first step after :after (NULL if none) and last step: two seeks a name.
_METRIC_ENDS = _METRIC_NAMES + """
SELECT name,
       (SELECT step FROM metrics WHERE job_id = :job AND name = names.name
          AND step > :after ORDER BY step LIMIT 1),
       (SELECT step FROM metrics WHERE job_id = :job AND name = names.name
          ORDER BY step DESC LIMIT 1)
FROM names WHERE name IS NOT NULL
"""
#: One metric's points from step :first to :last.
_METRIC_RANGE = """
SELECT step, value FROM metrics
WHERE job_id = :job AND name = :name AND step BETWEEN :first AND :last ORDER BY step
"""
#: One metric's first point at or after each of :points steps evenly spaced from :first
#: to :last (both points, so both kept): a seek per point (:points >= 2).
_METRIC_TICKS = """
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


def _connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (sqlite3's implicit
    # transactions would not cover DDL in migrations nor start IMMEDIATE).
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                           timeout=BUSY_TIMEOUT_S)
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JobStoreError(f"Could not put {path} in WAL mode (SQLite answered "
                                f"{mode!r}); the state dir must be on a local file system.")
        # NORMAL in WAL mode: a committed write survives the process being killed (only
        # an OS crash can lose the last ones), and writes need no fsync each.
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def _check_step(step: int) -> None:
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
        raise JobStoreError(f"A step must be an int >= 0; got {step!r}.")


def _metric_value(name: object, value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise JobStoreError(
            f"Metric {name!r} must be a real number (a scalar); got "
            f"{type(value).__name__} {value!r:.80}. Reduce it to one number per step."
        ) from None


def _goodput_category(name: object) -> str:
    if not isinstance(name, str) or not name or name in (WALL_S, PRODUCTIVE_SHARE):
        raise JobStoreError(f"A goodput category must be a category name (not empty, not "
                            f"the summary's wall_s or productive_share); got {name!r}.")
    return name


def _goodput_seconds(name: str, seconds: object) -> float:
    try:
        value = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise JobStoreError(f"Goodput seconds must be finite and >= 0; got {seconds!r} "
                            f"for {name!r}.")
    return value


def _default_reason(new: JobStateData) -> str:
    if isinstance(new, Failed):
        return new.error
    if isinstance(new, Cancelled):
        return new.reason
    if isinstance(new, Retrying):
        return new.cause
    return ""
