"""Elastic jobs on a real ``jaxpod serve --local`` holding one v4-16 (2 hosts x 4 chips)
and one v4-8 (1 host x 4 chips).

A job submitted for ``("v4-16", "v4-8")`` starts on the v4-16; a job of higher priority
for the v4-16 has it checkpoint and move to the v4-8 instead of waiting; a SIGKILL of
its host there, with the v4-16 still taken, resumes it on the v4-8; once the v4-16 is
free it moves back up. Through all of it the global batch stays the same (16 rows over
8 replicas, then over 4), every step's metric is recorded once, and the final state is
numpy's SGD on the same batches. A global-view job (``mesh={"data": -1}``) that grows
back from the v4-8 to the v4-16 has its axis re-derived (4, then 8 devices) and its state
restored onto the new shardings. Goodput books each move's cost as ``resizing``.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_process import Service, processes_service
from sgd_jobs import LR, batches, numpy_run

import jaxpod
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS = 200
GATE_LIMIT_S = 240.0  # the high job's step never waits longer for the test's gate


def paced_step(state: Any, batch: Any) -> Any:
    """One SGD step of y ~ x @ w over the whole global batch (sums over every replica,
    so any replica count computes the same update), taking >= 20 ms on the host."""
    import jax

    ctx = jaxpod.get_replica_context()
    x, y = batch["x"], batch["y"]
    mask = ctx.valid_row_mask.astype(x.dtype)
    err = (x @ state["w"] - y) * mask
    grad = ctx.all_reduce("SUM", x.T @ err) / ctx.all_reduce("SUM", mask.sum())

    def pause(v: Any) -> Any:
        time.sleep(0.02)
        return v

    wait = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
    return {"w": state["w"] - LR * grad + wait}, {"loss": (err ** 2).sum()}


def gated_step(gate: str) -> Any:
    """A step that holds its slice until the file ``gate`` exists."""
    def step(state: Any, batch: Any) -> Any:
        import jax

        def hold(v: Any) -> Any:
            deadline = time.monotonic() + GATE_LIMIT_S
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
            return v

        wait = jax.pure_callback(hold, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
        return {"n": state["n"] + 1.0 + wait + batch.sum() * 0}, {}
    return step


TABLE = (8, 4)  # a global-view state leaf split over the "data" axis


def mesh_init() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    return {"w": jnp.zeros((3,), jnp.float32),
            "table": jax.lax.with_sharding_constraint(jnp.ones(TABLE, jnp.float32),
                                                      P("data", None))}


def mesh_step(state: Any, batch: Any) -> Any:
    """SGD on the global batch as one ``jax.jit`` program over the mesh; ``table``
    accumulates every step's input (a step run twice or skipped changes it)."""
    import jax
    import jax.numpy as jnp

    # Traced once per attempt: the log shows the mesh and the shard each chip holds.
    print(f"mesh {dict(jaxpod.mesh().shape)}")
    jax.debug.inspect_array_sharding(state["table"], callback=lambda s: print(
        f"table shard {tuple(s.shard_shape(TABLE))}"))
    x, y = batch["x"], batch["y"]
    err = x @ state["w"] - y

    def pause(v: Any) -> Any:
        time.sleep(0.02)
        return v

    err = jax.pure_callback(pause, jax.ShapeDtypeStruct(err.shape, err.dtype), err)
    return {"w": state["w"] - LR * (x.T @ err) / err.shape[0],
            "table": state["table"] + 0.01 * jnp.sum(x)}, {"loss": jnp.sum(err ** 2)}


def numpy_table(data: list[dict[str, np.ndarray]], steps: int) -> np.ndarray:
    table = np.ones(TABLE)
    for step in range(steps):
        table = table + 0.01 * float(data[step % len(data)]["x"].astype(np.float64).sum())
    return table


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with processes_service(tmp_path_factory.mktemp("elastic"), "v4-16,v4-8") as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected


def _hold_the_v4_16(client: Any, gate: Path) -> Any:
    """A running job on the v4-16 that holds it until ``gate`` exists."""
    holder = client.submit(gated_step(str(gate)), steps=2, accelerator_type="v4-16",
                           initial_state={"n": np.float32(0)},
                           dataset=[np.ones((8, 2), np.float32)], name="holder")
    assert wait_for(lambda: holder.status().state == "RUNNING", 180), holder.status()
    return holder


def _on(job: Any, kind: str, past: int = 0) -> bool:
    status = job.status()
    return status.state == "RUNNING" and status.accelerator_type == kind and status.step > past


