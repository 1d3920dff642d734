"""What jobs report as they run, in the job store: metrics, logs, goodput, the
checkpoints and profiles the hosts wrote, and the final result.

:class:`JobReports` adds these reads and writes to the database
(:class:`~jaxpod.service.jobs.store_database.JobDatabase`); each is one transaction on
a job that must exist. :class:`~jaxpod.service.jobs.store.JobStore` builds on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxpod.jobs import JobCheckpoint, JobProfile
from jaxpod.service.jobs.codec import load_trees, save_trees
from jaxpod.service.jobs.store_database import JobDatabase
from jaxpod.service.jobs.store_rows import (
    LATEST_METRICS,
    LogLine,
    StoredResult,
    check_step,
    goodput_category,
    goodput_seconds,
    metric_rows,
    metric_value,
)


class JobReports(JobDatabase):
    """A job's metrics, logs, goodput, checkpoints, profiles and result."""

    # ------------------------------------------------------------------ metrics, logs

    def add_metrics(self, job_id: str, step: int, values: Mapping[str, Any]) -> None:
        """Record ``values`` (name -> a real number) at ``step``, and ``step`` as the job's
        progress, in one transaction. A step recorded again (a resumed attempt redoing it)
        replaces the earlier values."""
        check_step(step)
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE jobs SET step = ? WHERE id = ?", (step, job_id))
            # Converted row by row inside the transaction: a bad value rolls back the
            # rows and the step written before it.
            for name, value in values.items():
                conn.execute("INSERT OR REPLACE INTO metrics (job_id, name, step, value) "
                             "VALUES (?, ?, ?, ?)", (job_id, str(name), step,
                                                     metric_value(name, value)))

    def metrics(self, job_id: str, after: int = -1, points: int = 0
                ) -> dict[str, list[tuple[int, float]]]:
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
            rows = metric_rows(conn, job_id, after, points)
        series: dict[str, list[tuple[int, float]]] = {}
        for name, step, value in rows:
            series.setdefault(name, []).append((step, math.nan if value is None else value))
        return series

    def latest_metrics(self, job_id: str) -> dict[str, float]:
        """Each metric's value at the last step it was recorded."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute(LATEST_METRICS, {"job": job_id}).fetchall()
        return {name: math.nan if value is None else value for name, value in rows}

    def append_logs(self, job_id: str, host: int, lines: Iterable[str]) -> None:
        now = self._clock()
        with self._write() as conn:
            self._require(conn, job_id)
            conn.executemany("INSERT INTO logs (job_id, host, line, at) VALUES (?, ?, ?, ?)",
                             [(job_id, int(host), str(line), now) for line in lines])

    def logs(self, job_id: str, after: int = 0, limit: int | None = None) -> list[LogLine]:
        """The job's log lines in the order they were appended; ``after``: only lines with
        a larger ``seq`` (to tail); ``limit``: at most this many."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT seq, host, line, at FROM logs WHERE job_id = ? AND "
                                "seq > ? ORDER BY seq LIMIT ?",
                                (job_id, after, -1 if limit is None else limit)).fetchall()
        return [LogLine(*r) for r in rows]

    # ------------------------------------------------------------------ goodput

    def set_goodput(self, job_id: str, totals: Mapping[str, float]) -> None:
        """Record the job's goodput, seconds by category (a
        :meth:`~jaxpod.service.jobs.goodput.GoodputClock.totals`), replacing what was
        recorded before, in one transaction."""
        rows = [(job_id, goodput_category(name), goodput_seconds(name, seconds))
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

    def set_fork_origin(self, job_id: str, source: str, step: int) -> None:
        """Record that the job is a fork of ``source`` from its checkpoint of ``step``."""
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("UPDATE jobs SET fork_of = ?, fork_step = ? WHERE id = ?",
                         (source, step, job_id))

    def fork_origin(self, job_id: str) -> tuple[str, int] | None:
        """The job's source and the step it was forked from (``None``: not a fork)."""
        with self._read() as conn:
            self._require(conn, job_id)
            row = conn.execute("SELECT fork_of, fork_step FROM jobs WHERE id = ?",
                               (job_id,)).fetchone()
        return None if row[0] is None else (str(row[0]), int(row[1]))

    def state_skeleton(self, job_id: str) -> bytes | None:
        with self._read() as conn:
            self._require(conn, job_id)
            row = conn.execute("SELECT state_skeleton FROM jobs WHERE id = ?",
                               (job_id,)).fetchone()
        return None if row[0] is None else bytes(row[0])

    def set_checkpoints(self, job_id: str, kept: Mapping[int, str],
                        stalls: Mapping[int, float] | None = None) -> None:
        """Record the steps the hosts keep committed (step -> the state item's path),
        with the seconds each stalled the steps when known (``stalls``): the job's rows
        become exactly these (a row already there keeps its time and stall)."""
        now = self._clock()
        with self._write() as conn:
            self._require(conn, job_id)
            conn.executemany("INSERT OR IGNORE INTO checkpoints (job_id, step, path, saved_at,"
                             " stall_s) VALUES (?, ?, ?, ?, ?)",
                             [(job_id, step, path, now, (stalls or {}).get(step))
                              for step, path in kept.items()])
            marks = ", ".join("?" * len(kept))
            conn.execute(f"DELETE FROM checkpoints WHERE job_id = ? AND step NOT IN ({marks})",
                         (job_id, *kept))

    def checkpoints(self, job_id: str) -> list[JobCheckpoint]:
        """The job's recorded checkpoints, oldest first."""
        with self._read() as conn:
            self._require(conn, job_id)
            rows = conn.execute("SELECT step, path, saved_at, stall_s FROM checkpoints "
                                "WHERE job_id = ? ORDER BY step", (job_id,)).fetchall()
        return [JobCheckpoint(*r) for r in rows]

    def add_profile(self, job_id: str, profile: JobProfile) -> None:
        """Records a profile captured of the job."""
        with self._write() as conn:
            self._require(conn, job_id)
            conn.execute("INSERT OR REPLACE INTO profiles (job_id, started_at, path, seconds, "
                         "files) VALUES (?, ?, ?, ?, ?)",
                         (job_id, profile.started_at, profile.path, profile.seconds,
                          json.dumps(list(profile.files))))

    def profiles(self, job_id: str) -> list[JobProfile]:
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

