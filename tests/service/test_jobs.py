"""Jobs end to end: a real ``jaxpod serve --local`` process with its own state dir.

The service holds a v4-8 (1 host) and a v4-16 (2 hosts) on the simulated cluster, real
Ray and real workers; jobs are submitted from this process's SDK and from fresh
interpreters (the CLI, a second client), and every result is checked against numpy
running the same steps. The last test SIGKILLs the service with everything it
started and starts a new one on the same state dir.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import Service, crash_service, start_service, stop_service

import jaxpod
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.api.server import SERVICE_NAME
from jaxpod.timeouts import Deadline, wait_for

pytestmark = pytest.mark.multiprocess

SLICES = "v4-8,v4-16"
#: Lines each host of the printing job prints at trace time, and their width (under the
#: hosts' 64 KiB cut).
WIDE_LINES, WIDE_CHARS = 10, 60_000
LR = 0.1
FEATURES = 3
RTOL, ATOL = 2e-5, 2e-6


# ------------------------------------------------------------------ step functions
# Module-level: shipped by value to the workers, like a user's script.
def linear_regression_step(state: Any, batch: Any) -> Any:
    """One SGD step of y ~ x @ w + b over the global batch (padding rows masked)."""
    ctx = jaxpod.get_replica_context()
    x, y = batch["x"], batch["y"]
    mask = ctx.valid_row_mask.astype(x.dtype)
    err = (x @ state["w"] + state["b"] - y) * mask
    n = ctx.all_reduce("SUM", mask.sum())
    grad_w = ctx.all_reduce("SUM", x.T @ err) / n
    grad_b = ctx.all_reduce("SUM", err.sum()) / n
    new = {"w": state["w"] - LR * grad_w, "b": state["b"] - LR * grad_b}
    return new, {"loss": err ** 2, "replicas": 1.0}


#: How long host 1 sleeps in each replica's step of ``straggling_step``: well over
#: 3x host 0's step even on a slow, busy machine, so the flag stays up between reads.
STRAGGLE_S = 0.08


def straggle(x: Any) -> Any:
    import jax

    if jax.process_index() == 1:
        time.sleep(STRAGGLE_S)
    return x


def straggling_step(state: Any, batch: Any) -> Any:
    """Host 1 sleeps in every step (a host callback). No collective joins the hosts
    inside a step, so host 0's loops end without waiting for host 1's."""
    import jax

    ctx = jaxpod.get_replica_context()
    rows = (batch * ctx.valid_row_mask.astype(batch.dtype)).sum()
    rows = jax.pure_callback(straggle, jax.ShapeDtypeStruct(rows.shape, rows.dtype), rows)
    return state, {"rows": rows}


def counting_step(state: Any, batch: Any) -> Any:
    """Adds the batch's real rows' sum to the state: cheap, and order-sensitive."""
    ctx = jaxpod.get_replica_context()
    mask = ctx.valid_row_mask.astype(batch.dtype)
    total = ctx.all_reduce("SUM", (batch * mask).sum())
    return {"total": state["total"] + total}, {"total": state["total"] + total}


def slow_step(state: Any, batch: Any) -> Any:
    import jax

    def pause(x: Any) -> Any:
        time.sleep(0.05)
        return x

    return state, {"x": jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32),
                                          np.float32(1))}


class StepError(Exception):
    """A user-defined exception, raised on the workers."""


def failing_step(state: Any, batch: Any) -> Any:
    raise StepError("the step refused its batch")


def bad_return_step(state: Any, batch: Any) -> Any:
    return {"loss": batch.sum()}


def missing_output_step(state: Any, batch: Any) -> Any:
    return state, {"loss": batch.sum()}


def logical_devices_step(state: Any, batch: Any) -> Any:
    """Keeps one leaf split over the replica's logical devices, one replicated to them
    and one assigned to the last: each loop feeds the next what the last left."""
    import builtins

    strategy, ctx = jaxpod.get_strategy(), jaxpod.get_replica_context()
    n = strategy.device_assignment.num_cores_per_replica
    total = ctx.all_reduce("SUM", batch.sum(axis=0))
    # Counted while tracing, in the worker: a constant of each compiled loop.
    traces = builtins.__dict__.setdefault("_jaxpod_test_traces", {})
    traces[n] = traces.get(n, 0) + 1
    return {
        "split": strategy.experimental_split_to_logical_devices(
            state["split"] * 0.5 + total, [n, 1]),
        "replicated": strategy.experimental_replicate_to_logical_devices(
            state["replicated"] + total.sum()),
        "assigned": strategy.experimental_assign_to_logical_device(
            state["assigned"] * 0.9 + 1.0, n - 1),
    }, {"traces": np.float32(traces[n])}


def logical_devices_state() -> dict[str, np.ndarray]:
    return {"split": np.zeros((8, 4), np.float32), "replicated": np.zeros((), np.float32),
            "assigned": np.arange(3, dtype=np.float32)}


class SlowPipeline:
    """An input pipeline that takes ``delay_s`` to make each element: a host whose input
    cannot keep up with its steps (the delay is the workload, not a wait on anything)."""

    def __init__(self, elements: list[Any], delay_s: float) -> None:
        self.elements = elements
        self.delay_s = delay_s

    def __iter__(self) -> Iterator[Any]:
        for element in self.elements:
            time.sleep(self.delay_s)
            yield element


def initial_lr_state() -> dict[str, np.ndarray]:
    return {"w": np.zeros(FEATURES, np.float32), "b": np.float32(0.0)}


# ------------------------------------------------------------------ numpy oracle
def lr_batches(rows: list[int], seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    true_w = np.arange(1, FEATURES + 1, dtype=np.float32)
    batches = []
    for n in rows:
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        y = (x @ true_w + 0.5 + 0.1 * rng.normal(size=n)).astype(np.float32)
        batches.append({"x": x, "y": y})
    return batches


def stream_steps(batches: list[dict[str, np.ndarray]], steps: int
                 ) -> list[dict[str, np.ndarray]]:
    """Each step's global batch: a job's dataset is one stream of rows that starts over
    when it runs out, cut into global batches of the first batch's size."""
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    total, size = len(rows["y"]), len(batches[0]["y"])
    return [{k: v[np.arange(s * size, (s + 1) * size) % total] for k, v in rows.items()}
            for s in range(steps)]


