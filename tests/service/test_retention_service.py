"""Retention in a real ``jaxpod serve --retain-jobs 1``: the newest finished job and
pinned ones stay whole; older ones are pruned to a summary and their checkpoint folders
deleted. Pinning through the SDK, the CLI (a fresh interpreter) and the HTTP API."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from serve_process import PROCESSES, Service, start_service, stop_service
from test_jobs import initial_lr_state, linear_regression_step, lr_batches, numpy_lr, stream_steps

from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS, STEPS_PER_RUN = 6, 2
LOG_BYTES = 600  # --log-file's size limit: a few records a file


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("retention")


@pytest.fixture(scope="module")
def service(root: Path) -> Iterator[Service]:
    running = start_service(root / "serve.log", "v4-8",
                            args=(*PROCESSES, "--state-dir", str(root / "state"),
                                  "--retain-jobs", "1", "--log-file",
                                  str(root / "service.log")),
                            env={"JAXPOD_RETENTION_EVERY_S": "0.5",
                                 "JAXPOD_SERVICE_LOG_MAX_BYTES": str(LOG_BYTES),
                                 "JAXPOD_SERVICE_LOG_BACKUPS": "2"})
    try:
        yield running
    finally:
        stop_service(running)


def chatty_step(seed: int) -> Any:
    """The step, saying when it is traced (a line in the job's logs): a function of its
    own per job, as warm workers trace each new function once."""
    def step(state: Any, batch: Any) -> Any:
        print(f"tracing the step of seed {seed}")
        return linear_regression_step(state, batch)
    return step


def run(client: Any, seed: int) -> tuple[Any, float]:
    """A short job to its end; returns it and its last loss as numpy computes it."""
    batches = lr_batches([8, 8], seed=seed)
    job = client.submit(chatty_step(seed), steps=STEPS, accelerator_type="v4-8",
                        initial_state=initial_lr_state(), dataset=batches,
                        steps_per_run=STEPS_PER_RUN, checkpoint_every=STEPS_PER_RUN,
                        outputs={"loss": "MEAN"})
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    _, losses = numpy_lr(stream_steps(batches, STEPS), STEPS, STEPS_PER_RUN)
    return job, losses[max(losses)]


def cli(service: Service, *args: str) -> str:
    env = {**os.environ, "JAXPOD_TOKEN": service.token, "JAXPOD_ADDRESS": service.address}
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_old_jobs_keep_a_summary_and_pinned_ones_stay_whole(service: Service,
                                                           root: Path) -> None:
    folders = root / "state" / "checkpoints"
    api = httpx.Client(base_url=service.http_url, timeout=30,
                       headers={"Authorization": f"Bearer {service.token}"})
    with service.connect() as client, api:
        pinned, _ = run(client, seed=1)
        assert "tracing the step of seed 1" in pinned.logs()
        assert cli(service, "pin", pinned.id).strip() == f"{pinned.id}: pinned"
        pruned, pruned_loss = run(client, seed=2)
        newest, _ = run(client, seed=3)
        assert wait_for(lambda: pruned.status().pruned_at is not None, 60), pruned.status()
        status = pruned.status()
        # what it was and how it ended stay; its last loss is the one numpy computes
        assert status.state == "SUCCEEDED" and status.step == STEPS and not status.pinned
        np.testing.assert_allclose(status.metrics["loss"], pruned_loss, rtol=1e-4)
        assert [t.to_state for t in pruned.history()] == ["PENDING", "SUCCEEDED"]
        assert pruned.logs() == "" and not (folders / pruned.id).exists()
        with pytest.raises(ValueError, match="pruned by retention"):
            pruned.result()
        with pytest.raises(ValueError, match="nothing left to pin"):
            pruned.pin()
        assert "a summary since" in cli(service, "job", pruned.id)
        # the pinned job and the newest stay whole
        for job in (pinned, newest):
            assert job.status().pruned_at is None and (folders / job.id).exists()
            assert job.result().steps == STEPS and "tracing the step" in job.logs()
        assert pinned.status().pinned
        # unpinned over HTTP, the older of the two whole ones is pruned too
        answer = api.delete(f"/api/v1/jobs/{pinned.id}/pin")
        assert answer.status_code == 200 and answer.json()["pinned"] is False, answer.text
        assert wait_for(lambda: pinned.status().pruned_at is not None, 60)
        assert not (folders / pinned.id).exists()
        assert newest.status().pruned_at is None
        assert api.post(f"/api/v1/jobs/{newest.id}/pin").json()["pinned"] is True
        audit = {(r.action, r.target) for r in client.audit()}
        assert {("pin", pinned.id), ("unpin", pinned.id), ("pin", newest.id)} <= audit


def test_the_log_file_rotates_by_size(service: Service, root: Path) -> None:
    with service.connect() as client:
        run(client, seed=4)  # the service logs as it runs the job
    files = sorted(p.name for p in root.glob("service.log*"))
    # the current file and the 2 backups kept; the oldest dropped
    assert files == ["service.log", "service.log.1", "service.log.2"], files
    for name in files:
        text = (root / name).read_text()
        assert " INFO: " in text
        # a file grows past the limit by at most the record that crossed it
        assert len(text.encode()) <= LOG_BYTES + max(map(len, text.splitlines())) + 1
    assert "jaxpod serve: ready on" not in (root / "service.log").read_text()
