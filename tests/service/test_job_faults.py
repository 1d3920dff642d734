"""Jobs through lost hosts and preemption notices: a real ``jaxpod serve --local``.

A host worker of a running job is killed with SIGKILL (a lost host) or sent SIGTERM (a
preemption notice) by its pid, which the job's own code prints on each host. The job
must end with exactly the numbers of the same job run without interruption (compared
with ``np.array_equal``), with its attempts and lost steps recorded; exceptions in the
job's code are failures with their own budget, never retried as preemptions.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_process import Service, crash_service, start_service, stop_service

import jaxpod
from jaxpod.service.local_cluster import LocalTPUCluster
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEP_PAUSE_S = 0.01
STEPS = 48
STEPS_PER_RUN = 2
CHECKPOINT_EVERY = 8


# ------------------------------------------------------------------ the job
def print_pid() -> None:
    print(f"pid {os.getpid()}")


def pid_printing_step(state: Any, batch: Any) -> Any:
    """A deterministic, slightly slow update; every step prints its host's pid (so
    even a warm slice's workers, which trace nothing again, say who they are)."""
    import jax
    import jax.numpy as jnp

    jax.debug.callback(print_pid)

    def pause(x: Any) -> Any:
        time.sleep(STEP_PAUSE_S)
        return x

    ctx = jaxpod.get_replica_context()
    mask = ctx.valid_row_mask.astype(batch.dtype)
    total = ctx.all_reduce("SUM", (batch * mask).sum())
    w = state["w"] * 0.97 + jnp.sin(total + state["w"]) * 0.05
    w = jax.pure_callback(pause, jax.ShapeDtypeStruct(w.shape, w.dtype), w)
    return {"w": w, "n": state["n"] + 1}, {"total": total, "w0": w[0]}


class StepError(Exception):
    """Raised by the job's code on the workers."""


def raising_step(state: Any, batch: Any) -> Any:
    raise StepError("bad batch")


def dataset() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(size=n).astype(np.float32) for n in (12, 12, 7)]  # 8 replicas: padding


def submit(client: Any, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        steps=STEPS, accelerator_type="v4-16", steps_per_run=STEPS_PER_RUN,
        initial_state={"w": np.linspace(0, 1, 5).astype(np.float32), "n": np.int32(0)},
        dataset=dataset(), outputs={"total": "MAX", "w0": "MEAN"},
        checkpoint_every=CHECKPOINT_EVERY, max_retries_preemption=3)
    kwargs.update(overrides)
    return client.submit(pid_printing_step, **kwargs)


def host_pids(job: Any, host: int) -> list[int]:
    """The pids the job's code printed on ``host``, in order (one per attempt's trace)."""
    pids = [int(m.group(1)) for m in re.finditer(rf"^\[host {host}\] pid (\d+)$", job.logs(),
                                                  re.MULTILINE)]
    return list(dict.fromkeys(pids))


def running_past(job: Any, step: int) -> bool:
    status = job.status()
    assert not status.done, status
    return status.state == "RUNNING" and status.step >= step


def assert_goodput_adds_up(status: Any) -> dict[str, float]:
    """The categories partition the job's wall time (within 1 %); returns them."""
    figures = dict(status.goodput)
    wall, share = figures.pop("wall_s"), figures.pop("productive_share")
    assert all(v >= 0 for v in figures.values()), figures
    assert sum(figures.values()) == pytest.approx(wall)
    assert wall == pytest.approx(status.finished_at - status.created_at, rel=0.01)
    assert share == pytest.approx(figures["productive"] / wall)
    return figures


def assert_same_result(got: Any, expected: Any) -> None:
    for key in ("w", "n"):
        assert got.state[key].dtype == expected.state[key].dtype
        assert np.array_equal(got.state[key], expected.state[key]), key
    assert got.metrics == expected.metrics  # every loop's reduced outputs, redone or not
    assert got.steps == expected.steps == STEPS


# ------------------------------------------------------------------ the service
# The simulated cluster outlives the service, as a real Ray cluster outlives a crashed
# coordinator: the last test kills the service and starts another on its state dir.
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalTPUCluster]:
    with LocalTPUCluster("v4-16") as running:
        yield running


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("job-faults-state")


def _start(cluster: LocalTPUCluster, state_dir: Path, log: Path) -> Service:
    return start_service(log, None, args=("--state-dir", str(state_dir)),
                         env={"JAXPOD_JOB_RETRY_BACKOFF_S": "0.2"},
                         ray_address=cluster.address)


