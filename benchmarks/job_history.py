"""A long job's metric history read back: the reads the dashboard makes, at 1,000 to
1,000,000 steps.

The job store (``JobStore``, the SQLite file ``jaxpod serve`` keeps in its state dir)
holds one job per length, each with 3 metric series recorded at every step (a week of
steps at about 1.6 steps per second is 1,000,000). The rows are written in one
transaction each (a job writes a step's metrics per transaction as it runs; that is not
what is measured here). Each read goes through ``JobStore.metrics``, on a warm page
cache, medians of ``repeats`` (3 for whole reads), the jobs read in turn:

* ``whole_ms_<n>``: every point (``JobResult.metrics``; ``GET /api/v1/jobs/{id}``
  without ``points``);
* ``chart_ms_<n>``: at most 2000 points per series (the page's first load, and each
  event stream's first read);
* ``last_ms_<n>``: the last point of each series (``?points=1``: the page's detail
  refresh, every few seconds while a job runs, from every open page).

``*_longest`` and ``*_shortest`` repeat the figures of the longest and the shortest job.
Targets: ``last_longest_vs_shortest`` <= 2 (the refresh costs the same at any length)
and ``chart_vs_whole_longest`` <= 0.2 (a chart of a long job reads a small part of
what reading it whole costs: until the store thinned by index seeks, the dashboard read
it whole).

The last line of output is the JSON report.

Usage: ``python benchmarks/job_history.py [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import report, target

from jaxpod.service.jobs.store import JobStore

SERIES = ("accuracy", "learning_rate", "loss")
CHART_POINTS = 2000  # what the page asks for (service/http/routes.py)


def record(store: JobStore, job_id: str, steps: int) -> None:
    """A job of ``steps`` steps with every series recorded at each."""
    store.create_job(steps=steps, payload=b"", job_id=job_id)
    with sqlite3.connect(store.path) as conn:
        conn.executemany(
            "INSERT INTO metrics (job_id, name, step, value) VALUES (?, ?, ?, ?)",
            ((job_id, name, step, 1.0 / (1 + step)) for name in SERIES
             for step in range(steps)))


def read_ms(store: JobStore, job_ids: list[str], points: int, repeats: int
            ) -> list[float]:
    """Median milliseconds of ``store.metrics(job_id, points=points)`` for each job, the
    jobs read in turn in each repeat (so a busy spell of the machine falls on all)."""
    times: list[list[float]] = [[] for _ in job_ids]
    for _ in range(repeats):
        for job_id, kept in zip(job_ids, times, strict=True):
            if points == 0:  # a whole read's millions of tuples freed and collected untimed
                gc.collect()
            start = time.perf_counter()
            series = store.metrics(job_id, points=points)
            kept.append(time.perf_counter() - start)
            assert sorted(series) == sorted(SERIES), series.keys()
            del series
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter jobs, fewer repeats")
    args = parser.parse_args()
    lengths = (1_000, 100_000) if args.quick else (1_000, 100_000, 1_000_000)
    repeats = 21 if args.quick else 51
    figures: dict[str, Any] = {"series": len(SERIES), "chart_points": CHART_POINTS,
                               "repeats": repeats}
    with tempfile.TemporaryDirectory(prefix="jaxpod-job-history-") as state, \
            JobStore(Path(state)) as store:
        job_ids = [f"job-{steps}" for steps in lengths]
        for job_id, steps in zip(job_ids, lengths, strict=True):
            record(store, job_id, steps)
            store.metrics(job_id)  # the page cache warm, as on a service that runs it
        for kind, points in (("whole", 0), ("chart", CHART_POINTS), ("last", 1)):
            medians = read_ms(store, job_ids, points, 3 if points == 0 else repeats)
            for steps, ms in zip(lengths, medians, strict=True):
                figures[f"{kind}_ms_{steps}"] = round(ms, 3)
        for steps in lengths:
            print(f"{steps} steps: whole {figures[f'whole_ms_{steps}']} ms, chart "
                  f"{figures[f'chart_ms_{steps}']} ms, last {figures[f'last_ms_{steps}']} ms",
                  flush=True)
    for kind in ("whole", "chart", "last"):
        figures[f"{kind}_ms_longest"] = figures[f"{kind}_ms_{lengths[-1]}"]
        figures[f"{kind}_ms_shortest"] = figures[f"{kind}_ms_{lengths[0]}"]
    figures["longest_steps"] = lengths[-1]
    report("job_history", figures, {
        "last_longest_vs_shortest": target(
            figures["last_ms_longest"] / figures["last_ms_shortest"], "<=", 2),
        "chart_vs_whole_longest": target(
            figures["chart_ms_longest"] / figures["whole_ms_longest"], "<=", 0.2)})


if __name__ == "__main__":
    main()
