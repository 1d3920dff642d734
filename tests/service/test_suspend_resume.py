"""Suspend, resume and run-time limits on a real ``jaxpod serve --local`` with one v4-8.

* A suspended job checkpoints, frees its slice and waits ``SUSPENDED`` (another job
  runs meanwhile); resumed from the CLI (a fresh interpreter) it ends bit for bit equal
  to the same job run uninterrupted, each loop recorded once.
* Only a suspended job resumes; a finished one cannot be suspended (SDK and REST):
  each refusal says the job's state and what to do.
* A fork (CLI, SDK) from a kept checkpoint computes what its source computed from
  there, bit for bit; a branch with another step function runs numpy's steps.
* A job with ``max_runtime_s`` ends ``CANCELLED`` when its time is up, its last loop
  checkpointed: plain orbax reads that checkpoint back as numpy's state at its step.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from serve_process import Service, processes_service
from sgd_jobs import LR, batches, numpy_run, paced_step

import jaxpod
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS = 80
LOOP = 2


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with processes_service(tmp_path_factory.mktemp("suspend"), "v4-8") as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected


def _submit(client: Any, name: str, steps: int = STEPS, **extra: Any) -> Any:
    return client.submit(paced_step, steps=steps, steps_per_run=LOOP, checkpoint_every=LOOP,
                         accelerator_type="v4-8", initial_state={"w": np.zeros(3, np.float32)},
                         dataset=batches(7), outputs={"loss": "MEAN"}, name=name,
                         memory_checkpoint_every=0, **extra)


def _cli(service: Service, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", *args, "--address",
                           service.address], capture_output=True, text=True, timeout=120,
                          check=False, env={**_env(), "JAXPOD_TOKEN": service.token})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "JAXPOD_ADDRESS"}


def test_a_suspended_job_frees_its_slice_and_resumes_bit_identical(
        service: Service, client: Any) -> None:
    reference = _submit(client, "uninterrupted")
    assert reference.wait(timeout=300, progress=False).state == "SUCCEEDED"
    expected = reference.result().state["w"]
    np.testing.assert_allclose(expected, numpy_run(batches(7), STEPS)[0], rtol=1e-4,
                               atol=1e-5)

    job = _submit(client, "suspended")
    assert wait_for(lambda: job.status().state == "RUNNING" and job.status().step >= 10,
                    180, max_poll_s=0.1), job.status()
    assert job.suspend().state == "SUSPENDED"
    suspended = job.status()
    assert suspended.state == "SUSPENDED" and 0 < suspended.step < STEPS
    assert job.checkpoints()[-1].step == suspended.step  # checkpointed as it stopped

    # Its slice is free: another job runs to its end while it is suspended.
    other = _submit(client, "meanwhile", steps=4)
    assert other.wait(timeout=300, progress=False).state == "SUCCEEDED"
    assert job.status().state == "SUSPENDED" and job.status().step == suspended.step

    printed = _cli(service, "resume", job.id)
    assert printed.split(": ")[1].strip() in ("PENDING", "ALLOCATING", "RUNNING"), printed
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final
    result = job.result()
    np.testing.assert_array_equal(result.state["w"], expected)  # bit for bit
    loops = sorted(s for s, _ in result.metrics["loss"])
    assert loops == list(range(LOOP, STEPS + 1, LOOP))  # each loop once, none lost
    states = [t.to_state for t in job.history()]
    assert states.count("SUSPENDED") == 1 and states[-1] == "SUCCEEDED"
    assert (final.goodput or {}).get("suspended", 0) > 0, final.goodput


def test_only_a_suspended_job_resumes_and_a_finished_one_is_not_suspended(
        service: Service, client: Any) -> None:
    job = _submit(client, "short", steps=2)
    assert job.wait(timeout=300, progress=False).state == "SUCCEEDED"
    with pytest.raises(jaxpod.JaxpodError, match="is SUCCEEDED: it is over") as over:
        job.suspend()
    assert isinstance(over.value, ValueError)
    reply = httpx.post(f"{service.http_url}/api/v1/jobs/{job.id}/suspend", timeout=60,
                       headers={"Authorization": f"Bearer {service.token}"})
    assert reply.status_code == 409 and "is SUCCEEDED: it is over" in reply.text, reply.text
    with pytest.raises(jaxpod.JaxpodError, match="is SUCCEEDED, not SUSPENDED; only a "
                                                 "suspended job resumes"):
        job.resume()


def test_max_runtime_ends_the_job_with_a_checkpoint_of_its_last_loop(client: Any) -> None:
    job = _submit(client, "limited", steps=100_000, max_runtime_s=4.0)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "CANCELLED", final
    assert "max_runtime_s=4 reached" in (final.error or ""), final.error
    assert 0 < final.step < 100_000
    last = job.checkpoints()[-1]
    assert last.step == final.step
    read = subprocess.run(
        [sys.executable, "-c",
         "import sys, numpy as np, orbax.checkpoint as ocp\n"
         "state = ocp.StandardCheckpointer().restore(sys.argv[1])\n"
         "np.save(sys.stdout.buffer, np.asarray(state['w']))", last.path],
        capture_output=True, timeout=120, check=False, env=_env())
    assert read.returncode == 0, read.stderr.decode()
    import io

    stored = np.load(io.BytesIO(read.stdout))
    # a per-replica state is stored with its replica axis: every replica holds w
    w = stored.reshape(-1, 3)[0]
    np.testing.assert_allclose(w, numpy_run(batches(7), final.step)[0], rtol=1e-4,
                               atol=1e-5)


def half_lr_step(state: Any, batch: Any) -> Any:
    """paced_step with half the learning rate: a fork's branch."""
    new, outputs = paced_step(state, batch)
    return {"w": (state["w"] + new["w"]) / 2}, outputs


