"""The job controller's policies and its allocation time-out, on a real job store.

The failure policy and the queue policy are plain objects. Two races of a real cluster
are played by stand-ins of the slice provider's one interface: a slice that looks free
but is never given (a session took it), and a host lost while a survivor still commits
a checkpoint. The controller's real state machine, callbacks and store do the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jaxpod.errors import AllocationTimeoutError, WorkerLostError
from jaxpod.jobs import JobSpec, JobState
from jaxpod.service.jobs import policies
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.jobs.policies import (
    FailureKind,
    GiveUp,
    PriorityQueues,
    Retry,
    RetryBudgets,
)
from jaxpod.service.jobs.store import JobStore
from jaxpod.service.slices.held import HeldSlice
from jaxpod.timeouts import wait_for


def test_retry_budgets_count_each_kind_against_its_own_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXPOD_JOB_RETRY_BACKOFF_S", "0.5")
    monkeypatch.setenv("JAXPOD_JOB_RETRY_BACKOFF_MAX_S", "1.5")
    budgets = RetryBudgets(max_preemptions=3, max_failures=1)
    preempted = policies.Failure(FailureKind.PREEMPTION, "WorkerLostError: host 1")
    failed = policies.Failure(FailureKind.ERROR, "ValueError: bad batch")
    no_slice = policies.Failure(FailureKind.NO_SLICE, "no v4-8 slice within 1s")
    # Preemptions back off, doubling up to the limit; failures retry at once. Asking
    # whether a decision would give up counts nothing.
    assert not any(budgets.gives_up_on(f) for f in (preempted, failed, failed))
    assert [budgets.decide(preempted) for _ in range(3)] == [Retry(0.5), Retry(1.0),
                                                               Retry(1.5)]
    assert budgets.decide(failed) == Retry(0.0)
    assert budgets.gives_up_on(preempted) and budgets.gives_up_on(failed)
    # A slice not found in time never uses a budget up.
    assert all(budgets.decide(no_slice) == Retry(0.5) for _ in range(10))
    assert not budgets.gives_up_on(no_slice)
    assert budgets.decide(preempted) == GiveUp(
        "preempted 4 times, more than max_retries_preemption=3; the last time: "
        "WorkerLostError: host 1")
    assert budgets.decide(failed) == GiveUp("ValueError: bad batch")


def test_queues_order_by_priority_then_submission() -> None:
    queues = PriorityQueues()
    for job_id, priority in (("a", 0), ("b", 2), ("c", 0), ("d", 2), ("e", -1), ("f", 1)):
        queues.push(job_id, "v4-8", priority)
    assert sorted(queues.positions(), key=queues.positions().get) == [
        "b", "d", "f", "a", "c", "e"]
    queues.push("y", "v4-8", 0, first=True)  # a preempted job: the head of its priority
    order = sorted(queues.positions(), key=queues.positions().get)
    assert order == ["b", "d", "f", "y", "a", "c", "e"]
    assert sorted(queues.ranks(), key=queues.ranks().get) == order


def test_fifo_queues_keep_order_per_type() -> None:
    queues = PriorityQueues()
    for job_id, kind in (("a", "v4-8"), ("b", "v4-16"), ("c", "v4-8"), ("d", "v4-16")):
        queues.push(job_id, kind)
    assert queues.positions() == {"a": 0, "c": 1, "b": 0, "d": 1}
    assert sorted(queues.ranks(), key=queues.ranks().get) == ["a", "b", "c", "d"]
    assert queues.remove("a") and not queues.remove("a")
    assert queues.positions()["c"] == 0 and "a" not in queues.ranks()


def test_an_elastic_job_waits_in_the_queue_of_each_type_it_accepts() -> None:
    queues = PriorityQueues()
    queues.push("v8-only", "v4-8")
    for kind in ("v4-16", "v4-8"):  # what the dispatcher does for ("v4-16", "v4-8")
        queues.push("elastic", kind)
    assert queues.positions() == {"v8-only": 0, "elastic": 0}  # its best position
    assert sorted(queues.waiting_types()) == ["v4-16", "v4-8"]
    assert set(queues.ranks()) == {"v8-only", "elastic"}
    assert queues.remove("elastic")  # started: out of both queues at once
    assert queues.positions() == {"v8-only": 0} and queues.waiting_types() == ["v4-8"]
    assert not queues.remove("elastic")


class _NeverFree:
    """A slice provider that says a v4-8 is free but never gives one."""

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        return True

    def acquire(self, request: Any, slice_id: str) -> Any:
        raise AllocationTimeoutError("no v4-8 slice was free (another holder took it)")

    def cluster(self) -> list[Any]:
        return []


def test_a_job_that_gets_no_slice_in_time_says_so_and_tries_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXPOD_JOB_ALLOCATION_TIMEOUT_S", "0.3")
    monkeypatch.setenv("JAXPOD_JOB_ACQUIRE_TRY_S", "0.01")
    monkeypatch.setenv("JAXPOD_JOB_RETRY_BACKOFF_S", "0.05")
    slices = _NeverFree()
    with JobStore(tmp_path) as store:
        manager = JobManager(store, slices)
        manager.start()
        try:
            job = manager.submit(JobSpec(steps=1, step_fn=b"never unpickled",
                                         accelerator_type="v4-8", max_retries_preemption=0,
                                         max_retries_failure=0))
            # Past its budgets (0 and 0) many times over: waiting for a slice is no failure.
            assert wait_for(lambda: len(store.attempts(job.id)) >= 3, 30), store.attempts(job.id)
            history = store.history(job.id)
            retries = [t for t in history if t.to_state is JobState.RETRYING]
            assert retries and retries[0].from_state is JobState.ALLOCATING
            assert "no v4-8 slice within 0.3s (JAXPOD_JOB_ALLOCATION_TIMEOUT_S)" in \
                retries[0].reason
            assert "another holder took it" in retries[0].reason
            first = store.attempts(job.id)[0]
            assert first.cause is not None and first.cause.startswith("no slice:")
            assert manager.status(job.id).state in (JobState.ALLOCATING, JobState.RETRYING)
            cancelled = manager.cancel(job.id)
            assert wait_for(lambda: manager.status(job.id).state is JobState.CANCELLED, 30), \
                cancelled
        finally:
            manager.close()
        goodput = store.goodput(job.id)
        assert goodput["allocating"] > 0 and goodput["recovering"] > 0


class _LostHost:
    """A slice's engine whose host is lost: every call raises, as the real one does."""

    def __getattr__(self, name: str) -> Any:
        def lost(*args: Any, **kwargs: Any) -> Any:
            raise WorkerLostError("host 1 of 2 stopped answering (its process died)")

        return lost


