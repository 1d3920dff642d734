"""Profiles of a running 2-host job on a real ``jaxpod serve --local --provider
processes`` (one v4-16; profiling is the workers' own, whatever starts them).

``job.profile(seconds)``, ``jaxpod profile ID`` (a fresh interpreter) and ``POST
/api/v1/jobs/{id}/profile`` trace every host with ``jax.profiler`` at the job's next loop
boundary. Each host's trace lands under the job's checkpoint folder in TensorBoard's
layout and parses, with ``jax.profiler.ProfileData``, as the XSpace protobuf it is,
holding the worker's operations, the compiled step's runs and its host callback. The
job's result is still exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from serve_process import PROCESSES, Service, running_service

import jaxpod
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS = 1000  # >= 20 s while paced: the three profiles below take a few seconds


def paced_step(marker: str) -> Any:
    """A step that adds the global batch's sum to the state and, while the file
    ``marker`` exists, takes >= 20 ms on the host (a host callback the trace must show):
    the job runs long enough to profile, then ends quickly once the test removes it."""

    def step(state: Any, batch: Any) -> Any:
        import os
        import time

        import jax

        ctx = jaxpod.get_replica_context()

        def pause(v: Any) -> Any:
            if os.path.exists(marker):
                time.sleep(0.02)
            return v

        wait = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32),
                                 np.float32(0))
        return {"total": state["total"] + ctx.all_reduce("SUM", batch.sum()) + wait}, {}

    return step


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles") / "state"


@pytest.fixture(scope="module")
def service(state_dir: Path) -> Iterator[Service]:
    with running_service(state_dir.parent / "serve.log", "v4-16",
                         args=(*PROCESSES, "--state-dir", str(state_dir))) as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected


def _batches() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 4, size=(8, 2)).astype(np.float32) for _ in range(3)]


def _expected_total(steps: int) -> float:
    """The state after ``steps`` steps, by numpy (small integers: exact in float32)."""
    batches = _batches()
    return float(sum(batches[i % len(batches)].sum() for i in range(steps)))


def _running_job(client: Any, marker: Path) -> Any:
    marker.touch()
    job = client.submit(paced_step(str(marker)), steps=STEPS, steps_per_run=2,
                        accelerator_type="v4-16",
                        initial_state={"total": np.float32(0)}, dataset=_batches(),
                        name="profiled")
    assert wait_for(lambda: job.status().state == "RUNNING" and job.status().step >= 2, 120), \
        job.status()
    return job


def _trace_names(path: str) -> set[str]:
    """Every event name in one host's trace, read by jax's own reader (it parses the
    file as an XSpace protobuf)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    return {event.name for plane in data.planes for line in plane.lines
            for event in line.events}


def _check_profile(profile: jaxpod.JobProfile, job_folder: Path) -> None:
    folder = Path(profile.path)
    assert folder.parent == job_folder / "profiles", profile.path
    written = sorted(str(p) for p in folder.glob("host-*/plugins/profile/*/*.xplane.pb"))
    assert sorted(profile.files) == written
    hosts = sorted({Path(f).relative_to(folder).parts[0] for f in written})
    assert hosts == ["host-0", "host-1"], written  # one trace per host
    assert 0 < profile.seconds <= 1.0 + 1e-6
    for path in written:
        names = _trace_names(path)
        # The worker's loop, the compiled step's runs and its host callback (the pause).
        assert any(name.endswith(" run_steps") for name in names), sorted(names)[:40]
        assert any("Execute (jit_" in name for name in names), sorted(names)[:40]
        assert any(name.startswith("pure_callback") for name in names), sorted(names)[:40]


