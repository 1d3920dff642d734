"""A job on two slices at once (``num_slices=2``): one replica group over both, as a
multislice TPU job. A real ``jaxpod serve --local`` holding two v4-8 slices; the result
is checked against numpy, and the HTTP API shows the job holding both slices and
reading both hosts' input feeds while it runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from serve_process import PROCESSES, Service, start_service, stop_service
from test_jobs import (
    _assert_lr_result,
    initial_lr_state,
    linear_regression_step,
    lr_batches,
    stream_steps,
)

from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS, STEPS_PER_RUN = 60, 2


def paced_lr_step(state: Any, batch: Any) -> Any:
    """``linear_regression_step`` taking at least 20 ms a step on the host, so the job
    runs long enough to be looked at."""
    import jax

    def pause(x: Any) -> Any:
        time.sleep(0.02)
        return x

    new, outputs = linear_regression_step(state, batch)
    zero = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
    return {"w": new["w"] + zero, "b": new["b"]}, outputs


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    where = tmp_path_factory.mktemp("multislice")
    running = start_service(where / "serve.log", "v4-8,v4-8",
                            args=(*PROCESSES, "--state-dir", str(where / "state")))
    try:
        yield running
    finally:
        stop_service(running)


def test_a_two_slice_job_matches_numpy_and_holds_both_slices(service: Service) -> None:
    # Global batches of 20 rows over 8 replicas (3, 3, 3, 3, 2, 2, 2, 2): padding on the
    # devices of both slices; 52 rows in all, so epochs start inside a global batch.
    batches = lr_batches([20, 20, 12], seed=5)
    api = httpx.Client(base_url=service.http_url, timeout=30,
                       headers={"Authorization": f"Bearer {service.token}"})
    with service.connect() as client:
        job = client.submit(paced_lr_step, steps=STEPS, accelerator_type="v4-8",
                            num_slices=2, initial_state=initial_lr_state(), dataset=batches,
                            steps_per_run=STEPS_PER_RUN,
                            outputs={"loss": "MEAN", "replicas": "SUM"}, name="two-slices")
        try:
            def holders() -> list[Any]:
                return [s["holder"] for s in api.get("/api/v1/cluster").json()["slices"]]

            assert wait_for(lambda: holders() == [f"job {job.id}"] * 2, 120), (
                holders(), job.status())
            assert wait_for(lambda: len(api.get(f"/api/v1/jobs/{job.id}").json()["hosts"])
                            == 2, 60), job.status()
            final = job.wait(timeout=300, progress=False)
            assert wait_for(lambda: holders() == [None, None], 30), holders()
        finally:
            api.close()
        assert final.state == "SUCCEEDED", final.error
        result = job.result()
        assert float(result.outputs["replicas"]) == 8.0  # one group over both slices
        _assert_lr_result(result, final, stream_steps(batches, STEPS), steps=STEPS,
                          steps_per_run=STEPS_PER_RUN)