def test_an_elastic_job_moves_down_survives_a_kill_there_and_moves_back_up(
        client: Any, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    job = client.submit(paced_step, steps=STEPS, steps_per_run=1, checkpoint_every=2,
                        accelerator_type=("v4-16", "v4-8"),
                        initial_state={"w": np.zeros(3, np.float32)}, dataset=batches(5),
                        outputs={"loss": "SUM"}, name="elastic")
    assert wait_for(lambda: _on(job, "v4-16", 4), 180), job.status()

    high = client.submit(gated_step(str(gate)), steps=4, accelerator_type="v4-16",
                         priority=5, initial_state={"n": np.float32(0)},
                         dataset=[np.ones((8, 2), np.float32)], name="high")
    # It does not wait for the v4-16: it goes on on the v4-8 while the high job holds it.
    assert wait_for(lambda: high.status().state == "RUNNING", 180), high.status()
    moved = job.attempts()[0].step_reached or 0
    assert wait_for(lambda: _on(job, "v4-8", moved + 4), 180), job.status()
    assert high.status().state == "RUNNING" and not gate.exists()

    # A host lost there, with the v4-16 still taken: it resumes on the v4-8.
    (victim,) = [h.pid for h in job.hosts()]
    os.kill(victim, signal.SIGKILL)
    assert wait_for(lambda: len(job.attempts()) >= 3 and job.attempts()[-1].running_at
                    is not None and _on(job, "v4-8", job.attempts()[-1].start_step or 0),
                    180), job.attempts()
    assert [h.pid for h in job.hosts()] != [victim]

    gate.touch()  # the high job ends, and the elastic job moves back up
    assert high.wait(timeout=120, progress=False).state == "SUCCEEDED"
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert final.accelerator_type == "v4-16"

    attempts = job.attempts()
    assert [a.accelerator_type for a in attempts] == ["v4-16", "v4-8", "v4-8", "v4-16"], attempts
    assert "preempted by job" in (attempts[0].cause or ""), attempts[0]
    assert "WorkerLostError" in (attempts[1].cause or ""), attempts[1]  # the SIGKILL
    assert "v4-16 slice is free" in (attempts[2].cause or ""), attempts[2]
    for before, after in itertools.pairwise(attempts):
        assert after.start_step is not None and after.start_step <= (before.step_reached or 0)

    assert (final.goodput or {}).get("resizing", 0) > 0, final.goodput  # three moves
    result = job.result(timeout=60)
    w, losses = numpy_run(batches(5), STEPS)
    np.testing.assert_allclose(result.state["w"], w, rtol=1e-5, atol=1e-5)
    steps = [step for step, _ in result.metrics["loss"]]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps  # each step once, none lost
    # Each recorded loss is numpy's for its step, whichever slice type ran it.
    got = [v for _, v in sorted(result.metrics["loss"])]
    np.testing.assert_allclose(got, losses, rtol=1e-4, atol=1e-5)


def test_a_job_that_does_not_grow_back_stays_where_it_started(client: Any,
                                                              tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    holder = _hold_the_v4_16(client, gate)
    # The v4-16 is taken: it starts on the v4-8 at once rather than wait for it.
    job = client.submit(paced_step, steps=120, steps_per_run=1, checkpoint_every=10,
                        accelerator_type=("v4-16", "v4-8"), grow_back=False,
                        initial_state={"w": np.zeros(3, np.float32)}, dataset=batches(5),
                        outputs={"loss": "SUM"}, name="stays")
    assert wait_for(lambda: _on(job, "v4-8", 2), 180), job.status()
    gate.touch()
    assert holder.wait(timeout=120, progress=False).state == "SUCCEEDED"
    ran_on_after = job.status().step  # the v4-16 is free from here on
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert final.step - ran_on_after >= 20, (ran_on_after, final.step)  # it had time to move
    assert [a.accelerator_type for a in job.attempts()] == ["v4-8"], job.attempts()
    assert (final.goodput or {}).get("resizing") == 0, final.goodput  # it never moved
    np.testing.assert_allclose(job.result(timeout=60).state["w"], numpy_run(batches(5), 120)[0],
                               rtol=1e-5, atol=1e-5)


def test_a_global_view_job_grows_back_onto_the_new_shardings(client: Any,
                                                             tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    holder = _hold_the_v4_16(client, gate)
    steps = 150
    job = client.submit(mesh_step, steps=steps, steps_per_run=1, checkpoint_every=5,
                        accelerator_type=("v4-16", "v4-8"), mesh={"data": -1},
                        init_fn=mesh_init, dataset=batches(6), outputs={"loss": "SUM"},
                        name="mesh")
    assert wait_for(lambda: _on(job, "v4-8", 2), 180), job.status()
    gate.touch()  # the v4-16 frees: the job moves up at its next checkpoint
    assert holder.wait(timeout=120, progress=False).state == "SUCCEEDED"
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert [a.accelerator_type for a in job.attempts()] == ["v4-8", "v4-16"], job.attempts()
    assert (final.goodput or {}).get("resizing", 0) > 0, final.goodput

    # The "data" axis took the 4 devices of the v4-8, then the 8 of the v4-16.
    logs = job.logs()
    for host, sizes, shard in ((0, 4, (2, 4)), (0, 8, (1, 4)), (1, 8, (1, 4))):
        assert re.search(rf"^\[host {host}\] mesh \{{'data': {sizes}\}}$", logs,
                         re.MULTILINE), logs
        assert f"[host {host}] table shard {shard}" in logs, logs

    result = job.result(timeout=60)
    w, losses = numpy_run(batches(6), steps)
    np.testing.assert_allclose(result.state["w"], w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.state["table"], numpy_table(batches(6), steps),
                               rtol=1e-5)
    recorded = sorted(result.metrics["loss"])
    assert [step for step, _ in recorded] == list(range(1, steps + 1)), recorded
    np.testing.assert_allclose([v for _, v in recorded], losses, rtol=1e-4, atol=1e-5)
