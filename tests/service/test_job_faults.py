"""Jobs through lost hosts and preemption notices: a real ``jaxpod serve --local``.

A host worker of a running job is killed with SIGKILL (a lost host) or sent SIGTERM (a
preemption notice) by its pid, which the job's own code prints on each host. The job
must end with exactly the numbers of the same job run without interruption (compared
with ``np.array_equal``), with its attempts and lost steps recorded; exceptions in the
job's code are failures with their own budget, never retried as preemptions. A job
whose state is any pytree (a flax nnx model with its optax AdamW state, a
``flax.struct.dataclass``, a ``NamedTuple``, a typed PRNG key) resumes the same way and
returns its state as those types; one whose state cannot be returned fails at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from serve_process import Service, crash_service, start_service, stop_service

import jaxpod
from jaxpod.service.capacity.local_cluster import LocalTPUCluster
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEP_PAUSE_S = 0.01
STEPS = 48
STEPS_PER_RUN = 2
CHECKPOINT_EVERY = 8


# ------------------------------------------------------------------ the job
def print_pid() -> None:
    print(f"pid {os.getpid()}")


def pid_printing_step(state: Any, batch: Any) -> Any:
    """A deterministic, slightly slow update; every step prints its host's pid (so
    even a warm slice's workers, which trace nothing again, say who they are)."""
    import jax
    import jax.numpy as jnp

    jax.debug.callback(print_pid)

    def pause(x: Any) -> Any:
        time.sleep(STEP_PAUSE_S)
        return x

    ctx = jaxpod.get_replica_context()
    mask = ctx.valid_row_mask.astype(batch.dtype)
    total = ctx.all_reduce("SUM", (batch * mask).sum())
    w = state["w"] * 0.97 + jnp.sin(total + state["w"]) * 0.05
    w = jax.pure_callback(pause, jax.ShapeDtypeStruct(w.shape, w.dtype), w)
    return {"w": w, "n": state["n"] + 1}, {"total": total, "w0": w[0]}


#: The step in which ``hanging_step``'s host 1 stops answering (once), and for how long.
HANG_AT, HANG_S = 12, 3600
#: A loop this much longer than the slowest of its length is hung (the service's
#: JAXPOD_JOB_HANG_TIMEOUT_S).
HANG_TIMEOUT_S = 6


def hanging_step(marker: str) -> Any:
    """``pid_printing_step``, except that host 1 sleeps for good in step ``HANG_AT`` the
    first time (``marker`` says it did), as a host stuck in user code does."""

    def step(state: Any, batch: Any) -> Any:
        import jax

        def hang_once(n: Any) -> Any:
            if (jax.process_index() == 1 and int(n) == HANG_AT
                    and not os.path.exists(marker)):
                Path(marker).touch()
                time.sleep(HANG_S)
            return n

        n = jax.pure_callback(hang_once, jax.ShapeDtypeStruct(state["n"].shape,
                                                              state["n"].dtype), state["n"])
        return pid_printing_step({**state, "n": n}, batch)

    return step


class StepError(Exception):
    """Raised by the job's code on the workers."""


def raising_step(state: Any, batch: Any) -> Any:
    raise StepError("bad batch")


#: Rows of the job's input's elements (8 replicas: padded steps); more than a job
#: takes, so an element's index says where in the input it is (its infeed reads ahead,
#: into the next epoch).
ELEMENT_ROWS = (12, 12, 7) * 30


class Batches:
    """A random-access input (``__len__``/``__getitem__``, as a list of batches) that
    prints each element it reads, with its process, to the job's log."""

    def __init__(self) -> None:
        rng = np.random.default_rng(7)
        self.elements = [rng.normal(size=n).astype(np.float32) for n in ELEMENT_ROWS]

    def __len__(self) -> int:
        return len(self.elements)

    def __getitem__(self, i: int) -> np.ndarray:
        print(f"read element {i} in {os.getpid()}")
        return self.elements[i]


def dataset() -> Batches:
    return Batches()


def reads(job: Any, host: int, pid: int) -> list[int]:
    """The elements the job's input read on ``host`` in process ``pid``, in order."""
    return [int(m.group(1)) for m in re.finditer(
        rf"^\[host {host}\] read element (\d+) in {pid}$", job.logs(), re.MULTILINE)]


