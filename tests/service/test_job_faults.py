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
from typing import Any

import numpy as np
import pytest
from serve_process import Service, start_service, stop_service

import jaxpod
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
@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("job-faults")
    running = start_service(root / "serve.log", "v4-16",
                            args=("--state-dir", str(root / "state")),
                            env={"JAXPOD_JOB_RETRY_BACKOFF_S": "0.2"})
    try:
        yield running
    finally:
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
