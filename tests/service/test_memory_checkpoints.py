"""In-memory checkpoints of a job on a real ``jaxpod serve --local`` holding one v4-16
(2 hosts x 4 chips, worker processes).

A job with ``memory_checkpoint_every=2`` and no persistent checkpoint before its end
loses a host to SIGKILL: its next attempt resumes from the hosts' memory, at most 2
steps back, reading no storage. With the lost host's node also replaced (its memory
folder gone), the peer's copy of its shards is sent back. A preemption notice (SIGTERM)
saves both tiers at once: the next attempt loses nothing and restores from memory.
Each run ends with numpy's SGD on the same batches, every step's metric recorded once.
A job that ends cancelled or failed takes its copies out of the nodes' memory (RAM).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_process import Service, processes_service
from sgd_jobs import batches, numpy_run
from test_elastic_jobs import paced_step

from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS = 80


@pytest.fixture(scope="module")
def memory_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("memory")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, memory_dir: Path) -> Iterator[Service]:
    env = {"JAXPOD_MEMORY_CHECKPOINT_DIR": str(memory_dir)}
    with processes_service(tmp_path_factory.mktemp("memory-jobs"), "v4-16", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _kill_host_1(client: Any, memory_dir: Path, replace_node: bool,
                 sig: signal.Signals = signal.SIGKILL) -> Any:
    """A job running from its in-memory checkpoints, its host 1 sent ``sig`` mid-run
    (and its node's memory removed, if ``replace_node``); the job, once it ended."""
    job = client.submit(paced_step, steps=STEPS, steps_per_run=1, checkpoint_every=STEPS,
                        memory_checkpoint_every=2, accelerator_type="v4-16",
                        initial_state={"w": np.zeros(3, np.float32)}, dataset=batches(3),
                        outputs={"loss": "SUM"}, name="memory")
    assert wait_for(lambda: job.status().step >= 25 and len(job.hosts()) == 2, 180), \
        job.status()
    victim = job.hosts()[1].pid
    os.kill(victim, sig)
    if replace_node:  # its memory goes with it: only the peer's copy is left
        assert wait_for(lambda: _gone(victim), 30)
        (node,) = memory_dir.glob("*-1")
        shutil.rmtree(node / job.id)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    return job


def _check(job: Any) -> tuple[Any, Any]:
    first, second = attempts = job.attempts()
    assert len(attempts) == 2, attempts
    reached, start = first.step_reached or 0, second.start_step or 0
    assert 0 <= reached - start <= 2, attempts  # at most memory_checkpoint_every lost
    result = job.result(timeout=60)
    w, losses = numpy_run(batches(3), STEPS)
    np.testing.assert_allclose(result.state["w"], w, rtol=1e-5, atol=1e-5)
    recorded = sorted(result.metrics["loss"])
    assert [step for step, _ in recorded] == list(range(1, STEPS + 1)), recorded
    np.testing.assert_allclose([v for _, v in recorded], losses, rtol=1e-4, atol=1e-5)
    return first, second


def test_a_lost_host_resumes_from_memory_losing_at_most_two_steps(
        client: Any, memory_dir: Path) -> None:
    job = _kill_host_1(client, memory_dir, replace_node=False)
    _, second = _check(job)
    history = [entry.reason for entry in job.history()]
    # From each node's own copy; or, when the kill came as host 1 wrote its own copy of
    # that step, its shards from host 0's copy of them (a busy machine makes that race).
    assert any(f"in-memory checkpoint at step {second.start_step} (every host's shards on "
               "its own node)" in m or f"in-memory checkpoint at step {second.start_step} "
               "(1 host(s)' shards from their peer's copy)" in m for m in history), history
    assert not list(memory_dir.glob(f"*/{job.id}")), "a finished job's memory stays"


def test_a_replaced_node_gets_its_shards_back_from_its_peer(client: Any,
                                                            memory_dir: Path) -> None:
    job = _kill_host_1(client, memory_dir, replace_node=True)
    _, second = _check(job)
    history = [entry.reason for entry in job.history()]
    assert any(f"in-memory checkpoint at step {second.start_step} (1 host(s)' shards from "
               "their peer's copy)" in m for m in history), history


def test_a_preemption_notice_saves_both_tiers_and_loses_nothing(client: Any,
                                                              memory_dir: Path) -> None:
    job = _kill_host_1(client, memory_dir, replace_node=False, sig=signal.SIGTERM)
    first, second = _check(job)
    assert "preemption notice" in (first.cause or ""), first
    assert second.start_step == first.step_reached, (first, second)  # nothing lost
    # The persistent checkpoint of that step is there too; memory is read first.
    assert second.start_step in [c.step for c in job.checkpoints()], job.checkpoints()
    history = [entry.reason for entry in job.history()]
    assert any(f"in-memory checkpoint at step {second.start_step} " in m for m in history), \
        history


def failing_once(marker: str) -> Any:
    """:func:`paced_step` that raises on the hosts once the file ``marker`` exists."""

    def step(state: Any, batch: Any) -> Any:
        import os

        import jax

        def check(v: Any) -> Any:
            if os.path.exists(marker):
                raise RuntimeError("the step failed, as the test asked")
            return v

        new, outputs = paced_step(state, batch)
        w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), np.float32), new["w"])
        return {"w": w}, outputs

    return step


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_job_that_ends_leaves_nothing_in_the_nodes_memory(
        client: Any, memory_dir: Path, tmp_path: Path, ending: str) -> None:
    marker = tmp_path / "fail"
    job = client.submit(failing_once(str(marker)), steps=10**6, steps_per_run=1,
                        memory_checkpoint_every=2, max_retries_failure=0,
                        accelerator_type="v4-16", initial_state={"w": np.zeros(3, np.float32)},
                        dataset=batches(3), name=ending)

    def nodes_holding() -> set[Path]:
        return {p.parent.parent for p in memory_dir.glob(f"*/{job.id}/step-*")}

    assert wait_for(lambda: len(nodes_holding()) == 2, 180), job.status()
    if ending == "cancelled":
        job.cancel()
    else:
        marker.touch()
    assert job.wait(timeout=120, progress=False).state == ending.upper()
    assert not list(memory_dir.glob(f"*/{job.id}"))  # both nodes' copies gone
