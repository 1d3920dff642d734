"""Jobs on warm slices, re-acquire of a released slice, and Ray Train's ``JaxTrainer``.

Everything runs in one run on one simulated local TPU cluster (``LocalTPUCluster``:
one v4-16, 2 hosts x 4 chips, JAX on CPU with one virtual device per chip) that this
script starts and stops itself. A real ``jaxpod serve`` process (the same service as
``jaxpod serve --local``, told to join this cluster through ``RAY_ADDRESS``; its own
token and a temporary ``JAXPOD_STATE_DIR``) serves the jaxpod figures; this process is
the client (real gRPC on loopback) and, for the peer, a Ray driver of the same cluster.

The job everybody runs: one step of a trivial data-parallel program, the mean of one
global batch of 64 rows split over all 8 replicas of both hosts
(``step_fn(state, batch) -> (state + 1, {"loss": mean(batch)})``, ``steps=1``,
``dataset=[batch]``, ``outputs={"loss": "MEAN"}``); every result is checked (31.5).

Figures (``*_p50``: medians):

1. ``submit_to_first_step_ms_p50`` (target <= 30): p50 over 20 jobs (8 with
   ``--quick``) on a warm slice, submitted one after another (each after the previous
   finished), after one warm-up job of the same function (so the slice is warm and the
   step compiled). Measured as the job's own record on the service's clock: its
   attempt's ``first_step_at`` (its first loop of steps done and recorded) minus its
   ``created_at``. ``submit_to_finished_ms_p50`` is ``finished_at - created_at``: the
   one step, then the job's end, whose final state is committed to storage by the
   hosts as an orbax checkpoint before the job is ``SUCCEEDED`` (its result).
   Also, as separate figures: ``submit_to_wait_ms_p50``, the client-observed time
   from calling ``client.submit(...)`` to ``job.wait()`` returning (what a user
   sees), and ``submit_call_ms_p50``, ``client.submit`` alone; the job record split
   at ``started_at`` (``job_created_to_started_ms_p50``: queued and given the slice;
   ``job_started_to_finished_ms_p50``: running); ``first_job_s`` is the warm-up job
   (ships and compiles the function).
2. ``reacquire_ms_p50`` (target < 50): ``client.strategy(accelerator_type=...)`` and
   entering it, on a slice type whose previous strategy was closed (the slice is kept
   warm), p50 over 10 rounds (5 with ``--quick``); each round then runs one trivial
   ``run`` + ``reduce`` (checked), then closes the strategy. ``first_acquire_s`` is the
   cold acquire (allocation, worker start, ``jax.distributed``);
   ``reacquire_to_first_result_ms_p50`` includes that trivial run; ``release_ms_p50``
   is ``close()``.
3. ``jobs_per_minute``: 50 jobs (20 with ``--quick``) submitted back to back without
   waiting, from the first ``submit`` call to the last job seen finished by the client;
   ``burst_service_span_s`` is the same on the service's clock (first ``created_at`` to
   last ``finished_at``); ``burst_in_submission_order`` whether they finished in order.
4. The peer, Ray Train's ``JaxTrainer`` (``ray.train.v2.jax``) on the same simulated
   hosts: ``ScalingConfig(use_tpu=True, num_workers=2, topology="2x2x2",
   accelerator_type="TPU-V4")``, exactly as for a real v4-16. It reserves the slice
   through Ray's ``SlicePlacementGroup`` on the TPU resources and labels the simulated
   hosts advertise, and its JAX backend runs ``jax.distributed.initialize`` on the
   workers; the hosts set ``JAX_PLATFORMS=cpu``, so JAX runs on CPU (the train
   function selects gloo for cross-process collectives before first using JAX, as
   jaxpod's workers do). The train function computes the same mean over the same
   global array sharded over all 8 devices, rank 0 records it (checked) and every
   worker calls ``ray.train.report``. ``jaxtrainer_first_fit_s`` is the first
   ``fit()`` on the fresh cluster; ``jaxtrainer_fit_s`` the median of the next 3 (1
   with ``--quick``), on the then warm Ray cluster (each fit starts its own workers:
   that is how JaxTrainer runs); ``jaxtrainer_to_train_fn_s`` the median time from
   ``fit()`` until the train function started on rank 0.
   ``jaxtrainer_vs_jaxpod_job`` = ``jaxtrainer_fit_s`` / ``submit_to_wait_ms_p50``
   (both: one trivial 1-step job, warm cluster, submission to result in hand).
5. ``goodput``: one longer job (a data-parallel linear regression, 600 steps, 200 with
   ``--quick``, one step per loop, its loss a declared output) on the warm slice.
   ``long_job_steps_per_s`` is the service's figure (steps over the wall time of the
   attempt that ran them, what the page and the CLI show), ``long_job_client_steps_per_s``
   steps over the client's submit-to-done time; ``long_job_goodput_shares`` the share of
   the job's wall time in each goodput category, and ``long_job_other_share`` the share
   no category claimed (target < 0.05: where the time goes is named).

The peer runs first, on the fresh cluster, before the service exists: a released
jaxpod slice stays warm and keeps its hosts' TPU resources, so the two cannot share
the slice by turns, and running them sequentially keeps either from loading the
machine while the other is timed. ``JaxTrainer`` needs ``ray[train]`` (pandas,
pyarrow, fsspec, tensorboardX) in the environment that runs the cluster.

The last line of output is the JSON report.

Usage: ``python benchmarks/jobs.py [--quick] [--parts peer,reacquire,jobs]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import kept_log_on_failure, log_tail, parse_parts, report, stop_process, target

ACCELERATOR = "v4-16"
ROWS = 64  # rows of the one global batch: 8 per replica on a v4-16
EXPECTED_LOSS = (ROWS - 1) / 2  # mean of 0..63
SUBMIT_TARGET_MS = 30.0
REACQUIRE_TARGET_MS = 50.0
SERVICE_START_S = 300.0
SERVICE_STOP_S = 60.0
PARTS = ("peer", "reacquire", "jobs", "goodput")
OTHER_SHARE_TARGET = 0.05


# ------------------------------------------------------------- the trivial job
def batch() -> Any:
    import numpy as np

    return np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1)


def trivial_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """The job's step: counts steps, reports the mean of this replica's rows."""
    import jax.numpy as jnp

    return state + 1, {"loss": jnp.mean(batch)}


def regression_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """One SGD step of ``y ~ x @ w`` over the global batch (the long job)."""
    import jaxpod

    ctx = jaxpod.get_replica_context()
    x, y = batch[:, :-1], batch[:, -1]
    err = x @ state - y
    grad = ctx.all_reduce("MEAN", x.T @ err / x.shape[0])
    return state - 0.01 * grad, {"loss": err ** 2}


def regression_batches() -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(8):
        x = rng.normal(size=(ROWS, 32)).astype(np.float32)
        out.append(np.concatenate([x, x[:, :1] * 2.0], axis=1))
    return out


def add_one(x: Any) -> Any:
    return x + 1


def jaxtrainer_loop(config: dict[str, Any]) -> None:
    """The same step under ``JaxTrainer``: the mean of one global batch sharded over
    every device of every host; rank 0 writes it (and what JAX saw) to ``config["out"]``.

    Self-contained: Ray ships it by value (this script is ``__main__``).
    """
    import time as clock

    entered = clock.time()
    import jax

    # Cross-process collectives on CPU need gloo; set before JAX first uses its backend
    # (the JAX backend of Ray Train only ran jax.distributed.initialize).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import json as js

    import jax.numpy as jnp
    import numpy as np
    import ray.train
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rows = config["rows"]
    data = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("replica",)),
                             PartitionSpec("replica"))
    x = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    loss = float(jax.jit(jnp.mean)(x))
    if jax.process_index() == 0:
        with open(config["out"], "w") as f:
            js.dump({"loss": loss, "processes": jax.process_count(),
                     "devices": jax.device_count(), "entered": entered,
                     "done": clock.time()}, f)
    ray.train.report({"loss": loss})


# --------------------------------------------------------------- the peer part
def ray_accelerator_type(accelerator: str) -> str:
    """Ray's accelerator type for a TPU type: ``v4-16`` -> ``TPU-V4``."""
    return "TPU-" + accelerator.split("-")[0].upper()


