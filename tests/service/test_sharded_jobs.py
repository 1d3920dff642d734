"""Global-view jobs (``mesh=``) end to end on a real ``jaxpod serve --local`` (v4-16).

``init_fn`` and ``step_fn`` run as ``jax.jit`` programs over the slice's 8 chips, on a
tensor-parallel mesh ``{"data": 4, "model": 2}`` (a linear model's weights split over
``model``) and an FSDP one ``{"data": -1}`` (split over ``data``); a state leaf is
split over all 8 chips (each holds an eighth of it) and batches over ``data``. Results
are compared with a one-device ``jax.jit`` run of the same functions in this process
and with numpy; the hosts' own view of the shardings comes from
``jax.debug.inspect_array_sharding`` printed into the job's logs. A host SIGKILLed
mid-run resumes from the hosts' orbax checkpoint and ends bit for bit as the
uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from serve_process import PROCESSES, Service, start_service, stop_service

from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

FEATURES, OUT, ROWS = 8, 4, 16
BIG = (64, 16)  # split over all 8 chips: (8, 16) each
LR = np.float32(0.05)
MESHES = {"tp": {"data": 4, "model": 2}, "fsdp": {"data": -1}}
#: Each mesh's shard of w (8, 4) on one chip.
W_SHARDS = {"tp": (8, 2), "fsdp": (1, 4)}


# ------------------------------------------------------------------ the user's code
def sharded_init() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxpod

    axes = jaxpod.mesh().axis_names  # tensor parallel over "model" where there is one
    w = jnp.asarray(initial_w())
    w_spec = P(None, "model") if "model" in axes else P("data", None)
    return {"w": jax.lax.with_sharding_constraint(w, w_spec),
            "b": jnp.zeros((OUT,), jnp.float32),
            "big": jax.lax.with_sharding_constraint(jnp.ones(BIG, jnp.float32), P(axes)),
            "n": jnp.int32(0)}


def initial_w() -> np.ndarray:
    return np.linspace(-1, 1, FEATURES * OUT, dtype=np.float32).reshape(FEATURES, OUT)


def sharded_step(state: Any, batch: Any, pause_s: float = 0.0) -> Any:
    import time

    import jax
    import jax.numpy as jnp

    import jaxpod

    # Traced once per attempt on every host: the log says which process traced it.
    print(f"pid {os.getpid()} mesh {dict(jaxpod.mesh().shape)}")
    for name in ("w", "big"):
        shape = state[name].shape
        jax.debug.inspect_array_sharding(
            state[name], callback=lambda s, name=name, shape=shape: print(
                f"{name} shard {tuple(s.shard_shape(shape))}"))

    def loss_fn(w: Any, b: Any) -> Any:
        return jnp.mean((batch["x"] @ w + b - batch["y"]) ** 2)

    loss, (gw, gb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["w"], state["b"])
    if pause_s:
        def pause(x: Any) -> Any:
            time.sleep(pause_s)
            return x
        loss = jax.pure_callback(pause, jax.ShapeDtypeStruct((), jnp.float32), loss)
    return {"w": state["w"] - LR * gw, "b": state["b"] - LR * gb,
            "big": state["big"] * 0.5 + jnp.sum(batch["x"]), "n": state["n"] + 1}, \
        {"loss": loss}


def slow_sharded_step(state: Any, batch: Any) -> Any:
    return sharded_step(state, batch, pause_s=0.1)


def batches(count: int = 5) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(count):
        x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
        out.append({"x": x, "y": (x @ rng.normal(size=(FEATURES, OUT))).astype(np.float32)})
    return out


def numpy_run(data: list[dict[str, np.ndarray]], steps: int) -> tuple[dict[str, Any],
                                                                      list[float]]:
    """The same steps in float64 numpy: the final state and each step's loss."""
    w, b = initial_w().astype(np.float64), np.zeros(OUT)
    big = np.ones(BIG)
    losses = []
    for step in range(steps):
        x, y = (data[step % len(data)][k].astype(np.float64) for k in ("x", "y"))
        diff = x @ w + b - y
        losses.append(float(np.mean(diff ** 2)))
        scale = 2.0 / diff.size
        w, b = w - float(LR) * scale * x.T @ diff, b - float(LR) * scale * diff.sum(axis=0)
        big = big * 0.5 + x.sum()
    return {"w": w, "b": b, "big": big, "n": steps}, losses


def one_device_run(axes: dict[str, int], data: list[dict[str, np.ndarray]], steps: int
                   ) -> dict[str, np.ndarray]:
    """The same functions under ``jax.jit`` on one device of this process."""
    import jax
    from jax.sharding import Mesh

    from jaxpod.scope import mesh_scope

    mesh = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), tuple(axes))
    with mesh_scope(mesh):
        state = jax.jit(sharded_init)()
        step = jax.jit(sharded_step)
        for i in range(steps):
            state, _ = step(state, data[i % len(data)])
    return {k: np.asarray(v) for k, v in state.items()}


# ------------------------------------------------------------------ the service
@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("sharded-jobs")
    running = start_service(root / "serve.log", "v4-16",
                            args=(*PROCESSES, "--state-dir", str(root / "state")))
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


