"""The job database: its file, its schema and the transactions every store call runs in.

One file, ``<state dir>/jobs.sqlite``, in WAL mode (:func:`connect`), so a coordinator
restarted on the same state dir (or a second process reading it, such as a CLI) sees
every committed job.

The schema has a version (table ``schema_version``) and a migration path
(:data:`MIGRATIONS`, applied in order at open, all in one transaction); a database
written by a newer jaxpod is refused rather than misread.

:class:`JobDatabase` holds the one connection of a store
(:class:`~jaxpod.service.jobs.store.JobStore` builds on it) and its transactions: a
write is one ``BEGIN IMMEDIATE`` transaction, a read one snapshot.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from jaxpod.errors import JobNotFoundError, VersionMismatchError
from jaxpod.jobs import JobState
from jaxpod.service.jobs.codec import JobStoreError
from jaxpod.service.jobs.states import TERMINAL_STATES

logger = logging.getLogger(__name__)

#: PRAGMA auto_vacuum's value for INCREMENTAL.
_INCREMENTAL = 2
#: The bytes the write-ahead log keeps after a checkpoint.
WAL_SIZE_LIMIT = 16 * 2**20
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

# v12: the programs each attempt loaded from the compilation cache and compiled.
_V12 = ["ALTER TABLE attempts ADD COLUMN programs_loaded INTEGER",
        "ALTER TABLE attempts ADD COLUMN programs_compiled INTEGER"]


# v13: the metrics table clustered on its key (WITHOUT ROWID): a point is stored once,
# not as a row plus an index entry, so a long job's history takes half the file. A
# one-time copy of the table at upgrade.
_V13 = ["""CREATE TABLE metrics_v13 (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        name TEXT NOT NULL,
        step INTEGER NOT NULL,
        value REAL,                             -- NULL is NaN (SQLite stores NaN as NULL)
        PRIMARY KEY (job_id, name, step)
    ) WITHOUT ROWID""",
        "INSERT INTO metrics_v13 SELECT job_id, name, step, value FROM metrics",
        "DROP TABLE metrics",
        "ALTER TABLE metrics_v13 RENAME TO metrics"]


# v14: payloads in a table of their own. In the jobs row, a payload of a few KiB filled
# a page per job, and a page a pruned row left nearly empty stayed in the file for
# ever; now the row is small (many to a page) and pruning frees the payload's pages.
# jobs.payload keeps x'' (its CHECK still holds) or names nothing when payload_path
# does: the payload is in payloads, or in the file.
_V14 = ["""CREATE TABLE payloads (
        job_id TEXT PRIMARY KEY REFERENCES jobs(id),
        payload BLOB NOT NULL
    )""",
        "INSERT INTO payloads SELECT id, payload FROM jobs WHERE payload_path IS NULL",
        "UPDATE jobs SET payload = x'' WHERE payload_path IS NULL"]


# v15: retention. A pinned job is never pruned; a pruned one keeps its row, the first
# and last of its history, its attempts, goodput and a few points of each metric
# (service/jobs/retention.py). The partial index finds the finished jobs not yet pruned
# without reading the pruned ones, which only grow.
_V15 = ["ALTER TABLE jobs ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN pruned_at REAL",
        "CREATE INDEX jobs_by_finish ON jobs(finished_at) WHERE finished_at IS NOT NULL",
        "CREATE INDEX jobs_to_prune ON jobs(finished_at) "
        "WHERE pruned_at IS NULL AND finished_at IS NOT NULL"]


# v16: how long each checkpoint stalled the job's steps (JobCheckpoint.stall_s).
_V16 = ["ALTER TABLE checkpoints ADD COLUMN stall_s REAL"]

# v17: the slice type each attempt ran on (an elastic job's may differ).
_V17 = ["ALTER TABLE attempts ADD COLUMN accelerator_type TEXT"]

# v18: the team a job's slices count against (jobs recorded before: the default team).
_V18 = ["ALTER TABLE jobs ADD COLUMN team TEXT NOT NULL DEFAULT 'default'"]

# v19: a fork's source job and the step of the source's checkpoint it starts from.
_V19 = ["ALTER TABLE jobs ADD COLUMN fork_of TEXT", "ALTER TABLE jobs ADD COLUMN fork_step INTEGER"]

# v20: a source's unfinished forks found at once (retention keeps such a source whole).
_V20 = ["CREATE INDEX jobs_forks_waiting ON jobs(fork_of) "
        "WHERE fork_of IS NOT NULL AND finished_at IS NULL"]


#: MIGRATIONS[i] takes a database from schema version i to i + 1. Append only: never
#: edit a released one (databases in the field were built by it).
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _statements(_V1), _statements(_V2), _statements(_V3), _statements(_V4),
    _statements(_V5), _statements(_V6), _statements(_V7), _statements(_V8),
    _statements(_V9), _statements(_V10), _statements(_V11), _statements(_V12),
    _statements(_V13), _statements(_V14), _statements(_V15), _statements(_V16),
    _statements(_V17), _statements(_V18), _statements(_V19), _statements(_V20)]
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


# --------------------------------------------------------------------------- connection

def connect(path: Path) -> sqlite3.Connection:
    """Opens the database file in WAL mode, foreign keys on."""
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (sqlite3's implicit
    # transactions would not cover DDL in migrations nor start IMMEDIATE).
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                           timeout=BUSY_TIMEOUT_S)
    try:
        # Before anything is written: a new database frees pages as retention deletes
        # rows (JobDatabase.vacuum); an older one is converted once at open.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JobStoreError(f"Could not put {path} in WAL mode (SQLite answered "
                                f"{mode!r}); the state dir must be on a local file system.")
        # NORMAL in WAL mode: a committed write survives the process being killed (only
        # an OS crash can lose the last ones), and writes need no fsync each.
        conn.execute("PRAGMA synchronous = NORMAL")
        # The log is reused after each checkpoint; past this size it is cut back, so a
        # burst of writes does not leave a large file for ever.
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()
        raise
    return conn


class JobDatabase:
    """The database of one state dir: one connection, one lock (SQLite serialises
    writers anyway); other processes may open the same dir at the same time. Opening it
    brings its schema up to date."""

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / "jobs.sqlite"
        self._clock = clock
        self._lock = threading.Lock()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.path)
        try:
            if self._conn.execute("PRAGMA auto_vacuum").fetchone()[0] != _INCREMENTAL:
                # A database made before retention: one full rewrite turns incremental
                # vacuuming on (SQLite can switch it only so); minutes for a huge one.
                logger.info("converting %s for incremental vacuuming (once)", self.path)
                self._conn.execute("VACUUM")
            with self._write() as conn:
                migrate(conn, where=str(self.path))
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def vacuum(self, pages: int) -> tuple[int, int]:
        """Gives up to ``pages`` free pages back to the file system (deleted rows leave
        free pages inside the file); returns the pages freed and those still free.
        Bounded, so it never holds the write lock for long."""
        with self._lock:
            before = int(self._conn.execute("PRAGMA freelist_count").fetchone()[0])
            # executescript: execute() steps the pragma once, freeing one page; 0 would
            # mean every free page (never unbounded).
            self._conn.executescript(f"PRAGMA incremental_vacuum({max(int(pages), 1)})")
            after = int(self._conn.execute("PRAGMA freelist_count").fetchone()[0])
            # The file shrinks when the log is copied back into it; PASSIVE waits for
            # no reader (what a reader still needs is copied next time).
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        return before - after, after

    def size_bytes(self) -> int:
        """The database file's size (its write-ahead log not included)."""
        with self._lock:
            count = self._conn.execute("PRAGMA page_count").fetchone()[0]
            size = self._conn.execute("PRAGMA page_size").fetchone()[0]
        return int(count) * int(size)

    def __enter__(self) -> Self:
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

    def _not_found(self, job_id: str) -> JobNotFoundError:
        # Not the file's path: the error travels to clients, who have no use for the
        # server's file system layout.
        return JobNotFoundError(str(job_id), "this service's job store")

    def _require(self, conn: sqlite3.Connection, job_id: str) -> JobState:
        row = conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise self._not_found(job_id)
        return JobState(row[0])