def element_of_row(row: int) -> int:
    """numpy: the element of the input (counted over epochs) holding global row ``row``."""
    ends = np.cumsum(ELEMENT_ROWS)
    epoch, within = divmod(row, int(ends[-1]))
    return epoch * len(ELEMENT_ROWS) + int(np.searchsorted(ends, within, side="right"))


def submit(client: Any, step: Any = pid_printing_step, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        steps=STEPS, accelerator_type="v4-16", steps_per_run=STEPS_PER_RUN,
        initial_state={"w": np.linspace(0, 1, 5).astype(np.float32), "n": np.int32(0)},
        dataset=dataset(), outputs={"total": "MAX", "w0": "MEAN"},
        checkpoint_every=CHECKPOINT_EVERY, max_retries_preemption=3,
        # The persistent tier's faults: test_memory_checkpoints.py has the memory tier's.
        memory_checkpoint_every=0)
    kwargs.update(overrides)
    return client.submit(step, **kwargs)


def host_pids(job: Any, host: int) -> list[int]:
    """The pids the job's code printed on ``host``, in order (one per attempt's trace)."""
    pids = [int(m.group(1)) for m in re.finditer(rf"^\[host {host}\] pid (\d+)$", job.logs(),
                                                  re.MULTILINE)]
    return list(dict.fromkeys(pids))


def running_past(job: Any, step: int) -> bool:
    status = job.status()
    assert not status.done, status
    return status.state == "RUNNING" and status.step >= step


def past_a_checkpoint(job: Any) -> bool:
    """Running, steps past a committed checkpoint (the hosts commit theirs in the
    background, some loops after the step)."""
    saved = job.checkpoints()
    return bool(saved) and running_past(job, saved[-1].step + 2)


def assert_goodput_adds_up(status: Any) -> dict[str, float]:
    """The categories partition the job's wall time (within 1 %); returns them."""
    figures = dict(status.goodput)
    wall, share = figures.pop("wall_s"), figures.pop("productive_share")
    assert all(v >= 0 for v in figures.values()), figures
    assert sum(figures.values()) == pytest.approx(wall)
    assert wall == pytest.approx(status.finished_at - status.created_at, rel=0.01)
    assert share == pytest.approx(figures["productive"] / wall)
    return figures


def assert_same_result(got: Any, expected: Any) -> None:
    for key in ("w", "n"):
        assert got.state[key].dtype == expected.state[key].dtype
        assert np.array_equal(got.state[key], expected.state[key]), key
    assert got.metrics == expected.metrics  # every loop's reduced outputs, redone or not
    assert got.steps == expected.steps == STEPS


# ------------------------------------------------------------------ the service
# The simulated cluster outlives the service, as a real Ray cluster outlives a crashed
# coordinator: the last test kills the service and starts another on its state dir.
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalTPUCluster]:
    # Its hosts cache every program they compile (a CPU compiles in milliseconds), so
    # a restarted attempt loads what the one before compiled.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S", "0.001")
        with LocalTPUCluster("v4-16") as running:
            yield running


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("job-faults-state")


def _start(cluster: LocalTPUCluster, state_dir: Path, log: Path) -> Service:
    return start_service(log, None, args=("--state-dir", str(state_dir)),
                         env={"JAXPOD_JOB_RETRY_BACKOFF_S": "0.2",
                              "JAXPOD_JOB_HANG_TIMEOUT_S": str(HANG_TIMEOUT_S)},
                         ray_address=cluster.address)