def measure_jaxtrainer(cluster: Any, accelerator: str, fits: int) -> dict[str, Any]:
    """``1 + fits`` ``JaxTrainer.fit()`` runs on ``cluster``; times and checks them."""
    import ray

    from jaxpod.service.capacity.topology import slice_shape

    shape = slice_shape(accelerator)
    cluster.connect()
    storage = tempfile.mkdtemp(prefix="jaxpod-bench-raytrain-")
    times: list[float] = []
    to_train_fn: list[float] = []
    try:
        from ray.train.v2.api.config import RunConfig, ScalingConfig
        from ray.train.v2.jax import JaxTrainer

        for i in range(1 + fits):
            out = os.path.join(storage, f"fit-{i}.json")
            started_wall = time.time()
            start = time.perf_counter()
            result = JaxTrainer(
                jaxtrainer_loop,
                train_loop_config={"out": out, "rows": ROWS},
                scaling_config=ScalingConfig(
                    use_tpu=True, num_workers=shape.num_hosts, topology=shape.topology,
                    accelerator_type=ray_accelerator_type(accelerator)),
                run_config=RunConfig(name=f"jaxpod-bench-{i}", storage_path=storage),
            ).fit()
            elapsed = time.perf_counter() - start
            if result.error is not None:
                raise RuntimeError(f"JaxTrainer.fit() failed: {result.error!r}")
            with open(out) as f:
                seen = json.load(f)
            if (abs(seen["loss"] - EXPECTED_LOSS) > 1e-4 or seen["processes"] != shape.num_hosts
                    or seen["devices"] != shape.num_devices):
                raise RuntimeError(f"JaxTrainer computed {seen}; expected loss "
                                   f"{EXPECTED_LOSS} on {shape.num_hosts} processes, "
                                   f"{shape.num_devices} devices")
            times.append(elapsed)
            to_train_fn.append(seen["entered"] - started_wall)
            print(f"JaxTrainer.fit() {i}: {elapsed:.2f} s (train function started after "
                  f"{to_train_fn[-1]:.2f} s)", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    return {"jaxtrainer_first_fit_s": times[0],
            "jaxtrainer_fit_s": statistics.median(times[1:]),
            "jaxtrainer_fit_s_all": times[1:],
            "jaxtrainer_to_train_fn_s": statistics.median(to_train_fn[1:]),
            "jaxtrainer_fits": fits}


# --------------------------------------------------------------------- service
class Service:
    """A ``jaxpod serve`` process joined to a running Ray cluster."""

    def __init__(self, ray_address: str, log_path: str, state_dir: str | None = None,
                 token: str | None = None) -> None:
        """``state_dir``, ``token``: a service restarted on another's (the caller then
        removes the folder); by default its own, removed when it stops."""
        self.token = token or secrets.token_hex(16)
        self._own_state_dir = state_dir is None
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="jaxpod-bench-state-")
        self.log_path = log_path
        env = {**os.environ, "RAY_ADDRESS": ray_address, "JAXPOD_TOKEN": self.token,
               "JAXPOD_STATE_DIR": self.state_dir,
               # the simulated cluster listens on 127.0.0.1 only
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("JAXPOD_ADDRESS", None)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jaxpod.cli", "serve", "--port", "0", "--http-port", "0",
                 "--stop-on-stdin-eof"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                start_new_session=True)
        try:
            self.address = self._read_address(SERVICE_START_S)
            self._wait_serving(SERVICE_START_S)
        except BaseException:
            self.stop()
            raise

    def _read_address(self, timeout_s: float) -> str:
        from jaxpod.client.embedded import read_announcement
        from jaxpod.timeouts import Deadline

        announced = read_announcement(self.process, Deadline(timeout_s))
        if announced is None:
            raise RuntimeError(f"jaxpod serve did not start listening:\n{self.log_tail()}")
        return str(announced["address"])

    def _wait_serving(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and self.process.poll() is None:
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.2)
        raise RuntimeError(f"jaxpod serve did not become ready:\n{self.log_tail()}")

    def log_tail(self, limit: int = 4000) -> str:
        return log_tail(self.log_path, limit)

    def stop(self) -> None:
        """SIGTERM (graceful: slices released, warm workers stopped), then kill."""
        stop_process(self.process, SERVICE_STOP_S)
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def crash(self) -> None:
        """SIGKILL, as a coordinator dies: nothing released, the state dir kept."""
        self.process.kill()
        self.process.wait(SERVICE_STOP_S)


