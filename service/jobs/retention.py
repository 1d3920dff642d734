"""Retention: what a service that runs for months keeps of its finished jobs.

A finished job stays whole while it is among the newest ``jobs`` finished and younger
than ``days``; past either limit it is **pruned**: its checkpoint folder (checkpoints,
TensorBoard scalars, profiles) is deleted, and in the store it keeps its row (what it
was, how it ended), the first and last of its history, its attempts and goodput, and
``metric_points`` points of each metric, the last included; its logs, spec and result
go. A pinned job (``job.pin()``) is never pruned. Audit records older than
``audit_days`` go too, and the pages the deletions freed are given back to the file
system a bounded number at a time (SQLite's incremental vacuum).

So the database grows with the number of jobs by one row each, not with their steps
or logs: ``benchmarks/retention.py`` runs 10,000 jobs of 1,000 metric steps each.

:class:`Retention` runs a pass every ``JAXPOD_RETENTION_EVERY_S`` on a thread of its
own, and passes back to back while a backlog remains (a first start on an old state
dir). Each job is pruned in its own transaction, so running jobs' writes interleave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxpod import settings
from jaxpod.service.jobs.store import JobStore

logger = logging.getLogger(__name__)

DAY_S = 86_400.0
#: Jobs one pass prunes at most (each its own transaction).
PASS_JOBS = 200
#: Free database pages (4 KiB each) one pass gives back at most.
PASS_PAGES = 4096
#: How long stopping waits for a pass in progress (it ends after its current job).
STOP_WAIT_S = 30.0


@dataclass(frozen=True)
class RetentionPolicy:
    """What is kept. ``days`` and ``jobs`` are ``jaxpod serve --retain-days`` and
    ``--retain-jobs``."""

    days: float
    jobs: int
    audit_days: float
    metric_points: int

    @classmethod
    def from_settings(cls, days: float | None = None, jobs: int | None = None
                      ) -> RetentionPolicy:
        """The settings' policy, with ``days`` and ``jobs`` when given (validated)."""
        for flag, value in (("--retain-days", days), ("--retain-jobs", jobs)):
            if value is not None and not value > 0:
                raise ValueError(f"jaxpod serve: {flag} must be > 0; got {value!r}. "
                                 "Pinned jobs (job.pin()) are kept whatever the limits.")
        return cls(days=float(days if days is not None else settings.RETAIN_DAYS.value()),
                   jobs=int(jobs if jobs is not None else settings.RETAIN_JOBS.value()),
                   audit_days=float(settings.AUDIT_RETAIN_DAYS.value()),
                   metric_points=int(settings.RETAIN_METRIC_POINTS.value()))


@dataclass(frozen=True)
class PassReport:
    """What one pass did."""

    jobs_pruned: int
    audit_deleted: int
    free_pages: int  # free pages left in the file after the pass
    more: bool  # jobs past retention remain (the next pass starts at once)


class Retention:
    """Prunes ``store``'s finished jobs past ``policy``.

    Args:
      store: the job store.
      policy: what to keep.
      remove_folder: deletes a job's checkpoint folder (called before its rows go: a
        pass that stops in between prunes the job again next time).
      clock: seconds since the epoch (the store's clock).
    """

    def __init__(self, store: JobStore, policy: RetentionPolicy,
                 remove_folder: Callable[[str], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.policy = policy
        self._remove_folder = remove_folder
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, max_jobs: int = PASS_JOBS) -> PassReport:
        """One pass: prunes up to ``max_jobs`` jobs, trims the audit log, vacuums."""
        now = self._clock()
        policy = self.policy
        due = self.store.prunable(finished_before=now - policy.days * DAY_S,
                                  keep_newest=policy.jobs, limit=max_jobs)
        pruned = 0
        for job_id in due:
            if self._stop.is_set():
                break
            try:
                self._remove_folder(job_id)
            except Exception as e:  # kept whole; tried again next pass
                logger.warning("retention: could not delete job %s's checkpoint folder "
                               "(%s: %s); the job stays whole until it can be.",
                               job_id, type(e).__name__, e)
                continue
            pruned += self.store.prune(job_id, policy.metric_points)
        audit = self.store.trim_audit(now - policy.audit_days * DAY_S)
        freed, free = self.store.vacuum(PASS_PAGES)
        if pruned or audit:
            logger.info("retention: pruned %d finished job(s), %d audit record(s); "
                        "%d database page(s) given back, %d free", pruned, audit, freed, free)
        # More at once only while passes make progress: folders that cannot be deleted
        # (a bucket refusing) wait for the next pass instead of being retried in a loop.
        return PassReport(pruned, audit, free,
                          more=(len(due) == max_jobs and pruned > 0) or (free > 0 and freed > 0))

    def start(self, every_s: float | None = None) -> None:
        """Runs a pass now and then every ``every_s`` (``JAXPOD_RETENTION_EVERY_S``), on
        a daemon thread, until :meth:`close`."""
        every = settings.RETENTION_EVERY.resolve(every_s)
        self._thread = threading.Thread(target=self._loop, args=(every,),
                                        name="jaxpod-retention", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the passes (one in progress ends after its current job)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)

    def _loop(self, every: float) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            try:
                report = self.run_once()
            except Exception:  # the store closed under us, a full disk: try again later
                logger.exception("retention: a pass failed; trying again in %.0f s", every)
                report = None
            delay = 0.0 if report is not None and report.more else every