def test_a_fork_continues_bit_for_bit_and_a_branch_runs_its_own_step(
        service: Service, client: Any) -> None:
    source = client.submit(paced_step, steps=40, steps_per_run=LOOP, checkpoint_every=10,
                           accelerator_type="v4-8",
                           initial_state={"w": np.zeros(3, np.float32)}, dataset=batches(7),
                           outputs={"loss": "MEAN"}, name="source", memory_checkpoint_every=0)
    assert source.wait(timeout=300, progress=False).state == "SUCCEEDED"
    kept = [c.step for c in source.checkpoints()]
    assert kept[-1] == 40 and 30 in kept, kept
    with pytest.raises(ValueError, match="keeps no checkpoint of step 5; it keeps "
                                         + ", ".join(map(str, kept))):
        client.fork(source.id, step=5)

    # The same spec from step 30, through the CLI: the source's state at 40, bit for bit.
    fork_id = _cli(service, "fork", source.id, "--step", "30").strip()
    fork = client.job(fork_id)
    assert fork.wait(timeout=300, progress=False).state == "SUCCEEDED"
    np.testing.assert_array_equal(fork.result().state["w"], source.result().state["w"])
    loops = sorted(s for s, _ in fork.result().metrics["loss"])
    assert loops == list(range(32, 41, LOOP))  # only its own steps, from 30 on

    # A branch with half the learning rate from 30: numpy's run of the same steps.
    branch = client.fork(source.id, step=30, steps=36, step_fn=half_lr_step, name="half")
    assert branch.wait(timeout=300, progress=False).state == "SUCCEEDED"
    assert branch.status().name == "half"
    data = batches(7)
    w = numpy_run(data, 30)[0]
    for step in range(30, 36):
        b = data[step % len(data)]
        err = b["x"] @ w - b["y"]
        w = w - (LR / 2) * (b["x"].T @ err) / np.float32(len(err))
    np.testing.assert_allclose(branch.result().state["w"], w, rtol=1e-4, atol=1e-5)
    assert [c.step for c in source.checkpoints()] == kept  # the source untouched


def test_a_fork_of_a_running_job_keeps_its_step_past_the_sources_clean_up(
        client: Any) -> None:
    steps = 200  # >= 6 s: the fork is made while the source has saves to go
    source = client.submit(paced_step, steps=steps, steps_per_run=LOOP, checkpoint_every=20,
                           accelerator_type="v4-8", initial_state={"w": np.zeros(3, np.float32)},
                           dataset=batches(7), outputs={"loss": "MEAN"}, name="running-source",
                           memory_checkpoint_every=0)  # 2 checkpoints kept
    forks: list[tuple[int, Any]] = []

    def fork_the_newest() -> bool:
        kept = [c.step for c in source.checkpoints()]
        try:  # the newest of the 2 kept: the save after next would delete it
            forks.append((kept[-1], client.fork(source.id, step=kept[-1])))
        except (IndexError, ValueError):  # too soon, or a newer save committed meanwhile
            return False
        return True

    # The older of the two is refused: it may be deleted already (the list lags).
    assert wait_for(lambda: len(source.checkpoints()) == 2, 120), source.status()
    with pytest.raises(ValueError, match=r"its hosts delete all but its newest 2 checkpoint"
                                         r"|keeps no checkpoint of step"):
        client.fork(source.id, step=source.checkpoints()[0].step)
    assert wait_for(fork_the_newest, 120), source.status()
    (step, fork), = forks
    # The fork waits for the one slice while the source saves on, deleting old steps.
    assert source.wait(timeout=300, progress=False).state == "SUCCEEDED"
    kept = [c.step for c in source.checkpoints()]
    assert kept == [step, steps - 20, steps] and step < steps - 20, kept  # pinned
    assert fork.wait(timeout=300, progress=False).state == "SUCCEEDED", fork.status().error
    np.testing.assert_array_equal(fork.result().state["w"], source.result().state["w"])
    np.testing.assert_allclose(fork.result().state["w"], numpy_run(batches(7), steps)[0],
                               rtol=1e-5, atol=1e-6)