@pytest.fixture(scope="module")
def service(cluster: LocalTPUCluster, state_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    running = _start(cluster, state_dir, tmp_path_factory.mktemp("job-faults") / "serve.log")
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


@pytest.fixture(scope="module")
def uninterrupted(client: Any) -> Any:
    job = submit(client)
    result = job.result(timeout=300)
    status = job.status()
    assert status.attempts == 1
    figures = assert_goodput_adds_up(status)
    assert figures["productive"] > 0 and figures["lost_work"] == 0
    assert figures["recovering"] == 0
    return result


# ------------------------------------------------------------------ tests
def test_a_killed_host_is_a_preemption_and_the_job_resumes_bit_for_bit(
        client: Any, uninterrupted: Any) -> None:
    job = submit(client)
    assert wait_for(lambda: past_a_checkpoint(job), 300), job.status()
    victim = host_pids(job, 1)[-1]
    os.kill(victim, signal.SIGKILL)
    # Seen at once, though host 0 waits in a collective for the dead host 1 (until the
    # collective's own time-out, minutes): the attempt ends well before that.
    assert wait_for(lambda: job.attempts()[0].ended_at is not None, 60), job.attempts()
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert_same_result(job.result(), uninterrupted)
    assert [t.to_state for t in job.history()].count("RETRYING") == 1
    first, second = job.attempts()
    assert first.cause is not None and first.cause.startswith("preempted:")
    lost = re.search(r"(\d+) step\(s\) lost, the next attempt starts at step (\d+)",
                     first.cause)
    assert lost, first.cause
    resumed_at = int(lost.group(2))
    assert resumed_at % CHECKPOINT_EVERY == 0 and 0 < resumed_at <= first.step_reached
    assert int(lost.group(1)) == first.step_reached - resumed_at
    assert second.cause == "succeeded" and second.step_reached == STEPS
    # The step the failure named is the one resumed from: the hosts' storage had no
    # later checkpoint left to commit (a survivor can finish one its lost peer wrote).
    assert second.start_step == resumed_at, (first, second)
    for attempt in (first, second):  # each timed its first loop while it ran
        assert attempt.running_at is not None and attempt.first_step_at is not None
        assert attempt.running_at <= attempt.first_step_at <= attempt.ended_at, attempt
    assert host_pids(job, 1)[-1] != victim  # the second attempt ran on new workers
    # whose first host loaded from the compilation cache what the first attempt's
    # (or the uninterrupted job's) had compiled.
    assert first.programs_compiled is not None, first
    assert second.programs_loaded is not None and second.programs_loaded > 0, second
    # It sought its input to the checkpoint: each host's first read is the element the
    # next step starts in (steps take the first element's 12 rows), then on in order.
    first_element = element_of_row(resumed_at * ELEMENT_ROWS[0])
    for host in range(2):
        read = reads(job, host, host_pids(job, host)[-1])
        assert read == [(first_element + i) % len(ELEMENT_ROWS) for i in range(len(read))]
        assert read, job.logs()[-3000:]
    figures = assert_goodput_adds_up(final)
    if int(lost.group(1)) > 0:  # killed right as a checkpoint committed, none is lost
        assert figures["lost_work"] > 0, (figures, first.cause)
    assert figures["recovering"] > 0
    assert figures["allocating"] > 0 and figures["productive"] > 0


def test_a_preemption_notice_checkpoints_at_once_and_loses_no_step(
        client: Any, uninterrupted: Any) -> None:
    job = submit(client, checkpoint_every=None)  # no periodic checkpoints at all
    assert wait_for(lambda: running_past(job, 6), 300), job.status()
    os.kill(host_pids(job, 0)[-1], signal.SIGTERM)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert_same_result(job.result(), uninterrupted)
    first, _ = job.attempts()
    assert first.cause is not None and "preemption notice" in first.cause
    assert "0 step(s) lost" in first.cause
    assert f"starts at step {first.step_reached}" in first.cause


def test_a_hung_host_is_shown_with_its_stacks_and_the_job_restarts_bit_for_bit(
        client: Any, uninterrupted: Any, tmp_path: Path) -> None:
    job = submit(client, step=hanging_step(str(tmp_path / "hung")))
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert (tmp_path / "hung").exists()  # it did hang, once
    assert_same_result(job.result(), uninterrupted)
    first, second = job.attempts()
    assert first.step_reached <= HANG_AT < second.step_reached == STEPS
    assert "HungLoopError" in (first.cause or ""), first
    logs = job.logs()
    said = re.search(r"^\[host 1\] \[jaxpod\] the loop from step (\d+) ran past ([\d.]+) s "
                     r"\(the slowest loop of its length \+ JAXPOD_JOB_HANG_TIMEOUT_S\) and "
                     r"is taken as hung", logs, re.M)
    assert said, logs[-3000:]
    assert int(said.group(1)) <= HANG_AT and float(said.group(2)) >= HANG_TIMEOUT_S
    # Host 1's stacks, read before its worker was killed, end in the sleeping frame.
    host_1 = "\n".join(line.removeprefix("[host 1] ") for line in logs.splitlines()
                       if line.startswith("[host 1] "))
    assert re.search(r"in hang_once\n(thread|\[jaxpod\]|pid |read element|$)", host_1,
                     re.M), host_1[-3000:]


def test_a_raising_step_is_a_failure_with_its_own_budget(client: Any) -> None:
    job = client.submit(raising_step, steps=4, accelerator_type="v4-16",
                        dataset=dataset(), max_retries_failure=1, max_retries_preemption=5)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "FAILED" and "StepError: bad batch" in final.error
    attempts = job.attempts()
    assert len(attempts) == 2  # max_retries_failure + 1, never as a preemption
    assert all(a.cause is not None and a.cause.startswith("failed: StepError")
               for a in attempts)


def test_more_preemptions_than_the_budget_fail_the_job(client: Any) -> None:
    job = submit(client, max_retries_preemption=1, checkpoint_every=None)
    killed: list[int] = []
    for _ in range(2):
        assert wait_for(lambda: running_past(job, 4)
                        and host_pids(job, 1)[-1] not in killed, 300), job.status()
        killed.append(host_pids(job, 1)[-1])
        os.kill(killed[-1], signal.SIGKILL)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "FAILED"
    assert "preempted 2 times, more than max_retries_preemption=1" in final.error
    assert len(job.attempts()) == 2
    with pytest.raises(jaxpod.JobFailedError, match="max_retries_preemption"):
        job.result()


# ------------------------------------------------------------------ checkpoints
GRAIN_ELEMENTS = 400  # per host; more than a job reads


def grain_pipeline(context: Any) -> Any:
    """Each host's own pipeline: a grain ``IterDataset`` (its iterators save and restore
    their state) that prints each element it reads."""
    import grain

    def read(i: int) -> np.ndarray:
        print(f"read element {i} in {os.getpid()}")
        rng = np.random.default_rng(1000 * context.input_pipeline_id + i)
        return rng.normal(size=3).astype(np.float32)

    return grain.MapDataset.range(GRAIN_ELEMENTS).map(read).to_iter_dataset(
        grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))


