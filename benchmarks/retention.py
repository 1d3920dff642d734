"""A service that runs for months: 10,000 short jobs of 1,000 metric steps each, and
what the job store holds at the end with ``jaxpod serve --retain-jobs 100``.

A real ``jaxpod serve`` (the simulated cluster's processes provider, with
``--retain-jobs``, a retention pass every second) runs on a state dir while this
process records the jobs into the same job store the way a job's runner records one
(``JobStore``'s own calls: the transitions, the attempt, one ``add_metrics``
transaction per metric step with two series, a log line, the checkpoint and the
result; a second process on the same store, as the CLI is). Running 10,000 real jobs
is out of reach of one 2-core machine; what grows here is what a real job writes.

Figures:

* ``db_mib``, ``wal_mib``: the database file and its write-ahead log at the end, once
  the service pruned every job past the newest ``--retain-jobs``;
  ``db_bytes_per_job``: the file over the jobs (the quick run's target: 50 MiB over
  10,000 jobs, the same bound at its size);
* ``list_ms_start``/``list_ms_end``: ``GET /api/v1/jobs?limit=200&offset=...`` (the
  page's job list: the newest 200) after the first ``--retain-jobs`` jobs and at the
  end; ``job_ms_start``/``job_ms_end``: ``GET /api/v1/jobs/{id}?points=1`` (the page's
  refresh of one job) of the newest job; medians of 31, over HTTP with keep-alive,
  the service's answer cache off (``JAXPOD_HTTP_CACHE_S``);
* ``write_us_per_metric_step``: what one metric step costs the writer.

Targets: the database under 50 MiB (``db_bytes_per_job`` at or under 50 MiB / 10,000
in the quick run), the list and the job under 50 ms at the end.

The last line of output is the JSON report.

Usage: ``python benchmarks/retention.py [--quick] [--jobs N] [--steps N]``
"""

from __future__ import annotations

import argparse
import http.client
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ServeProcess, kept_log_on_failure, report, target

from jaxpod.service.jobs.states import Allocating, Running, Succeeded
from jaxpod.service.jobs.store import JobStore
from jaxpod.timeouts import wait_for

MIB = 2**20
#: The Done-when's figures: 10,000 jobs in under 50 MiB, pages under 50 ms.
DB_LIMIT_MIB, JOBS_AT_LIMIT, PAGE_LIMIT_MS = 50, 10_000, 50
REPEATS = 31
#: How long the service may take to prune what is past retention once writing ends.
CATCH_UP_S = 600.0


def record_job(store: JobStore, job_id: str, steps: int) -> None:
    """One short job as its runner records it."""
    store.create_job(steps=steps, payload=os.urandom(2048), job_id=job_id,
                     name=f"sweep-{job_id}", owner="bench")
    store.transition(job_id, Allocating(1))
    attempt = store.record_attempt(job_id)
    store.transition(job_id, Running(attempt, 0))
    for step in range(1, steps + 1):
        store.add_metrics(job_id, step, {"loss": 1.0 / step, "learning_rate": 1e-3})
    store.append_logs(job_id, 0, [f"job {job_id} done after {steps} steps"])
    store.set_checkpoints(job_id, {steps: f"/checkpoints/{job_id}/{steps}/state"})
    store.save_result(job_id, {"loss": 1.0 / steps})
    store.end_attempt(job_id, attempt, cause="succeeded", step_reached=steps)
    store.transition(job_id, Succeeded())


def free_pages(path: Path) -> int:
    """Pages deleted rows left free inside the database file."""
    with sqlite3.connect(path) as conn:
        return int(conn.execute("PRAGMA freelist_count").fetchone()[0])