class _LosesAHostAsASurvivorCommits:
    """A slice provider whose slices lose a host at once. Its surviving host finishes
    committing checkpoint ``step`` (every host wrote its part before the loss) only
    while the slice is given back: the coordinator saw the loss first."""

    def __init__(self, checkpoint_dir: Path, step: int) -> None:
        self.checkpoint_dir, self.step = checkpoint_dir, step

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        return True

    def acquire(self, request: Any, slice_id: str) -> Any:
        job_id = slice_id.removeprefix("job-").rsplit("-", 1)[0]

        def release() -> None:  # orbax finalizes a step by renaming its directory
            (self.checkpoint_dir / job_id / str(self.step)).mkdir(parents=True, exist_ok=True)

        return HeldSlice(slice_id, _LostHost(), release,  # type: ignore[arg-type]
                         {"slice_names": [f"{slice_id}-slice"]})

    def cluster(self) -> list[Any]:
        return []


def test_a_failed_attempt_names_the_checkpoint_its_survivors_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXPOD_JOB_RETRY_BACKOFF_S", "0.01")
    checkpoint_dir = tmp_path / "checkpoints"
    slices = _LosesAHostAsASurvivorCommits(checkpoint_dir, 8)
    with JobStore(tmp_path / "state") as store:
        manager = JobManager(store, slices, checkpoint_dir=str(checkpoint_dir))
        manager.start()
        try:
            job = manager.submit(JobSpec(steps=16, step_fn=b"never unpickled",
                                         accelerator_type="v4-16", max_retries_preemption=1,
                                         max_retries_failure=0))
            assert wait_for(lambda: manager.status(job.id).state is JobState.FAILED, 30), \
                manager.status(job.id)
        finally:
            manager.close()
        first, second = store.attempts(job.id)
    # Read after the slice was given back, storage named the step the survivor
    # committed, and the next attempt resumed from it, as the failure said.
    assert first.cause is not None and first.cause.startswith("preempted: WorkerLostError")
    assert "the next attempt starts at step 8" in first.cause, first.cause
    assert second.start_step == 8, second