def test_a_grain_pipeline_resumes_from_its_saved_state_bit_for_bit(client: Any) -> None:
    kwargs = dict(dataset=None, dataset_fn=grain_pipeline)
    uninterrupted = submit(client, **kwargs).result(timeout=300)
    job = submit(client, **kwargs)
    assert wait_for(lambda: past_a_checkpoint(job), 300), job.status()
    os.kill(host_pids(job, 1)[-1], signal.SIGKILL)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert_same_result(job.result(), uninterrupted)
    first = job.attempts()[0]
    lost = re.search(r"the next attempt starts at step (\d+)", first.cause or "")
    assert lost, first.cause
    # 4 replicas per host take one element each per step; grain reads ahead on its
    # thread, never behind: the new workers' first element is the next step's.
    consumed = int(lost.group(1)) * 4
    assert consumed > 0
    for host in range(2):
        read = reads(job, host, host_pids(job, host)[-1])
        assert read and min(read) == consumed and consumed in read, (consumed, read)


#: The checkpoint step whose commit the first attempt's hosts never make.
HELD_STEP = 2 * CHECKPOINT_EVERY


def holding_init() -> dict[str, Any]:
    """The job's state, made on hosts that will never finalize checkpoint HELD_STEP
    (or later): each host's orbax writes its files, then waits forever where it would
    commit them, as a host does that dies in the middle of a save. A resumed attempt
    restores its state, so its fresh workers never run this."""
    import asyncio

    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = self._final_path.name
        if name.isdigit() and int(name) >= HELD_STEP:
            await asyncio.to_thread(threading.Event().wait)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = held
    return {"w": jnp.linspace(0, 1, 5, dtype=jnp.float32), "n": jnp.int32(0)}


