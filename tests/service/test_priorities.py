"""Priorities on a real ``jaxpod serve --local`` holding one v4-16 (2 hosts).

* A low-priority job preempted mid-run by a higher one checkpoints at its next loop
  boundary, gives its slice up, waits again and resumes where it stopped: no step lost,
  no retry counted, its history naming who preempted it, and its final state bit for
  bit that of the same job run uninterrupted (and numpy's, within float tolerance).
* The queue orders by priority, then submission; equal priorities never preempt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import Service, processes_service
from sgd_jobs import batches, numpy_run, paced_step

import jaxpod
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess



def quick_step(state: Any, batch: Any) -> Any:
    ctx = jaxpod.get_replica_context()
    return {"n": state["n"] + ctx.all_reduce("SUM", batch.sum() * 0 + 1.0)}, {}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with processes_service(tmp_path_factory.mktemp("priorities"), "v4-16") as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected


def _low(client: Any, name: str, **extra: Any) -> Any:
    return client.submit(paced_step, steps=40, steps_per_run=2, checkpoint_every=2,
                         accelerator_type="v4-16", initial_state={"w": np.zeros(3, np.float32)},
                         dataset=batches(3), outputs={"loss": "MEAN"}, name=name, **extra)


def _preemptions(service: Service) -> dict[str, float]:
    text = httpx.get(f"{service.http_url}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {service.token}"}).text
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "jaxpod_job_preemptions" for s in family.samples
            if s.name.endswith("_total")}


def test_a_preempted_job_loses_no_step_and_ends_bit_identical(service: Service,
                                                               client: Any) -> None:
    before = _preemptions(service)
    reference = _low(client, "uninterrupted")
    assert reference.wait(timeout=300, progress=False).state == "SUCCEEDED"
    expected = reference.result().state["w"]
    np.testing.assert_allclose(expected, numpy_run(batches(3), 40)[0], rtol=1e-4, atol=1e-5)

    # No retries allowed: a priority preemption must not count as one.
    low = _low(client, "low", max_retries_preemption=0)
    assert wait_for(lambda: low.status().state == "RUNNING" and low.status().step >= 6,
                    120), low.status()
    high = client.submit(quick_step, steps=4, accelerator_type="v4-16", priority=5,
                         initial_state={"n": np.float32(0)}, dataset=[np.ones((8, 2))],
                         name="high")
    done = high.wait(timeout=300, progress=False)
    assert done.state == "SUCCEEDED" and float(high.result().state["n"]) == 4 * 8
    final = low.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED" and final.priority == 0 and done.priority == 5
    assert done.finished_at is not None and final.finished_at is not None
    assert done.finished_at < final.finished_at  # it ran while low waited

    np.testing.assert_array_equal(low.result().state["w"], expected)  # bit for bit
    history = low.history()
    preempted = [t for t in history if (t.from_state, t.to_state) == ("RUNNING", "PENDING")]
    assert len(preempted) == 1 and f"preempted by job {high.id}" in preempted[0].reason
    first, second = low.attempts()
    assert f"preempted by job {high.id}" in (first.cause or "")
    assert second.start_step == first.step_reached > 0  # resumed where it stopped
    after = _preemptions(service)
    assert after["priority"] - before["priority"] == 1
    assert after["slice"] == before["slice"]


def test_priority_then_submission_order_and_equal_priorities_never_preempt(
        client: Any) -> None:
    blocker = _low(client, "blocker", priority=10)
    assert wait_for(lambda: blocker.status().state == "RUNNING", 120), blocker.status()

    def queued(name: str, priority: int) -> Any:
        return client.submit(quick_step, steps=2, accelerator_type="v4-16",
                             priority=priority, initial_state={"n": np.float32(0)},
                             dataset=[np.ones((8, 2))], name=name)

    jobs = {name: queued(name, p) for name, p in
            [("a", 0), ("b", 1), ("equal", 10), ("c", 1), ("d", 0)]}
    expected = ["equal", "b", "c", "a", "d"]
    positions = {name: job.status().queue_position for name, job in jobs.items()}
    if blocker.status().state == "RUNNING":  # else some may have started already
        assert positions == {name: i for i, name in enumerate(expected)}, positions
    for job in jobs.values():
        assert job.wait(timeout=300, progress=False).state == "SUCCEEDED"
    assert blocker.wait(timeout=300, progress=False).state == "SUCCEEDED"
    assert len(blocker.attempts()) == 1  # "equal" waited: equal priorities never preempt
    started = sorted(jobs, key=lambda name: jobs[name].status().started_at)
    assert started == expected
    assert all(jobs[n].status().started_at > blocker.status().finished_at - 1e-6
               for n in expected)


def paced_count(state: Any, batch: Any) -> Any:
    """A stateless step (``state`` is ``None``): it only outputs its rows' sum (the
    job's SUM over replicas makes it the global batch's), held 30 ms on the host."""
    import jax

    def pause(v: Any) -> Any:
        time.sleep(0.03)
        return v

    wait = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
    return None, {"total": batch.sum() + wait}


def test_a_job_without_state_is_preempted_between_loops_and_resumes(client: Any) -> None:
    batches = [np.full((8, 1), float(i + 1), np.float32) for i in range(3)]
    low = client.submit(paced_count, steps=40, steps_per_run=2, accelerator_type="v4-16",
                        dataset=batches, outputs={"total": "SUM"}, name="stateless",
                        max_retries_preemption=0)
    assert wait_for(lambda: low.status().state == "RUNNING" and low.status().step >= 6,
                    120), low.status()
    high = client.submit(quick_step, steps=2, accelerator_type="v4-16", priority=5,
                         initial_state={"n": np.float32(0)}, dataset=[np.ones((8, 2))])
    assert high.wait(timeout=300, progress=False).state == "SUCCEEDED"
    final = low.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED" and final.step == 40
    first, second = low.attempts()
    assert f"preempted by job {high.id}" in (first.cause or "")
    assert second.start_step == first.step_reached > 0  # resumed, nothing redone
    # Its last output is that of step 40's batch, as an uninterrupted run's would be.
    assert float(low.result().outputs["total"]) == float(batches[39 % 3].sum())
