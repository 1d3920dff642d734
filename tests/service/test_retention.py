"""Retention of finished jobs: what a pruned job keeps and loses, which jobs are pruned,
the audit log's age limit and the file given back, on a real SQLite job store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxpod.jobs import JobState
from jaxpod.service.jobs.retention import DAY_S, Retention, RetentionPolicy
from jaxpod.service.jobs.states import Allocating, Cancelled, Running, Succeeded
from jaxpod.service.jobs.store import JobStore, JobStoreError

S = JobState


class Clock:
    """Time that moves only when told (seconds since the epoch)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Any:
    with JobStore(tmp_path / "state", clock=clock) as s:
        yield s


def run_job(store: JobStore, job_id: str, steps: int, losses: np.ndarray,
            folders: Path | None = None) -> None:
    """A job recorded as the runner records one: a metric per loop, a log line, its
    checkpoint, its result, then SUCCEEDED."""
    store.create_job(steps=steps, payload=b"spec of " + job_id.encode(), job_id=job_id)
    store.transition(job_id, Allocating(1))
    attempt = store.record_attempt(job_id)
    store.transition(job_id, Running(attempt, 0))
    for step in range(1, steps + 1):
        store.add_metrics(job_id, step, {"loss": losses[step - 1], "lr": 0.1})
    store.append_logs(job_id, 0, [f"{job_id} says hello"])
    if folders is not None:
        (folders / job_id / str(steps)).mkdir(parents=True)
        (folders / job_id / str(steps) / "state").write_bytes(b"x" * 100)
    store.set_checkpoints(job_id, {steps: f"/ckpt/{job_id}/{steps}/state"})
    store.save_result(job_id, {"loss": np.float32(losses[-1])})
    store.end_attempt(job_id, attempt, cause="succeeded", step_reached=steps)
    store.transition(job_id, Succeeded())


def retention(store: JobStore, clock: Clock, *, days: float = 30, jobs: int = 2,
              points: int = 8, folders: Path | None = None) -> Retention:
    def remove(job_id: str) -> None:
        if folders is not None and (folders / job_id).exists():
            import shutil

            shutil.rmtree(folders / job_id)

    return Retention(store, RetentionPolicy(days=days, jobs=jobs, audit_days=365,
                                            metric_points=points), remove, clock=clock)