def test_a_host_killed_mid_save_leaves_the_previous_checkpoint(
        client: Any, uninterrupted: Any, state_dir: Path) -> None:
    job = submit(client, initial_state=None, init_fn=holding_init)
    folder = state_dir / "checkpoints" / job.id

    def committed() -> list[int]:  # on storage: the runner records commits as it polls
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())

    def held() -> bool:  # its files are there, uncommitted, and the job is past them
        partial = list(folder.glob(f"{HELD_STEP}.orbax-checkpoint-tmp*"))
        return bool(partial) and running_past(job, HELD_STEP + 2) and bool(host_pids(job, 1))

    try:
        assert wait_for(held, 300), (job.status(), job.logs()[-2000:])
        assert committed() == [CHECKPOINT_EVERY]
        os.kill(host_pids(job, 1)[-1], signal.SIGKILL)
        final = job.wait(timeout=300, progress=False)
    finally:  # a held job would keep the slice from the tests after this one
        if not job.status().done:
            for pid in host_pids(job, 1)[-1:]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert final.state == "SUCCEEDED", final.error
    assert_same_result(job.result(), uninterrupted)
    first = job.attempts()[0]
    assert first.cause is not None and first.cause.startswith("preempted:")
    assert f"the next attempt starts at step {CHECKPOINT_EVERY}" in first.cause


# ------------------------------------------------------------------ pytree states
_GRAPHDEF, _PARAMS = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
_ADAMW = optax.adamw(0.05, weight_decay=0.01)


class Moments(NamedTuple):
    seen: Any
    last_loss: Any


@flax.struct.dataclass
class Noise:
    total: Any
    scale: float = flax.struct.field(pytree_node=False, default=0.5)


def pytree_init() -> dict[str, Any]:
    return {"params": _PARAMS, "opt": _ADAMW.init(_PARAMS), "key": jax.random.key(5),
            "noise": Noise(jnp.zeros(())), "moments": Moments(jnp.zeros((), jnp.int32),
                                                              jnp.zeros(()))}


def pytree_step(state: dict[str, Any], batch: Any) -> Any:
    """AdamW on the real rows of the global batch, a key split per step, and a
    dataclass and a NamedTuple carried along; prints the host's pid, as above."""
    jax.debug.callback(print_pid)
    ctx = jaxpod.get_replica_context()
    x, y = batch["x"], batch["y"]
    mask = ctx.valid_row_mask.astype(x.dtype)[:, None]
    count = ctx.all_reduce("SUM", mask.sum())

    def loss(params: Any) -> Any:
        return jnp.sum((nnx.merge(_GRAPHDEF, params)(x) - y) ** 2 * mask) / count

    value, grads = jax.value_and_grad(loss)(state["params"])
    grads, value = ctx.all_reduce("SUM", grads), ctx.all_reduce("SUM", value)
    updates, opt = _ADAMW.update(grads, state["opt"], state["params"])
    key, draw = jax.random.split(state["key"])
    noise = state["noise"]
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
            "key": key,
            "noise": noise.replace(total=noise.total + noise.scale * jax.random.uniform(draw)),
            "moments": Moments(state["moments"].seen + 1, value)}, {"loss": value}


def pytree_dataset() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for n in (16, 16, 11):  # 8 replicas: the last batch pads
        x = rng.normal(size=(n, 3)).astype(np.float32)
        out.append({"x": x, "y": (x @ np.array([[1.0, 0.5], [-1.0, 2.0], [0.0, 1.0]],
                                               np.float32)).astype(np.float32)})
    return out


def submit_pytree_job(client: Any) -> Any:
    return client.submit(pytree_step, steps=STEPS, accelerator_type="v4-16",
                         steps_per_run=STEPS_PER_RUN, init_fn=pytree_init,
                         dataset=pytree_dataset(), outputs={"loss": "MEAN"},
                         checkpoint_every=CHECKPOINT_EVERY, max_retries_preemption=3,
                         memory_checkpoint_every=0)


def assert_pytree_state(state: Any) -> None:
    assert type(state["params"]) is nnx.State
    assert type(state["opt"][0]) is optax.ScaleByAdamState
    assert type(state["noise"]) is Noise and state["noise"].scale == 0.5
    assert type(state["moments"]) is Moments and int(state["moments"].seen) == STEPS
    assert jax.dtypes.issubdtype(state["key"].dtype, jax.dtypes.prng_key)


def in_process_pytree_state() -> Any:
    """The same job on the in-process strategy over this process's 8 devices."""
    strategy = jaxpod.TPUStrategy()
    batches = pytree_dataset()
    dataset = strategy.experimental_distribute_dataset(batches * STEPS)  # rows cross batches
    state, _ = strategy.run_steps(pytree_step, iter(dataset), STEPS,
                                  initial_state=strategy.run(pytree_init))
    return strategy.experimental_local_results(state)[0]