@contextlib.contextmanager
def running_service(ray_address: str, benchmark: str = "jobs") -> Iterator[Service]:
    """A ``jaxpod serve`` on the cluster for the ``with`` block; its log is printed and
    kept when the block fails, else removed."""
    log_path = os.path.join(tempfile.gettempdir(),
                            f"jaxpod-bench-{benchmark}-{os.getpid()}.log")
    start = time.perf_counter()
    service = Service(ray_address, log_path)
    print(f"jaxpod serve ready at {service.address} in {time.perf_counter() - start:.1f} s "
          f"(log {log_path})", flush=True)
    with kept_log_on_failure(service, log_path):
        yield service


# ----------------------------------------------------------------- the jaxpod part
def ms(seconds: float) -> float:
    return seconds * 1e3


def measure_reacquire(client: Any, accelerator: str, rounds: int) -> dict[str, Any]:
    """The cold acquire, then ``rounds`` re-acquires of the released (warm) slice."""
    import numpy as np

    x = np.arange(4, dtype=np.float32)

    def one_round() -> tuple[float, float, float]:
        start = time.perf_counter()
        with client.strategy(accelerator_type=accelerator) as strategy:
            acquired = time.perf_counter()
            total = strategy.reduce("SUM", strategy.run(add_one, args=(x,)), axis=None)
            first_result = time.perf_counter()
            replicas = strategy.num_replicas_in_sync
            np.testing.assert_allclose(np.asarray(total), replicas * (x + 1))
            closing = time.perf_counter()
        closed = time.perf_counter()
        return acquired - start, first_result - start, closed - closing

    first = one_round()
    print(f"first acquire (cold) {first[0]:.2f} s", flush=True)
    rows = [one_round() for _ in range(rounds)]
    acquire, to_result, release = (list(column) for column in zip(*rows, strict=True))
    print("re-acquire ms: " + ", ".join(f"{ms(t):.1f}" for t in acquire), flush=True)
    return {"first_acquire_s": first[0],
            "reacquire_ms_p50": ms(statistics.median(acquire)),
            "reacquire_ms_max": ms(max(acquire)),
            "reacquire_to_first_result_ms_p50": ms(statistics.median(to_result)),
            "release_ms_p50": ms(statistics.median(release)),
            "reacquire_rounds": rounds}