def test_the_newest_jobs_stay_whole_and_older_ones_keep_a_summary(
        store: JobStore, clock: Clock, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    losses = {f"j{i}": rng.random(100) for i in range(5)}
    folders = tmp_path / "checkpoints"
    for job_id, series in losses.items():
        clock.now += 10
        run_job(store, job_id, 100, series, folders)
    store.set_pinned("j0", True)
    report = retention(store, clock, jobs=2, folders=folders).run_once()
    assert report.jobs_pruned == 2  # j1, j2: j0 is pinned, j3 and j4 the newest two
    for job_id in ("j0", "j3", "j4"):
        status = store.get(job_id)
        assert status.pruned_at is None
        assert len(store.metrics(job_id)["loss"]) == 100
        assert store.logs(job_id) and store.load_result(job_id) is not None
        assert (folders / job_id).exists() and len(store.history(job_id)) == 4
    assert store.get("j0").pinned
    for job_id in ("j1", "j2"):
        status = store.get(job_id)
        assert status.pruned_at == clock.now and status.state is S.SUCCEEDED
        assert status.step == 100 and status.attempts == 1
        # the latest metrics stay exact; each series keeps 8 points, ends included,
        # each at its own step with its own value
        assert status.metrics == {"loss": losses[job_id][-1], "lr": 0.1}
        kept = store.metrics(job_id)["loss"]
        steps = np.array([s for s, _ in kept])
        assert len(kept) == 8 and steps[0] == 1 and steps[-1] == 100
        np.testing.assert_array_equal([v for _, v in kept], losses[job_id][steps - 1])
        assert np.diff(steps).max() - np.diff(steps).min() <= 1
        # the first and the last of its history: submitted, and how it ended
        history = store.history(job_id)
        assert [(t.from_state, t.to_state) for t in history] == [
            (None, S.PENDING), (S.RUNNING, S.SUCCEEDED)]
        assert store.logs(job_id) == [] and store.checkpoints(job_id) == []
        assert store.load_result(job_id) is None and not (folders / job_id).exists()
        assert not store.job_dir(job_id).exists()
        assert store.attempts(job_id)[0].step_reached == 100
        with pytest.raises(JobStoreError, match="removed by retention"):
            store.load_payload(job_id)
        with pytest.raises(JobStoreError, match="pruned by retention"):
            store.set_pinned(job_id, True)
    # a second pass finds nothing more to do
    assert retention(store, clock, jobs=2).run_once().jobs_pruned == 0


def test_jobs_older_than_the_days_are_pruned_even_among_the_newest(
        store: JobStore, clock: Clock) -> None:
    run_job(store, "old", 10, np.arange(10.0))
    clock.now += 2 * DAY_S
    run_job(store, "new", 10, np.arange(10.0))
    store.create_job(steps=5, payload=b"", job_id="queued")  # unfinished: never pruned
    keeper = retention(store, clock, days=1, jobs=100)
    assert keeper.run_once().jobs_pruned == 1
    assert store.get("old").pruned_at is not None and store.get("new").pruned_at is None
    clock.now += 2 * DAY_S
    keeper.run_once()
    assert store.get("new").pruned_at is not None
    assert store.get("queued").pruned_at is None and store.get("queued").state is S.PENDING


def test_an_unpinned_job_is_pruned_at_the_next_pass(store: JobStore, clock: Clock) -> None:
    for job_id in ("a", "b"):
        clock.now += 1
        run_job(store, job_id, 5, np.arange(5.0))
    assert store.set_pinned("a", True).pinned
    keeper = retention(store, clock, jobs=1)
    assert keeper.run_once().jobs_pruned == 0
    assert not store.set_pinned("a", False).pinned
    assert keeper.run_once().jobs_pruned == 1 and store.get("a").pruned_at is not None


def test_a_source_stays_whole_until_its_forks_have_finished(
        store: JobStore, clock: Clock, tmp_path: Path) -> None:
    folders = tmp_path / "checkpoints"
    for job_id in ("source", "other"):
        clock.now += 1
        run_job(store, job_id, 5, np.arange(5.0), folders)
    store.create_job(steps=9, payload=b"fork", job_id="fork")
    store.set_fork_origin("fork", "source", 5)  # queued: it will read source/5
    keeper = retention(store, clock, jobs=1, folders=folders)
    clock.now += 1
    assert keeper.run_once().jobs_pruned == 0  # "other" is the newest; "source" waits
    assert store.get("source").pruned_at is None and (folders / "source").exists()
    assert not store.prune("source", 4)  # nor when asked directly
    store.transition("fork", Cancelled("no longer needed"))  # now the newest finished
    assert keeper.run_once().jobs_pruned == 2
    assert store.get("source").pruned_at is not None and not (folders / "source").exists()


def test_a_folder_that_cannot_be_deleted_keeps_its_job_whole(
        store: JobStore, clock: Clock) -> None:
    for job_id in ("a", "b"):
        clock.now += 1
        run_job(store, job_id, 5, np.arange(5.0))

    def refuse(job_id: str) -> None:
        raise PermissionError(f"403 on gs://bucket/{job_id}")

    policy = RetentionPolicy(days=30, jobs=1, audit_days=365, metric_points=4)
    report = Retention(store, policy, refuse, clock=clock).run_once(max_jobs=1)
    assert report.jobs_pruned == 0 and not report.more  # no retry loop against a refusal
    assert store.get("a").pruned_at is None and store.logs("a")


def test_old_audit_records_go(store: JobStore, clock: Clock) -> None:
    store.record_audit("alice", "submit", "old")
    clock.now += 400 * DAY_S
    store.record_audit("bob", "submit", "new")
    assert retention(store, clock).run_once().audit_deleted == 1
    assert [r.target for r in store.audit()] == ["new"]


def test_pruning_gives_the_file_back(store: JobStore, clock: Clock) -> None:
    for i in range(16):
        clock.now += 1
        run_job(store, f"j{i}", 1000, np.linspace(1, 0, 1000))
    store.append_logs("j0", 0, ["x" * 200] * 5000)
    full = os.path.getsize(store.path) + os.path.getsize(f"{store.path}-wal")
    keeper = retention(store, clock, jobs=1)
    while keeper.run_once().more:
        pass
    # 15 of 16 jobs pruned to 8 points a series: the file keeps about one job's rows
    assert os.path.getsize(store.path) < full / 5
    assert store.size_bytes() == os.path.getsize(store.path)


def test_a_policy_from_flags_refuses_what_cannot_be(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"--retain-days must be > 0; got -1"):
        RetentionPolicy.from_settings(days=-1)
    with pytest.raises(ValueError, match=r"--retain-jobs must be > 0; got 0"):
        RetentionPolicy.from_settings(jobs=0)
    monkeypatch.setenv("JAXPOD_RETAIN_JOBS", "7")
    policy = RetentionPolicy.from_settings(days=2)
    assert (policy.days, policy.jobs) == (2.0, 7)


def test_an_old_database_is_converted_for_incremental_vacuum(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "state" / "jobs.sqlite"
    path.parent.mkdir()
    with sqlite3.connect(path) as conn:  # a file made before retention: no auto_vacuum
        conn.execute("CREATE TABLE t (x)")
    with JobStore(path.parent) as store:
        assert store.vacuum(1000)[1] == 0  # every free page given back
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