def test_profiles_of_a_running_two_host_job(service: Service, client: Any,
                                            state_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "paced"
    job = _running_job(client, marker)
    job_folder = state_dir / "checkpoints" / job.id

    # The SDK.
    started = time.time()
    first = job.profile(seconds=1.0)
    assert started - 1 <= first.started_at <= time.time()
    _check_profile(first, job_folder)

    # The CLI, in a fresh interpreter.
    env = {**os.environ, "JAXPOD_ADDRESS": service.address, "JAXPOD_TOKEN": service.token}
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", "profile", job.id,
                           "--seconds", "0.5", "--json"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    second = jaxpod.JobProfile(**{k: tuple(v) if k == "files" else v
                                  for k, v in json.loads(done.stdout).items()})
    _check_profile(second, job_folder)
    assert second.path != first.path

    # The HTTP API.
    reply = httpx.post(f"{service.http_url}/api/v1/jobs/{job.id}/profile",
                       params={"seconds": 0.5}, timeout=300,
                       headers={"Authorization": f"Bearer {service.token}"})
    assert reply.status_code == 200, reply.text
    third = jaxpod.JobProfile(**{**reply.json(), "files": tuple(reply.json()["files"])})
    _check_profile(third, job_folder)

    assert [p.path for p in job.profiles()] == [first.path, second.path, third.path]
    shown = subprocess.run([sys.executable, "-m", "jaxpod.cli", "job", job.id], env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "profiles:" in shown.stdout and third.path in shown.stdout

    # Profiling changed nothing the job computes (its last steps run unpaced).
    marker.unlink()
    assert job.wait(timeout=600, progress=False).state == "SUCCEEDED"
    assert float(job.result().state["total"]) == _expected_total(STEPS)


def test_a_profile_needs_a_running_job_and_sane_seconds(service: Service, client: Any,
                                                         tmp_path: Path) -> None:
    job = client.submit(paced_step(str(tmp_path / "unpaced")), steps=4, steps_per_run=2,
                        accelerator_type="v4-16",
                        initial_state={"total": np.float32(0)}, dataset=_batches(),
                        name="short")
    assert job.wait(timeout=300, progress=False).state == "SUCCEEDED"
    assert float(job.result().state["total"]) == _expected_total(4)
    with pytest.raises(ValueError, match="SUCCEEDED, not running"):
        job.profile(seconds=0.5)
    for bad in (0, -1, 301, "5"):
        with pytest.raises(ValueError, match="at most 300 seconds"):
            job.profile(seconds=bad)
    reply = httpx.post(f"{service.http_url}/api/v1/jobs/{job.id}/profile",
                       params={"seconds": 0}, timeout=30,
                       headers={"Authorization": f"Bearer {service.token}"})
    assert reply.status_code in (400, 422), reply.text


def doubled(x: Any) -> Any:
    return x * 2


def test_an_interactive_strategy_profiles_its_with_block(client: Any,
                                                          state_dir: Path) -> None:
    strategy = client.strategy("v4-16")
    try:
        x = np.arange(3, dtype=np.float32)
        with strategy.profile(seconds=60) as traced:
            outs = [strategy.run(doubled, args=(x,)) for _ in range(5)]
            total = strategy.reduce("SUM", outs[-1], axis=None)
        np.testing.assert_array_equal(total, x * 2 * strategy.num_replicas_in_sync)
        profile = traced.result
        assert profile is not None and traced.started is not None
        assert profile.path == traced.started.path
        folder = Path(profile.path)
        assert folder.parent.parent.parent == state_dir / "checkpoints" / "sessions"
        assert 0 < profile.seconds < 60
        written = sorted(str(p) for p in folder.glob("host-*/plugins/profile/*/*.xplane.pb"))
        assert sorted(profile.files) == written and len(written) == 2, written
        for path in written:  # the worker's run operations and their compiled programs
            names = _trace_names(path)
            assert any(name.endswith(" run") for name in names), sorted(names)[:40]
            assert any("Execute (jit_" in name for name in names), sorted(names)[:40]
        with pytest.raises(ValueError, match="at most 300 seconds"):
            strategy.profile(seconds=0)
    finally:
        strategy.close()