def test_a_pytree_state_resumes_bit_for_bit_and_comes_back_as_its_types(
        client: Any) -> None:
    uninterrupted = submit_pytree_job(client).result(timeout=300)
    assert_pytree_state(uninterrupted.state)
    assert uninterrupted.note is None
    job = submit_pytree_job(client)
    assert wait_for(lambda: past_a_checkpoint(job), 300), job.status()
    os.kill(host_pids(job, 1)[-1], signal.SIGKILL)
    final = job.wait(timeout=300, progress=False)
    assert final.state == "SUCCEEDED", final.error
    assert final.attempts == 2
    resumed = job.result()
    assert_pytree_state(resumed.state)
    got, want = jax.tree.leaves(resumed.state), jax.tree.leaves(uninterrupted.state)
    assert jax.tree.structure(resumed.state) == jax.tree.structure(uninterrupted.state)
    for g, w in zip(got, want, strict=True):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        assert np.array_equal(np.asarray(g), np.asarray(w))
    assert resumed.metrics == uninterrupted.metrics
    # The same numbers as the in-process strategy's (summation orders differ).
    local = in_process_pytree_state()
    for g, w in zip(got, jax.tree.leaves(local), strict=True):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@jax.tree_util.register_pytree_node_class
class Guarded:
    """A pytree whose auxiliary data holds a lock: it cannot leave its process."""

    def __init__(self, x: Any, lock: Any) -> None:
        self.x, self.lock = x, lock

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.x,), self.lock

    @classmethod
    def tree_unflatten(cls, lock: Any, children: Any) -> Guarded:
        return cls(children[0], lock)


def guarded_init() -> Guarded:
    return Guarded(jnp.zeros(2), threading.Lock())  # made on the hosts


def test_a_state_that_cannot_be_returned_fails_before_the_first_step(client: Any) -> None:
    job = client.submit(lambda state, batch: (state, {}), steps=1000, init_fn=guarded_init,
                        accelerator_type="v4-16", dataset=dataset())
    final = job.wait(timeout=300, progress=False)
    assert final.state == "FAILED" and final.step == 0, final
    first_line = final.error.splitlines()[0]
    assert first_line.startswith("TypeError: ") and "Guarded cannot be sent" in first_line
    assert "must pickle" in first_line
    assert len(job.attempts()) == 1


# ------------------------------------------------------------------ last: it kills the service
def test_a_killed_coordinator_restarted_on_its_state_dir_resumes_the_job(
        client: Any, service: Service, cluster: LocalTPUCluster, state_dir: Path,
        uninterrupted: Any, tmp_path: Path) -> None:
    job = submit(client)
    assert wait_for(lambda: past_a_checkpoint(job), 300), job.status()
    first_pids = {host_pids(job, h)[-1] for h in range(2)}
    crash_service(service)  # SIGKILL: no checkpoint on the way out, no release
    again = _start(cluster, state_dir, tmp_path / "restarted.log")
    try:
        with again.connect() as second:
            resumed = second.job(job.id)
            final = resumed.wait(timeout=300, progress=False)
            assert final.state == "SUCCEEDED", final.error
            assert_same_result(resumed.result(), uninterrupted)
            history = resumed.history()
            restart = [t for t in history if t.reason == "coordinator restarted"]
            assert [(t.from_state, t.to_state) for t in restart] == [("RUNNING", "RETRYING")]
            resumed_at = [t.reason for t in history if t.to_state == "RUNNING"][-1]
            assert re.fullmatch(r"resuming from the checkpoint at step \d+", resumed_at)
            first, second_attempt = resumed.attempts()
            assert first.cause == "coordinator restarted"
            assert second_attempt.cause == "succeeded"
            assert_goodput_adds_up(final)
            # Nothing of the dead coordinator is left: its workers are gone, and the
            # cluster's only v4-16 was allocated again (a leaked placement group
            # would have kept the job waiting for a free slice).
            assert not {host_pids(resumed, h)[-1] for h in range(2)} & first_pids
            assert wait_for(lambda: not any(_alive(p) for p in first_pids), 60)
    finally:
        stop_service(again)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