@pytest.fixture(scope="module")
def service(cluster: LocalTPUCluster, state_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    running = _start(cluster, state_dir, tmp_path_factory.mktemp("job-faults") / "serve.log")
    try:
        yield running
    finally:
        if running.process.poll() is None:  # the last test kills it
            stop_service(running)


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    c = service.connect()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def uninterrupted(client: Any) -> Any:
    job = submit(client)
    result = job.result(timeout=300)
    status = job.status()
    assert status.attempts == 1
    figures = assert_goodput_adds_up(status)
    assert figures["productive"] > 0 and figures["lost_work"] == 0
    assert figures["recovering"] == 0
    return result


# ------------------------------------------------------------------ tests
def test_a_killed_host_is_a_preemption_and_the_job_resumes_bit_for_bit(
        client: Any, uninterrupted: Any) -> None:
    job = submit(client)
    assert wait_for(lambda: running_past(job, CHECKPOINT_EVERY + 4), 300), job.status()
    victim = host_pids(job, 1)[-1]
    os.kill(victim, signal.SIGKILL)
    # Seen at once, though host 0 waits in a collective for the dead host 1 (until the
    # collective's own time-out, minutes): the attempt ends well before that.
    assert wait_for(lambda: job.attempts()[0].ended_at is not None, 60), job.attempts()
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert_same_result(job.result(), uninterrupted)
    assert [t.to_state for t in job.history()].count("RETRYING") == 1
    first, second = job.attempts()
    assert first.cause is not None and first.cause.startswith("preempted:")
    lost = re.search(r"(\d+) step\(s\) lost, the next attempt starts at step (\d+)",
                     first.cause)
    assert lost, first.cause
    resumed_at = int(lost.group(2))
    assert resumed_at % CHECKPOINT_EVERY == 0 and 0 < resumed_at <= first.step_reached
    assert int(lost.group(1)) == first.step_reached - resumed_at
    assert second.cause == "succeeded" and second.step_reached == STEPS
    assert host_pids(job, 1)[-1] != victim  # the second attempt ran on new workers
    figures = assert_goodput_adds_up(final)
    assert figures["lost_work"] > 0 and figures["recovering"] > 0
    assert figures["allocating"] > 0 and figures["productive"] > 0


def test_a_preemption_notice_checkpoints_at_once_and_loses_no_step(
        client: Any, uninterrupted: Any) -> None:
    job = submit(client, checkpoint_every=None)  # no periodic checkpoints at all
    assert wait_for(lambda: running_past(job, 6), 300), job.status()
    os.kill(host_pids(job, 0)[-1], signal.SIGTERM)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert_same_result(job.result(), uninterrupted)
    first, _ = job.attempts()
    assert first.cause is not None and "preemption notice" in first.cause
    assert "0 step(s) lost" in first.cause
    assert f"starts at step {first.step_reached}" in first.cause


def test_a_raising_step_is_a_failure_with_its_own_budget(client: Any) -> None:
    job = client.submit(raising_step, steps=4, accelerator_type="v4-16",
                        dataset=dataset(), max_retries_failure=1, max_retries_preemption=5)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "FAILED" and "StepError: bad batch" in final.error
    attempts = job.attempts()
    assert len(attempts) == 2  # max_retries_failure + 1, never as a preemption
    assert all(a.cause is not None and a.cause.startswith("failed: StepError")
               for a in attempts)


def test_more_preemptions_than_the_budget_fail_the_job(client: Any) -> None:
    job = submit(client, max_retries_preemption=1, checkpoint_every=None)
    killed: list[int] = []
    for _ in range(2):
        assert wait_for(lambda: running_past(job, 4)
                        and host_pids(job, 1)[-1] not in killed, 300), job.status()
        killed.append(host_pids(job, 1)[-1])
        os.kill(killed[-1], signal.SIGKILL)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "FAILED"
    assert "preempted 2 times, more than max_retries_preemption=1" in final.error
    assert len(job.attempts()) == 2
    with pytest.raises(jaxpod.JobFailedError, match="max_retries_preemption"):
        job.result()


def test_a_killed_coordinator_restarted_on_its_state_dir_resumes_the_job(
        client: Any, service: Service, cluster: LocalTPUCluster, state_dir: Path,
        uninterrupted: Any, tmp_path: Path) -> None:
    job = submit(client)
    assert wait_for(lambda: running_past(job, CHECKPOINT_EVERY + 4), 300), job.status()
    first_pids = {host_pids(job, h)[-1] for h in range(2)}
    crash_service(service)  # SIGKILL: no checkpoint on the way out, no release
    again = _start(cluster, state_dir, tmp_path / "restarted.log")
    try:
        with again.connect() as second:
            resumed = second.job(job.id)
            final = resumed.wait(timeout=300, progress=False)
            assert final.state == "SUCCEEDED", final.error
            assert_same_result(resumed.result(), uninterrupted)
            history = resumed.history()
            restart = [t for t in history if t.reason == "coordinator restarted"]
            assert [(t.from_state, t.to_state) for t in restart] == [("RUNNING", "RETRYING")]
            resumed_at = [t.reason for t in history if t.to_state == "RUNNING"][-1]
            assert re.fullmatch(r"resuming from the checkpoint at step \d+", resumed_at)
            first, second_attempt = resumed.attempts()
            assert first.cause == "coordinator restarted"
            assert second_attempt.cause == "succeeded"
            assert_goodput_adds_up(final)
            # Nothing of the dead coordinator is left: its workers are gone, and the
            # cluster's only v4-16 was allocated again (a leaked placement group
            # would have kept the job waiting for a free slice).
            assert not {host_pids(resumed, h)[-1] for h in range(2)} & first_pids
            assert wait_for(lambda: not any(_alive(p) for p in first_pids), 60)
    finally:
        stop_service(again)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