def numpy_lr(step_batches: list[dict[str, np.ndarray]], steps: int, steps_per_run: int
             ) -> tuple[dict[str, np.ndarray], dict[int, float]]:
    """The same SGD in float64 numpy, one given global batch per step; losses
    recorded after each run of steps."""
    w, b = np.zeros(FEATURES), 0.0
    losses = {}
    for step in range(steps):
        batch = step_batches[step]
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        err = x @ w + b - y
        loss = float(np.mean(err ** 2))
        w, b = w - LR * x.T @ err / len(y), b - LR * err.mean()
        done = step + 1
        if done % steps_per_run == 0 or done == steps:
            losses[done] = loss
    return {"w": w, "b": np.float64(b)}, losses


# ------------------------------------------------------------------ the service
@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs-state")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, state_dir: Path) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("jobs") / "serve.log"
    running = start_service(log, SLICES, args=("--state-dir", str(state_dir)))
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


def _fresh(service: Service, code: str, *args: str, timeout: float = 180) -> str:
    """Runs ``code`` in a fresh interpreter with the service's address and token."""
    env = {**os.environ, "JAXPOD_ADDRESS": service.address, "JAXPOD_TOKEN": service.token}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _cli(service: Service, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAXPOD_ADDRESS": service.address, "JAXPOD_TOKEN": service.token}
    return subprocess.run([sys.executable, "-m", "jaxpod.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _assert_lr_result(result: Any, status: Any, batches: list[dict[str, np.ndarray]],
                      steps: int, steps_per_run: int) -> None:
    expected_state, expected_losses = numpy_lr(batches, steps, steps_per_run)
    np.testing.assert_allclose(result.state["w"], expected_state["w"], RTOL, ATOL)
    np.testing.assert_allclose(result.state["b"], expected_state["b"], RTOL, ATOL)
    recorded = dict(result.metrics["loss"])
    assert sorted(recorded) == sorted(expected_losses)
    np.testing.assert_allclose([recorded[s] for s in sorted(recorded)],
                               [expected_losses[s] for s in sorted(expected_losses)],
                               RTOL, ATOL)
    last = max(expected_losses)
    np.testing.assert_allclose(result.outputs["loss"], expected_losses[last], RTOL, ATOL)
    assert result.steps == steps and status.step == steps
    assert status.metrics["loss"] == pytest.approx(recorded[last])


# ------------------------------------------------------------------ tests
def test_linear_regression_job_matches_numpy(client: Any, state_dir: Path) -> None:
    # Global batches of 14 rows over 4 replicas (4, 4, 3, 3): padding on the devices;
    # 37 rows in all, so epochs start in the middle of a global batch.
    batches = lr_batches([14, 14, 9], seed=0)
    job = client.submit(linear_regression_step, steps=12, accelerator_type="v4-8",
                        initial_state=initial_lr_state(), dataset=batches, steps_per_run=5,
                        outputs={"loss": "MEAN"}, name="linear-regression")
    assert job.name == "linear-regression"
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    result = job.result()
    _assert_lr_result(result, final, stream_steps(batches, 12), steps=12, steps_per_run=5)
    assert final.attempts == 1 and final.started_at is not None
    assert final.created_at <= final.started_at <= final.finished_at
    # Its folder holds TensorBoard scalars: the loss at every recorded step, as
    # TensorBoard's own reader reads them, and the attempt's rate and goodput.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(state_dir / "checkpoints" / job.id / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in loss] == [s for s, _ in result.metrics["loss"]]
    np.testing.assert_allclose([v for _, v in loss], [v for _, v in result.metrics["loss"]],
                               rtol=1e-6)
    tags = events.Tags()["scalars"]
    assert "steps_per_s" in tags and "goodput/productive_share" in tags, tags
    share = events.Scalars("goodput/productive_share")[-1]
    assert share.step == 12 and 0 < share.value <= 1


def test_dataset_fn_job_on_two_hosts_matches_numpy(client: Any) -> None:
    per_replica_rows, replicas_per_host = 3, 4
    host_batches = {h: lr_batches([per_replica_rows] * 6, seed=10 + h) for h in range(2)}

    def dataset_fn(ctx: Any) -> list[dict[str, np.ndarray]]:
        return host_batches[ctx.input_pipeline_id]

    steps = 7  # host pipelines of 6 elements, 4 taken per step: they start over
    job = client.submit(linear_regression_step, steps=steps, accelerator_type="v4-16",
                        initial_state=initial_lr_state(), dataset_fn=dataset_fn,
                        steps_per_run=3, outputs={"loss": "MEAN"})
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    # Step s: replica j of host h takes element (4 s + j) mod 6 of its host's pipeline.
    global_batches = []
    for s in range(steps):
        parts = [host_batches[h][(replicas_per_host * s + j) % 6]
                 for h in range(2) for j in range(replicas_per_host)]
        global_batches.append({k: np.concatenate([p[k] for p in parts]) for k in ("x", "y")})
    _assert_lr_result(job.result(), final, global_batches, steps=steps, steps_per_run=3)


def test_a_host_whose_input_lags_shows_its_input_wait(client: Any, service: Service) -> None:
    # Host 1 makes each element in DELAY_S, host 0 reads its own from memory: host 1's
    # steps wait for their input, and host 0's then wait for host 1 in the collectives.
    # Making an element (DELAY_S) must take well over a step's compute on any machine,
    # or the infeed's read-ahead hides the making behind the steps: 10 ms did not once,
    # on a CI machine busy with other processes (a quarter of the making waited for).
    delay_s, steps, per_step = 0.025, 80, 4  # 4 replicas per host: 4 elements a step
    host_batches = {h: lr_batches([3] * 8, seed=20 + h) for h in range(2)}

    def dataset_fn(ctx: Any) -> Any:
        mine = host_batches[ctx.input_pipeline_id]
        return SlowPipeline(mine, delay_s) if ctx.input_pipeline_id == 1 else mine

    job = client.submit(linear_regression_step, steps=steps, accelerator_type="v4-16",
                        initial_state=initial_lr_state(), dataset_fn=dataset_fn,
                        steps_per_run=4, outputs={"loss": "MEAN"}, name="lagging-input")
    api = httpx.Client(base_url=service.http_url, timeout=30,
                       headers={"Authorization": f"Bearer {service.token}"})

    def host_waits() -> dict[str, float]:
        families = text_string_to_metric_families(api.get("/metrics").text)
        return {s.labels["host"]: s.value for f in families
                if f.name == "jaxpod_host_input_wait_seconds"
                for s in f.samples if s.labels["job_id"] == job.id}

    try:
        seen = wait_for(lambda: (w := host_waits()).get("1", 0.0) > 0.05 and w, 120)
        assert seen, (host_waits(), job.status())
        detail = api.get(f"/api/v1/jobs/{job.id}").json()
        sdk = job.hosts()
        shown = _cli(service, "job", job.id)
        running = job.status().state == "RUNNING"
        final = job.wait(timeout=300, progress=False)
    finally:
        api.close()
    assert final.state == "SUCCEEDED", final.error
    assert sorted(seen) == ["0", "1"] and seen["0"] < seen["1"] / 2
    assert [h["host"] for h in detail["hosts"]] == [0, 1]
    # The SDK and `jaxpod job ID` (a fresh interpreter) show the same figures.
    assert [h.host for h in sdk] == [0, 1] and sdk[1].input_wait_s >= seen["1"]
    # Each host's worker is named: two processes, on a named machine and address.
    assert len({h.pid for h in sdk}) == 2 and all(h.pid > 0 for h in sdk), sdk
    assert all(h.node and h.address for h in sdk), sdk
    assert [(h["node"], h["address"], h["pid"]) for h in detail["hosts"]] == [
        (h.node, h.address, h.pid) for h in sdk]
    assert shown.returncode == 0, shown.stderr
    if running:  # it was still running after the CLI answered, so the CLI saw it run
        assert "hosts of the running attempt" in shown.stdout, shown.stdout
        assert re.search(r"host 1  \S+ 127\.0\.0\.1 pid \d+  \S+ s/step  waited",
                         shown.stdout), shown.stdout
    assert all(h["input_queue_depth"] >= 0 for h in detail["hosts"])
    # Host 1's pipeline spent steps * per_step * delay_s making elements; its steps waited
    # for most of it (the loops themselves take little), and goodput counts that wait.
    made_s = steps * per_step * delay_s
    waited = final.goodput["input_wait"]
    assert seen["1"] <= waited <= made_s * 1.5, (seen, final.goodput)
    assert waited >= 0.25 * made_s, final.goodput
    assert sum(v for k, v in final.goodput.items()
               if k not in ("wall_s", "productive_share")) == pytest.approx(
                   final.finished_at - final.created_at, rel=0.01)


def test_a_straggling_host_is_named_and_its_stacks_show_where_it_sleeps(
        client: Any, service: Service) -> None:
    steps = 400  # far more than the test waits for: it cancels the job
    job = client.submit(straggling_step, steps=steps, accelerator_type="v4-16",
                        initial_state={"total": np.float32(0)},
                        dataset=[np.arange(8, dtype=np.float32)], steps_per_run=2,
                        outputs={"rows": "SUM"}, name="straggler")
    try:
        hosts = wait_for(lambda: (h := job.hosts()) and any(x.straggler for x in h) and h,
                         120)
        assert hosts, (job.status(), job.hosts())
        assert [h.host for h in hosts] == [0, 1]
        assert hosts[1].straggler and not hosts[0].straggler, hosts
        assert hosts[1].step_s > 3 * hosts[0].step_s > 0, hosts
        # The job's status names it too (a read of its own, so waited for as well).
        assert wait_for(lambda: job.status().stragglers == (1,), 60), job.status()

        def shown_by_cli() -> Any:
            done = _cli(service, "job", job.id)
            assert done.returncode == 0, done.stderr
            return "STRAGGLER" in done.stdout or None

        # retried: a busy machine can slow host 0 for a report, lifting the flag
        assert wait_for(shown_by_cli, 60), job.hosts()

        def host_1_sleeping() -> str | None:
            # A fresh interpreter, as users run it; retried, since a read between two
            # loops finds the host idle.
            done = _cli(service, "job", "stacks", job.id)
            assert done.returncode == 0, done.stderr
            sections = re.split(r"^== host (\d+)", done.stdout, flags=re.M)
            by_host = dict(zip(sections[1::2], sections[2::2], strict=True))
            assert sorted(by_host) == ["0", "1"], done.stdout
            return by_host["1"] if "in straggle" in by_host["1"] else None

        stack = wait_for(host_1_sleeping, 120)
        only = _cli(service, "job", "stacks", job.id, "--host", "1")
        assert only.returncode == 0 and only.stdout.count("== host ") == 1, only
        assert only.stdout.startswith("== host 1  "), only.stdout[:200]
        wrong = _cli(service, "job", "stacks", job.id, "--host", "2")
        assert wrong.returncode == 2 and "hosts 0-1" in wrong.stderr, wrong
        # A thread's innermost frame is the one in time.sleep (a builtin: no frame of
        # its own); shipped by value, the step's code shows no source line.
        assert stack and re.search(r"in straggle\n(\s*time\.sleep.*\n)?(thread|\Z)",
                                   stack), stack
        # The logs keep the stacks read during the loop after the host was flagged.
        logged = wait_for(lambda: "in straggle" in (text := job.logs()) and text, 60)
        assert logged and "[host 1] [jaxpod] host 1 straggles" in logged, logged
        # The last loop's metric is the global batch's sum (both hosts' rows).
        assert job.status().metrics["rows"] == float(np.arange(8).sum()), job.status()
        # The HTTP API reads them too (what the page's Stacks button shows).
        with httpx.Client(base_url=service.http_url, timeout=60,
                          headers={"Authorization": f"Bearer {service.token}"}) as api:
            hosts_read = api.get(f"/api/v1/jobs/{job.id}/stacks").json()
            assert [h["host"] for h in hosts_read] == [0, 1], hosts_read
            assert all("most recent call last" in h["stacks"] for h in hosts_read)
            job.cancel()
            refused = api.get(f"/api/v1/jobs/{job.id}/stacks")
            assert refused.status_code == 409 and refused.json()["error"] == "not_running"
    finally:
        job.cancel()
    with pytest.raises(ValueError, match="not running on a slice"):
        job.stacks()


def test_another_process_reattaches_and_gets_the_same_result(client: Any,
                                                              service: Service) -> None:
    batches = lr_batches([8, 8], seed=3)
    job = client.submit(linear_regression_step, steps=4, accelerator_type="v4-8",
                        initial_state=initial_lr_state(), dataset=batches,
                        outputs={"loss": "MEAN"})
    mine = job.result(timeout=300)
    _assert_lr_result(mine, job.status(), stream_steps(batches, 4), steps=4, steps_per_run=1)
    out = _fresh(service, """
        import json, sys
        import jaxpod
        client = jaxpod.connect()
        job = client.job(sys.argv[1])
        result = job.result(timeout=300)
        listed = [s.id for s in client.jobs()]
        print(json.dumps({"w": result.state["w"].tolist(), "b": float(result.state["b"]),
                          "loss": result.metrics["loss"], "name": job.name,
                          "listed": job.id in listed}))
    """, job.id)
    theirs = json.loads(out.strip().splitlines()[-1])
    assert theirs["listed"] and theirs["name"] == job.name
    np.testing.assert_array_equal(np.asarray(theirs["w"], np.float32), mine.state["w"])
    assert theirs["b"] == pytest.approx(float(mine.state["b"]))
    assert [tuple(p) for p in theirs["loss"]] == [tuple(p) for p in mine.metrics["loss"]]

    shown = _cli(service, "job", job.id, "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["id"] == job.id and status["state"] == "SUCCEEDED"
    assert status["metrics"]["loss"] == pytest.approx(mine.metrics["loss"][-1][1])
    assert [t["to_state"] for t in status["history"]] == [
        "PENDING", "ALLOCATING", "RUNNING", "SUCCEEDED"]
    assert [(a["number"], a["cause"], a["step_reached"]) for a in status["attempts"]] == [
        (1, "succeeded", 4)]
    attempt = status["attempts"][0]  # its first loop counted the programs it needed
    assert attempt["programs_loaded"] >= 0 and attempt["programs_compiled"] >= 0, attempt
    table = _cli(service, "job", job.id)
    assert table.returncode == 0 and "RUNNING -> SUCCEEDED" in table.stdout, table.stdout
    assert (f"programs: {attempt['programs_loaded']} from the compilation cache, "
            f"{attempt['programs_compiled']} compiled") in table.stdout, table.stdout


def test_cancel_stops_a_running_job_and_the_next_one_starts(client: Any) -> None:
    long = client.submit(slow_step, steps=100_000, accelerator_type="v4-8",
                         outputs={"x": "SUM"}, name="long")
    after = client.submit(counting_step, steps=2, accelerator_type="v4-8",
                          initial_state={"total": np.float32(0)},
                          dataset=[np.ones((4,), np.float32)], outputs={"total": "MAX"})
    assert wait_for(lambda: long.status().step > 0, 120), long.status()
    assert after.status().state == "PENDING" and after.status().queue_position == 0
    start = time.monotonic()
    answered = long.cancel()  # the service answers once the job stopped
    assert answered.state == "CANCELLED" and time.monotonic() - start < 5.0
    final = long.status()
    assert final.state == "CANCELLED" and final.step < final.steps
    with pytest.raises(jaxpod.JobCancelledError):
        long.result()
    done = after.wait(timeout=120, progress=False)
    assert done.state == "SUCCEEDED", done.error
    assert done.started_at >= final.finished_at
    assert float(after.result().state["total"]) == 8.0  # two steps of 4 ones


def test_a_cancelled_job_keeps_its_checkpoints_and_result_says_where(
        client: Any, service: Service) -> None:
    job = client.submit(counting_step, steps=100_000, accelerator_type="v4-8",
                        initial_state={"total": np.float32(0)},
                        dataset=[np.ones((4,), np.float32)], checkpoint_every=4)
    assert wait_for(lambda: len(job.checkpoints()) >= 2, 120), job.status()
    assert job.cancel().state == "CANCELLED"
    saved = job.checkpoints()
    steps = [c.step for c in saved]
    assert steps == sorted(steps) and all(s % 4 == 0 and s > 0 for s in steps)
    assert all(Path(c.path).is_dir() for c in saved)  # the service's own machine
    with pytest.raises(jaxpod.JobCancelledError) as cancelled:
        job.result()
    assert cancelled.value.checkpoint == saved[-1]
    assert f"at step {saved[-1].step}, holds its state: {saved[-1].path}" in str(
        cancelled.value)
    shown = _cli(service, "job", job.id)
    assert shown.returncode == 0, shown.stderr
    assert f"step {saved[-1].step}" in shown.stdout and saved[-1].path in shown.stdout


def test_a_raising_step_fails_the_job_with_the_users_exception(client: Any) -> None:
    job = client.submit(failing_step, steps=3, accelerator_type="v4-8",
                        dataset=[np.ones((4,), np.float32)])
    final = job.wait(timeout=120, progress=False)
    assert final.state == "FAILED"
    assert "StepError: the step refused its batch" in final.error
    assert "failing_step" in final.error  # the remote traceback names the user's frame
    with pytest.raises(jaxpod.JobFailedError, match="the step refused its batch") as raised:
        job.result()
    assert raised.value.job_id == job.id


@pytest.mark.parametrize("logical_devices", [2, 4])
def test_a_job_with_logical_devices_matches_numpy(client: Any, logical_devices: int) -> None:
    """computation_shape: each replica of the v4-16 spans 2 or 4 chips. The state stays
    split, replicated and assigned over them from loop to loop (each loop's program
    compiled once: the third loop runs the second's), through checkpoints, and ends as
    numpy says."""
    batches = [np.random.default_rng(25 + i).normal(size=(8, 4)).astype(np.float32)
               for i in range(5)]
    steps = 10  # loops of 3 steps, the last cut short; the input starts over
    job = client.submit(logical_devices_step, steps=steps, accelerator_type="v4-16",
                        init_fn=logical_devices_state, dataset=batches, steps_per_run=3,
                        checkpoint_every=3, computation_shape=[logical_devices, 1, 1, 1],
                        outputs={"traces": "MAX"})
    result = job.result(timeout=300)
    traces = dict(result.metrics["traces"])
    assert traces[9] == traces[6], f"the third loop compiled again: {traces}"
    want = {k: v.astype(np.float64) for k, v in logical_devices_state().items()}
    for step in range(steps):
        total = batches[step % len(batches)].astype(np.float64).sum(axis=0)
        want = {"split": want["split"] * 0.5 + total,
                "replicated": want["replicated"] + total.sum(),
                "assigned": want["assigned"] * 0.9 + 1.0}
    assert set(result.state) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(result.state[key], value, rtol=RTOL, atol=1e-4)
    assert [c.step for c in job.checkpoints()] == [9, 10]


def test_a_computation_shape_the_slice_cannot_take_fails_the_job_saying_so(
        client: Any) -> None:
    with pytest.raises(TypeError, match="computation_shape must be a list of ints"):
        client.submit(counting_step, steps=1, accelerator_type="v4-16",
                      computation_shape="2x1")
    job = client.submit(counting_step, steps=1, accelerator_type="v4-16",
                        initial_state={"total": np.float32(0)},
                        dataset=[np.ones((8,), np.float32)], computation_shape=[3, 1, 1, 1])
    final = job.wait(timeout=120, progress=False)
    assert final.state == "FAILED"
    assert "could not be set up" in final.error and "computation_shape" in final.error


@pytest.mark.parametrize("step, outputs, expected", [
    (bad_return_step, None, "step_fn must return a pair (state, outputs)"),
    (missing_output_step, {"accuracy": "MEAN"}, "outputs names ['accuracy']"),
])
def test_what_only_the_workers_can_tell_fails_the_job_with_the_reason(
        client: Any, step: Any, outputs: Any, expected: str) -> None:
    job = client.submit(step, steps=1, accelerator_type="v4-8", outputs=outputs,
                        dataset=[np.ones((4,), np.float32)])
    final = job.wait(timeout=120, progress=False)
    assert final.state == "FAILED" and expected in final.error


def test_bad_submissions_are_refused_and_the_service_keeps_serving(client: Any,
                                                                 state_dir: Path) -> None:
    with pytest.raises(ValueError, match="v9-99"):
        client.submit(counting_step, steps=1, accelerator_type="v9-99")
    with pytest.raises(ValueError, match="steps"):
        client.submit(counting_step, steps=0, accelerator_type="v4-8")
    with pytest.raises(jaxpod.JobNotFoundError, match="no-such-job") as unknown:
        client.job("no-such-job")
    assert str(state_dir) not in str(unknown.value)  # the server's paths stay there
    job = client.submit(counting_step, steps=1, accelerator_type="v4-8",
                        initial_state={"total": np.float32(1)},
                        dataset=[np.full((4,), 2, np.float32)], outputs={"total": "MAX"})
    assert float(job.result(timeout=120).state["total"]) == 9.0


def test_twenty_jobs_finish_in_submission_order_with_their_queue_positions(
        client: Any) -> None:
    data = [np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)]
    jobs = [client.submit(counting_step, steps=3, accelerator_type="v4-8",
                          initial_state={"total": np.float32(i)}, dataset=data,
                          outputs={"total": "MAX"}, name=f"queued-{i}") for i in range(20)]
    ids = [j.id for j in jobs]
    seen_positions = 0
    deadline = Deadline(600)
    while not deadline.expired():
        statuses = {s.id: s for s in client.jobs() if s.id in ids}
        # Waiting jobs stand in submission order, 0 first (a job that just left the
        # queue may still say PENDING with no position: it is about to allocate).
        queued = [statuses[i].queue_position for i in ids
                  if statuses[i].state == "PENDING" and statuses[i].queue_position is not None]
        assert queued == list(range(len(queued))), queued
        seen_positions += len(queued)
        if all(s.done for s in statuses.values()):
            break
    assert all(s.done for s in statuses.values()), "the 20 jobs did not finish in 600 s"
    assert seen_positions > 0
    finals = [j.status() for j in jobs]
    assert all(f.state == "SUCCEEDED" for f in finals), [f.error for f in finals]
    starts = [f.started_at for f in finals]
    assert starts == sorted(starts)
    per_step = [float(d.sum()) for d in data]
    for i, job in enumerate(jobs):
        expected = i + per_step[0] + per_step[1] + per_step[0]
        assert float(job.result().state["total"]) == pytest.approx(expected)


def test_logs_hold_what_the_step_printed_on_each_host(service: Service,
                                                      client: Any) -> None:
    def printing_step(state: Any, batch: Any) -> Any:
        import jax

        print("tracing the printing step")
        for i in range(WIDE_LINES):  # over a page of logs in all: they come in pages
            print(f"wide {i} " + "x" * WIDE_CHARS)
        jax.debug.print("step {n} sum {s}", n=state, s=batch.sum())
        return state + 1, {}

    steps = 30
    job = client.submit(printing_step, steps=steps, accelerator_type="v4-16",
                        initial_state=np.int32(0), dataset=[np.ones((8,), np.float32)])
    # `jaxpod logs --follow` in a fresh interpreter, from while the job is queued or
    # running: it prints host 1's lines as they come and returns once the job is over.
    env = {**os.environ, "JAXPOD_ADDRESS": service.address, "JAXPOD_TOKEN": service.token}
    follow = subprocess.Popen([sys.executable, "-m", "jaxpod.cli", "logs", job.id, "-f",
                               "--host", "1"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert job.wait(timeout=120, progress=False).state == "SUCCEEDED"
        followed, errors = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, errors
    lines = job.logs().splitlines()
    assert any(line.startswith("[host 0] tracing the printing step") for line in lines)
    assert any(line.startswith("[host 1] tracing the printing step") for line in lines)
    assert any("step 0 sum 1.0" in line for line in lines), lines
    # Every step printed on each host (8 replicas, 4 a host: four lines a step).
    for host in (0, 1):
        printed = [int(m.group(1)) for line in lines
                   if (m := re.match(rf"\[host {host}\] step (\d+) sum 1\.0$", line))]
        assert sorted(set(printed)) == list(range(steps)), printed
    host_one = [line.removeprefix("[host 1] ") for line in lines if line.startswith("[host 1] ")]
    assert followed.splitlines() == host_one
    shown = _cli(service, "logs", job.id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == lines
    # The wide lines, 2 x WIDE_LINES x WIDE_CHARS bytes, are more than one answer holds:
    # the first says more follow, and the SDK and the CLI read them all.
    # (Each host traces the step more than once: each trace prints them again.)
    wide = {(m.group(1), int(m.group(2))) for line in lines
            if (m := re.match(rf"\[host ([01])\] wide (\d+) x{{{WIDE_CHARS}}}$", line))}
    assert wide == {(h, i) for h in "01" for i in range(WIDE_LINES)}, sorted(wide)
    with grpc.insecure_channel(service.address) as channel:
        first = channel.unary_unary(f"/{SERVICE_NAME}/GetJobLogs",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=pb.JobLogs.FromString)(
            pb.JobLogsRequest(job_id=job.id),
            metadata=(("authorization", f"Bearer {service.token}"),))
    assert first.more and 0 < len(first.lines) < len(lines), (first.more, len(first.lines))


def test_the_cli_submits_waits_lists_and_cancels(service: Service, tmp_path: Path,
                                                client: Any) -> None:
    job_file = tmp_path / "count_job.py"
    job_file.write_text(textwrap.dedent("""
        import numpy as np
        import jaxpod

        def step_fn(state, batch):
            ctx = jaxpod.get_replica_context()
            total = ctx.all_reduce("SUM", (batch * ctx.valid_row_mask).sum())
            return {"total": state["total"] + total}, {"total": state["total"] + total}

        steps = 3
        accelerator_type = "v4-8"
        initial_state = {"total": np.float32(0)}
        dataset = [np.arange(6, dtype=np.float32)]   # 6 rows over 4 replicas: padded
        outputs = {"total": "MAX"}
    """))
    submitted = _cli(service, "submit", str(job_file), "--wait", "--name", "from-cli")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    result = client.job(job_id).result()
    assert float(result.state["total"]) == 3 * np.arange(6).sum()
    listed = _cli(service, "jobs", "--state", "succeeded", "--json")
    assert listed.returncode == 0, listed.stderr
    names = {j["id"]: j["name"] for j in json.loads(listed.stdout)}
    assert names[job_id] == "from-cli"

    long = client.submit(slow_step, steps=100_000, accelerator_type="v4-8",
                         outputs={"x": "SUM"})
    assert wait_for(lambda: long.status().step > 0, 120), long.status()
    cancelled = _cli(service, "cancel", long.id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == f"{long.id}: CANCELLED"
    assert long.status().state == "CANCELLED"


def test_a_killed_service_restarted_on_its_state_dir_keeps_every_job(
        client: Any, service: Service, state_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    before = {s.id: s for s in client.jobs()}
    finished = [i for i, s in before.items() if s.done]
    assert len(finished) >= 20
    succeeded = [i for i in finished if before[i].state == "SUCCEEDED"]
    results = {i: client.job(i).result() for i in succeeded[:5]}
    histories = {i: client.job(i).history() for i in finished}
    assert all(h[0].to_state == "PENDING" and h[-1].to_state == before[i].state
               for i, h in histories.items())
    crash_service(service)
    log = tmp_path_factory.mktemp("jobs-restarted") / "serve.log"
    again = start_service(log, "v4-8", args=("--state-dir", str(state_dir)))
    try:
        with again.connect() as second:
            after = {s.id: s for s in second.jobs()}
            assert set(after) == set(before)
            for i in finished:
                b, a = before[i], after[i]
                assert (a.state, a.step, a.error, a.metrics, a.finished_at) == (
                    b.state, b.step, b.error, b.metrics, b.finished_at)
                assert second.job(i).history() == histories[i]
            for i, result in results.items():
                again_result = second.job(i).result()
                assert again_result.metrics == result.metrics
                for leaf_a, leaf_b in zip(_leaves(again_result.state), _leaves(result.state),
                                          strict=True):
                    np.testing.assert_array_equal(leaf_a, leaf_b)
        shown = _cli(again, "jobs", "--json")
        assert shown.returncode == 0, shown.stderr
        assert {j["id"] for j in json.loads(shown.stdout)} == set(before)
    finally:
        stop_service(again)


def _leaves(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    if isinstance(tree, list | tuple):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [np.asarray(tree)]