def submit(client: Any, step: Any = sharded_step, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(steps=12, accelerator_type="v4-16", init_fn=sharded_init,
                                  dataset=batches(), steps_per_run=3, checkpoint_every=3,
                                  outputs={"loss": "MEAN"}, mesh=MESHES["tp"])
    kwargs.update(overrides)
    return client.submit(step, **kwargs)


@pytest.fixture(scope="module")
def finished(client: Any) -> dict[str, tuple[Any, Any]]:
    """A job on each mesh, run without interruption, and its result."""
    jobs = {name: submit(client, mesh=mesh) for name, mesh in MESHES.items()}
    return {name: (job, job.result(timeout=300)) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def uninterrupted(finished: dict[str, tuple[Any, Any]]) -> tuple[Any, Any]:
    return finished["tp"]


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_global_view_job_ends_as_a_one_device_run_and_numpy(
        finished: dict[str, tuple[Any, Any]], name: str) -> None:
    _, result = finished[name]
    want, losses = numpy_run(batches(), 12)
    alone = one_device_run(MESHES[name], batches(), 12)
    got = result.state
    assert set(got) == set(want) == set(alone) and int(got["n"]) == 12
    for key in ("w", "b", "big"):  # the reduction order differs: close, not equal
        np.testing.assert_allclose(got[key], alone[key], rtol=2e-6, atol=2e-6, err_msg=key)
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-5, err_msg=key)
    # outputs={"loss": "MEAN"}: each loop of 3 steps records its steps' mean.
    recorded = dict(result.metrics["loss"])
    assert sorted(recorded) == [3, 6, 9, 12]
    for end, value in recorded.items():
        assert value == pytest.approx(np.mean(losses[end - 3:end]), rel=1e-5)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_each_chip_holds_only_its_shard_of_the_state(
        finished: dict[str, tuple[Any, Any]], name: str) -> None:
    job, _ = finished[name]
    logs = job.logs()
    sizes = {"tp": "{'data': 4, 'model': 2}", "fsdp": "{'data': 8}"}[name]
    for host in (0, 1):
        assert re.search(rf"^\[host {host}\] pid \d+ mesh {re.escape(sizes)}$", logs,
                         re.MULTILINE), logs
        # A mirrored state would be whole on every chip: (8, 4) and (64, 16).
        w = re.escape(str(W_SHARDS[name]))
        assert re.search(rf"^\[host {host}\] w shard {w}$", logs, re.MULTILINE), logs
        assert re.search(rf"^\[host {host}\] big shard \(8, 16\)$", logs, re.MULTILINE), logs


@pytest.mark.parametrize("name", sorted(MESHES))
def test_its_checkpoints_are_plain_orbax_global_arrays(
        finished: dict[str, tuple[Any, Any]], name: str) -> None:
    job, result = finished[name]
    saved = job.checkpoints()
    assert [c.step for c in saved][-1] == 12
    plain = ocp.StandardCheckpointer().restore(saved[-1].path)
    for key, value in result.state.items():
        assert np.array_equal(np.asarray(plain[key]), np.asarray(value)), key


def test_a_killed_host_resumes_from_the_checkpoint_bit_for_bit(
        client: Any, uninterrupted: Any) -> None:
    job = submit(client, step=slow_sharded_step, max_retries_preemption=2)
    assert wait_for(lambda: job.status().step >= 3 and bool(job.checkpoints())
                    and "[host 1] pid" in job.logs(), 300), job.status()
    victim = int(re.findall(r"^\[host 1\] pid (\d+)", job.logs(), re.MULTILINE)[-1])
    os.kill(victim, signal.SIGKILL)
    result = job.result(timeout=300)
    first, _ = attempts = job.attempts()
    resumed = re.search(r"the next attempt starts at step (\d+)", first.cause or "")
    assert len(attempts) == 2 and resumed and int(resumed.group(1)) >= 3, attempts
    assert (job.status().goodput or {}).get("restoring", 0) > 0
    _, expected = uninterrupted
    for key, value in expected.state.items():
        assert np.array_equal(np.asarray(result.state[key]), np.asarray(value)), key
    assert result.metrics["loss"] == expected.metrics["loss"]


def test_what_a_global_view_job_cannot_be_is_said_at_once_or_fails_the_job(
        client: Any) -> None:
    with pytest.raises(ValueError, match="both mesh and computation_shape"):
        submit(client, computation_shape=[2, 1, 1, 1])
    with pytest.raises(ValueError, match="pass mesh"):
        submit(client, mesh=None, batch_sharding=("data",))
    with pytest.raises(TypeError, match="batch_sharding must be a PartitionSpec"):
        submit(client, batch_sharding="data")
    with pytest.raises(ValueError, match="only one axis may be -1"):
        submit(client, mesh={"data": -1, "model": -1})
    job = submit(client, mesh={"data": 3})
    final = job.wait(timeout=120, progress=False)
    assert final.state == "FAILED" and "mesh {'data': 3}" in final.error, final.error