def submit(client: Any, accelerator: str, name: str) -> Any:
    import numpy as np

    return client.submit(trivial_step, steps=1, accelerator_type=accelerator,
                         initial_state=np.float32(0), dataset=[batch()],
                         outputs={"loss": "MEAN"}, name=name)


def check_result(job: Any) -> None:
    result = job.result()
    loss = float(result.outputs["loss"])
    if abs(loss - EXPECTED_LOSS) > 1e-4 or float(result.state) != 1.0:
        raise RuntimeError(f"job {job.id}: loss {loss}, state {result.state}; expected "
                           f"{EXPECTED_LOSS} and 1.0")


def check_succeeded(status: Any) -> None:
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"job {status.id} ended {status.state}: {status.error}")


def measure_jobs(client: Any, accelerator: str, sequential: int, burst: int
                 ) -> dict[str, Any]:
    """The warm-up job, ``sequential`` jobs one after another, then ``burst`` at once."""
    start = time.perf_counter()
    warmup = submit(client, accelerator, "bench-warmup")
    check_succeeded(warmup.wait(progress=False))
    first_job_s = time.perf_counter() - start
    check_result(warmup)
    print(f"first job (ships and compiles the step) {first_job_s:.2f} s", flush=True)

    record, first_step, observed, submit_call, to_start, to_finish = [], [], [], [], [], []
    for i in range(sequential):
        start = time.perf_counter()
        job = submit(client, accelerator, f"bench-seq-{i}")
        submitted = time.perf_counter()
        status = job.wait(progress=False)
        done = time.perf_counter()
        check_succeeded(status)
        record.append(status.finished_at - status.created_at)
        first_step.append(job.details().attempts[-1].first_step_at - status.created_at)
        to_start.append(status.started_at - status.created_at)
        to_finish.append(status.finished_at - status.started_at)
        observed.append(done - start)
        submit_call.append(submitted - start)
    check_result(job)
    print("job record (first step - created_at) ms: "
          + ", ".join(f"{ms(t):.1f}" for t in first_step), flush=True)
    print("job record (finished_at - created_at) ms: "
          + ", ".join(f"{ms(t):.1f}" for t in record), flush=True)
    print("submit -> wait() ms: " + ", ".join(f"{ms(t):.1f}" for t in observed), flush=True)

    start = time.perf_counter()
    jobs = [submit(client, accelerator, f"bench-burst-{i}") for i in range(burst)]
    statuses = [job.wait(progress=False) for job in jobs]
    burst_s = time.perf_counter() - start
    for status in statuses:
        check_succeeded(status)
    check_result(jobs[-1])
    finished = [s.finished_at for s in statuses]
    span = max(finished) - min(s.created_at for s in statuses)
    print(f"{burst} jobs at once: {burst_s:.2f} s, {60 * burst / burst_s:.1f} jobs/min",
          flush=True)
    return {"first_job_s": first_job_s,
            "submit_to_first_step_ms_p50": ms(statistics.median(first_step)),
            "submit_to_first_step_ms_max": ms(max(first_step)),
            "submit_to_finished_ms_p50": ms(statistics.median(record)),
            "job_created_to_started_ms_p50": ms(statistics.median(to_start)),
            "job_started_to_finished_ms_p50": ms(statistics.median(to_finish)),
            "submit_to_wait_ms_p50": ms(statistics.median(observed)),
            "submit_call_ms_p50": ms(statistics.median(submit_call)),
            "sequential_jobs": sequential,
            "jobs_per_minute": 60 * burst / burst_s,
            "burst_jobs": burst, "burst_s": burst_s, "burst_service_span_s": span,
            "burst_in_submission_order": finished == sorted(finished)}