class Pages:
    """The page's two reads over one keep-alive HTTP connection."""

    def __init__(self, base: str, token: str) -> None:
        where = urlsplit(base)
        self.conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=60)
        self.headers = {"Authorization": f"Bearer {token}"}

    def get_ms(self, path: str) -> float:
        start = time.perf_counter()
        self.conn.request("GET", path, headers=self.headers)
        response = self.conn.getresponse()
        body = response.read()
        took = (time.perf_counter() - start) * 1e3
        assert response.status == 200, (path, response.status, body[:300])
        return took

    def medians(self, newest: str, total: int) -> tuple[float, float]:
        offset = max(total - 200, 0)
        lists = [self.get_ms(f"/api/v1/jobs?limit=200&offset={offset}")
                 for _ in range(REPEATS)]
        jobs = [self.get_ms(f"/api/v1/jobs/{newest}?points=1") for _ in range(REPEATS)]
        return statistics.median(lists), statistics.median(jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="800 jobs of 100 steps")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--retain-jobs", type=int, default=100)
    args = parser.parse_args()
    jobs = args.jobs or (800 if args.quick else JOBS_AT_LIMIT)
    steps = args.steps or (100 if args.quick else 1_000)
    keep = args.retain_jobs
    figures: dict[str, Any] = {"jobs": jobs, "metric_steps": steps, "series": 2,
                               "retain_jobs": keep}
    with tempfile.TemporaryDirectory(prefix="jaxpod-retention-") as state:
        store = JobStore(Path(state))
        first = min(keep, jobs)
        for i in range(first):
            record_job(store, f"job{i:06d}", steps)
        log = os.path.join(state, "serve.log")
        service = ServeProcess(log, "v4-8", provider="processes", state_dir=state,
                               args=["--retain-jobs", str(keep)],
                               env={"JAXPOD_RETENTION_EVERY_S": "1",
                                    "JAXPOD_HTTP_CACHE_S": "0.000001"})
        with kept_log_on_failure(service, log):
            pages = Pages(service.http, service.token)
            figures["list_ms_start"], figures["job_ms_start"] = (
                round(m, 3) for m in pages.medians(f"job{first - 1:06d}", first))
            start = time.perf_counter()
            for i in range(first, jobs):
                record_job(store, f"job{i:06d}", steps)
                if (i + 1) % max(jobs // 10, 1) == 0:
                    print(f"{i + 1}/{jobs} jobs recorded; database "
                          f"{os.path.getsize(store.path) / MIB:.1f} MiB", flush=True)
            written = jobs - first
            figures["write_us_per_metric_step"] = round(
                (time.perf_counter() - start) / max(written * steps, 1) * 1e6, 1)

            def caught_up() -> bool:
                return not store.prunable(finished_before=0, keep_newest=keep, limit=1)

            assert wait_for(caught_up, CATCH_UP_S, max_poll_s=1.0), \
                f"the service did not prune past --retain-jobs {keep} in {CATCH_UP_S:g} s"
            assert wait_for(lambda: free_pages(store.path) == 0, CATCH_UP_S,
                            max_poll_s=1.0), \
                "the service did not give the freed pages back"
            pages = Pages(service.http, service.token)  # the first one's keep-alive ended
            figures["list_ms_end"], figures["job_ms_end"] = (
                round(m, 3) for m in pages.medians(f"job{jobs - 1:06d}", jobs))
            pruned = store.get("job000000")
            assert pruned.pruned_at is not None and pruned.metrics["loss"] == 1.0 / steps
        store.close()
        db = os.path.getsize(Path(state) / "jobs.sqlite")
        wal = Path(state) / "jobs.sqlite-wal"
        figures["db_mib"] = round(db / MIB, 2)
        figures["wal_mib"] = round(wal.stat().st_size / MIB if wal.exists() else 0.0, 2)
        figures["db_bytes_per_job"] = round(db / jobs)
    print(f"database {figures['db_mib']} MiB ({figures['db_bytes_per_job']} B/job), list "
          f"{figures['list_ms_start']} -> {figures['list_ms_end']} ms, job "
          f"{figures['job_ms_start']} -> {figures['job_ms_end']} ms", flush=True)
    size = (target(figures["db_bytes_per_job"], "<=", DB_LIMIT_MIB * MIB // JOBS_AT_LIMIT)
            if jobs < JOBS_AT_LIMIT else target(figures["db_mib"], "<", DB_LIMIT_MIB))
    report("retention", figures, {
        "db_bytes_per_job" if jobs < JOBS_AT_LIMIT else "db_mib": size,
        "list_ms_end": target(figures["list_ms_end"], "<", PAGE_LIMIT_MS),
        "job_ms_end": target(figures["job_ms_end"], "<", PAGE_LIMIT_MS)})


if __name__ == "__main__":
    main()