def measure_goodput(client: Any, accelerator: str, steps: int) -> dict[str, Any]:
    """One longer job: its step rate by wall time and where its wall time went."""
    import numpy as np

    start = time.perf_counter()
    job = client.submit(regression_step, steps=steps, accelerator_type=accelerator,
                        initial_state=np.zeros(32, np.float32), dataset=regression_batches(),
                        outputs={"loss": "MEAN"}, name="bench-long")
    status = job.wait(progress=False)
    client_s = time.perf_counter() - start
    check_succeeded(status)
    if not np.all(np.isfinite(job.result().state)):
        raise RuntimeError("the long job's state is not finite")
    goodput = dict(status.goodput or {})
    wall = goodput.pop("wall_s")
    goodput.pop("productive_share")
    shares = {k: round(v / wall, 4) for k, v in sorted(goodput.items()) if v / wall >= 1e-4}
    print(f"long job: {steps} steps, {status.steps_per_s:.1f} steps/s (service), "
          f"{steps / client_s:.1f} steps/s (client); goodput "
          + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()), flush=True)
    return {"long_job_steps": steps, "long_job_steps_per_s": status.steps_per_s,
            "long_job_client_steps_per_s": steps / client_s,
            "long_job_goodput_shares": shares,
            "long_job_other_share": goodput.get("other", 0.0) / wall}


# ------------------------------------------------------------------------ main
def rounded(figures: dict[str, Any]) -> dict[str, Any]:
    def one(v: Any) -> Any:
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, list):
            return [one(x) for x in v]
        return v

    return {k: one(v) for k, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_parts(parser, PARTS)
    parts = args.parts
    fits = 1 if args.quick else 3
    rounds = 5 if args.quick else 10
    sequential = 8 if args.quick else 20
    burst = 20 if args.quick else 50

    if "peer" in parts:
        try:
            import ray.train.v2.jax  # noqa: F401 (checked before anything starts)
        except ImportError as e:
            sys.exit(f"The peer (Ray Train's JaxTrainer) needs ray[train]: {e}. Install it "
                     f"(pip install 'ray[train]'), or leave it out: --parts reacquire,jobs")
    from jaxpod.service.capacity.local_cluster import LocalTPUCluster

    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "cores": os.cpu_count()}
    start = time.perf_counter()
    with LocalTPUCluster(ACCELERATOR) as cluster:
        figures["cluster_start_s"] = time.perf_counter() - start
        print(f"simulated {ACCELERATOR} up in {figures['cluster_start_s']:.1f} s "
              f"({cluster.address})", flush=True)
        if "peer" in parts:
            figures.update(measure_jaxtrainer(cluster, ACCELERATOR, fits))
        if parts & {"reacquire", "jobs", "goodput"}:
            import jaxpod

            with running_service(cluster.address) as service, \
                    jaxpod.connect(service.address, token=service.token) as client:
                if "reacquire" in parts:
                    figures.update(measure_reacquire(client, ACCELERATOR, rounds))
                if "jobs" in parts:
                    figures.update(measure_jobs(client, ACCELERATOR, sequential, burst))
                if "goodput" in parts:
                    figures.update(measure_goodput(client, ACCELERATOR,
                                                   200 if args.quick else 600))

    targets: dict[str, Any] = {}
    if "jobs" in parts:
        targets["submit_to_first_step_ms_p50"] = target(
            figures["submit_to_first_step_ms_p50"], "<=", SUBMIT_TARGET_MS)
    if "reacquire" in parts:
        targets["reacquire_ms_p50"] = target(
            figures["reacquire_ms_p50"], "<", REACQUIRE_TARGET_MS)
    if "goodput" in parts:
        targets["long_job_other_share"] = target(
            figures["long_job_other_share"], "<", OTHER_SHARE_TARGET)
    if {"peer", "jobs"} <= parts:
        figures["jaxtrainer_vs_jaxpod_job"] = (
            figures["jaxtrainer_fit_s"] / (figures["submit_to_wait_ms_p50"] / 1e3))
    report("jobs", rounded(figures), targets)


if __name__ == "__main__":
    main()
