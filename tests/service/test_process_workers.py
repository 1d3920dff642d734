"""Host workers as plain processes of this machine, started without Ray.

A simulated v4-16 (2 hosts x 4 chips) whose workers ``ProcessWorkers`` starts: real
multi-process JAX over gloo, the same operation channels and ``GroupEngine`` as Ray
actors get. Answers are compared with numpy; fault tests kill real processes by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from process_hosts import start_process_group
from serve_process import all_gone, kill_service, start_service

import jaxpod
from jaxpod.errors import (
    AllocationCancelledError,
    AllocationTimeoutError,
    SliceResetError,
    WorkerLostError,
    WorkerStartError,
)
from jaxpod.operations import HandleInfo
from jaxpod.service.capacity.local_cluster import descendants
from jaxpod.service.capacity.process_hosts import ProcessWorkers, prewarm_type, start_ahead
from jaxpod.service.capacity.process_slices import LocalProcessSlices
from jaxpod.service.capacity.requests import SliceRequest
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.group_results import ResultCall
from jaxpod.service.slices.held import HeldSlice
from jaxpod.service.slices.replica_group import ID_BLOCK, HostPlacement, ReplicaGroup
from jaxpod.shipping import ship
from jaxpod.timeouts import Cancel, wait_for

DEVICES_PER_HOST = 4


@pytest.fixture(scope="module")
def group(process_group: GroupEngine) -> GroupEngine:
    return process_group


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_are_this_machines_processes_with_their_hosts_env(
        group: GroupEngine) -> None:
    info = group.group.info
    assert [i["process_index"] for i in info] == [0, 1]
    assert all(i["global_devices"] == 8 and i["local_devices"] == 4 for i in info)
    assert group.num_replicas_in_sync == 8
    for pid in group.group.pids:
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
        # Out of the terminal's reach (a process group of its own), but in this
        # process's session: the scheduler's per-session share (autogroup) does not
        # split the hosts, whose collectives then ran a quarter slower.
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert os.getsid(pid) == os.getsid(0)
    # Each host's TPU variables are set in its worker, before JAX started.
    worker_ids = group.experimental_distribute_values_from_function(
        lambda ctx: np.int32(os.environ["TPU_WORKER_ID"]))
    assert [int(w) for w in group.local_results(worker_ids)] == [0] * 4 + [1] * 4


def _step(x: jax.Array, scale: jax.Array) -> dict[str, jax.Array]:
    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    return {"y": x * scale + ctx.replica_id_in_sync_group,
            "total": ctx.all_reduce("SUM", jnp.sum(x, axis=0))}


def test_run_reduce_and_gather_match_numpy(group: GroupEngine) -> None:
    data = np.random.default_rng(3).normal(size=(8, 5, 3)).astype(np.float32)
    value = group.experimental_distribute_values_from_function(
        lambda ctx: data[ctx.replica_id_in_sync_group])
    out = group.run(_step, args=(value, np.float32(3.0)))
    y = data * 3.0 + np.arange(8, dtype=np.float32)[:, None, None]
    np.testing.assert_allclose(group.gather(out["y"], axis=0), y.reshape(40, 3), rtol=1e-6)
    np.testing.assert_allclose(group.reduce("SUM", out["total"]),
                               8 * data.sum(axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(group.reduce("MAX", out["y"], axis=None), y.max(0), rtol=1e-6)


def test_a_user_exception_keeps_its_type_and_the_group_goes_on(group: GroupEngine) -> None:
    value = group.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))

    def broken(x: jax.Array) -> jax.Array:
        raise KeyError("no such feature: 'age'")

    with pytest.raises(KeyError, match="no such feature"):
        group.run(broken, args=(value,))
    out = group.run(lambda x: x + 1, args=(value,))
    np.testing.assert_allclose(group.gather(out, axis=0), np.repeat(np.arange(8), 2) + 1)


def _ones(engine: GroupEngine) -> Any:
    return engine.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))


def test_operations_sent_ahead_name_the_outputs_before_them(group: GroupEngine) -> None:
    """Three runs sent before any reply is read, each on the output of the one before
    (named by its reserved block of ids): the replies come back in order with those
    ids, and the result is numpy's."""
    value = _ones(group)
    double = group.define(ship(lambda x: x * 2)).id
    firsts: list[int] = []
    with group.pipeline() as ahead:
        x = value
        for _ in range(3):
            first = ahead.send(group.run_op(double, (x,), {}))
            assert first is not None
            firsts.append(first)
            x = group.value(HandleInfo(first, (2,), "float32", None))
        assert ahead.pending == 3
        replies = [ahead.receive() for _ in range(3)]
    assert [firsts[i + 1] - firsts[i] for i in range(2)] == [ID_BLOCK] * 2
    for first, per_host in zip(firsts, replies, strict=True):
        assert [info.id for info in per_host] == [first, first]
    np.testing.assert_array_equal(group.gather(x, axis=0),
                                  np.repeat(np.arange(8, dtype=np.float32), 2) * 8)


def _result_call(engine: GroupEngine, kind: str, value: Any) -> ResultCall | None:
    if kind == "reduce":
        return engine.reduce_call("SUM", value, None)
    if kind == "fetch":
        return engine.fetch_call(value)
    if kind == "local":
        return engine.local_results_call(value)
    return engine.gather_call({"x": value}, 0)


@pytest.mark.parametrize("kind", ["reduce", "fetch", "local", "gather"])
def test_one_operation_results_follow_a_run_in_flight(group: GroupEngine, kind: str) -> None:
    """A reduce, fetch, local results or one-leaf gather sent behind a run whose reply
    is not read yet, on that run's output, answers what numpy computes from the
    replicas' values (a gather of two leaves takes one operation each, so it has no
    single call)."""
    value = _ones(group)
    triple = group.define(ship(lambda x: x * 3)).id
    per_replica = np.repeat(np.arange(8, dtype=np.float32), 2).reshape(8, 2) * 3
    with group.pipeline() as ahead:
        first = ahead.send(group.run_op(triple, (value,), {}))
        assert first is not None
        out = group.value(HandleInfo(first, (2,), "float32", None))
        call = _result_call(group, kind, out)
        assert call is not None
        assert ahead.send(call.operation) is not None
        assert ahead.pending == 2
        ahead.receive()
        got = call.answer(ahead.receive())
    if kind == "reduce":
        np.testing.assert_array_equal(got, per_replica.sum(axis=0))
    elif kind == "fetch":
        np.testing.assert_array_equal(got, per_replica)
    elif kind == "local":
        assert len(got) == 8
        for replica, component in enumerate(got):
            np.testing.assert_array_equal(np.asarray(component), per_replica[replica])
    else:
        np.testing.assert_array_equal(got["x"], per_replica.reshape(16))
    assert group.gather_call({"a": value, "b": value}, 0) is None


def _stuck_on_host_1(x: jax.Array) -> jax.Array:
    if jax.process_index() == 1:
        threading.Event().wait()  # never returns: its process is restarted
    return x


def test_a_step_stuck_ahead_of_another_resets_the_slice_and_voids_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that never finishes on host 1, with a run sent behind it: past the
    operation time-out the slice restarts, the run behind it fails without having
    run, and the engine works on the new workers."""
    monkeypatch.setenv("JAXPOD_OPERATION_TIMEOUT_S", "5")
    replica_group = start_process_group()
    engine = GroupEngine(replica_group)
    try:
        value = _ones(engine)
        stuck = engine.define(ship(_stuck_on_host_1)).id
        double = engine.define(ship(lambda x: x * 2)).id
        with engine.pipeline() as ahead:
            ahead.send(engine.run_op(stuck, (value,), {}))
            ahead.send(engine.run_op(double, (value,), {}))
            with pytest.raises(SliceResetError, match="did not finish on every host"):
                ahead.receive()
            with pytest.raises(SliceResetError, match="Not run"):
                ahead.receive()
            with pytest.raises(SliceResetError, match="Not run"):  # nothing more goes
                ahead.send(engine.run_op(double, (value,), {}))
        assert replica_group.resets == 1
        fresh = _ones(engine)
        np.testing.assert_array_equal(
            engine.gather(engine.run(lambda x: x * 2, args=(fresh,)), axis=0),
            np.repeat(np.arange(8, dtype=np.float32), 2) * 2)
    finally:
        replica_group.stop()


def test_a_killed_worker_is_a_lost_host_and_stop_leaves_no_process() -> None:
    replica_group = start_process_group()
    engine = GroupEngine(replica_group)
    pids = replica_group.pids
    try:
        value = engine.experimental_distribute_values_from_function(
            lambda ctx: np.ones((2,), np.float32))
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match="Host 1"):
            engine.reduce("SUM", engine.run(lambda x: x * 2, args=(value,)))
        # Every later call says so too, not only the one that saw it (a job's
        # background report may be that one: the next step must still read as a
        # lost host, which its retry policy takes as a preemption).
        with pytest.raises(WorkerLostError, match="host 1 went away"):
            engine.stats()
    finally:
        replica_group.stop()
    assert not any(_alive(pid) for pid in pids)


def test_a_constructor_error_is_a_worker_start_error_and_nothing_stays() -> None:
    placements = [HostPlacement(None, 0, {}, env={"JAXPOD_PREEMPTION_GRACE_S": "-1"})]
    before = set(_children())
    with pytest.raises(WorkerStartError, match="JAXPOD_PREEMPTION_GRACE_S"):
        ReplicaGroup.start(placements, DEVICES_PER_HOST, launcher=ProcessWorkers(),
                           start_timeout_s=60)
    assert wait_for(lambda: not (set(_children()) - before), 30)


def _children() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                out.append(int(name))
    return out


def test_workers_exit_when_the_process_that_started_them_dies() -> None:
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, threading
        from jaxpod.service.capacity.local_cluster import descendants, plan_slices
        from jaxpod.service.capacity.process_hosts import ProcessWorkers
        from jaxpod.service.slices.replica_group import ID_BLOCK, HostPlacement, ReplicaGroup
        (s,) = plan_slices("v4-16")
        group = ReplicaGroup.start([HostPlacement(None, i, {}, env=s.host_env(i))
                                    for i in range(2)], 4, launcher=ProcessWorkers(),
                                   start_timeout_s=120)
        print(*group.pids, flush=True)
        threading.Event().wait()
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        pids = [int(p) for p in starter.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        starter.kill()
        starter.communicate()
    assert wait_for(lambda: not any(_alive(p) for p in pids), 30), pids


# ------------------------------------------------------------------------ provider
def _acquire(slices: LocalProcessSlices, accelerator_type: str, timeout_s: float = 60,
             num_slices: int = 1) -> HeldSlice:
    request = SliceRequest(accelerator_type=accelerator_type, timeout_s=timeout_s,
                                     num_slices=num_slices)
    return slices.acquire(request, f"slice-{accelerator_type}")


def test_the_provider_holds_whole_slices_and_keeps_released_ones_warm() -> None:
    slices = LocalProcessSlices("v4-8,v4-16", start_timeout_s=120)
    try:
        assert [(c.name, c.num_hosts) for c in slices.cluster()] == [
            ("sim-0-v4-8", 1), ("sim-1-v4-16", 2)]
        assert [len(s.info.hosts) for s in slices.snapshot()] == [1, 2]
        held = _acquire(slices, "v4-16")
        assert held.description["slice_names"] == ["sim-1-v4-16"]
        assert held.engine.num_replicas_in_sync == 8
        x = np.arange(8, dtype=np.float32)
        value = held.engine.experimental_distribute_values_from_function(
            lambda ctx: x[ctx.replica_id_in_sync_group])
        assert float(held.engine.reduce("SUM", held.engine.run(lambda v: v * 2, args=(value,)),
                                        axis=None)) == pytest.approx(2 * x.sum())
        assert not slices.has_free("v4-16", 1) and slices.has_free("v4-8", 1)
        # Busy: a second acquire waits its time-out and says what the cluster has.
        with pytest.raises(AllocationTimeoutError, match=r"sim-1-v4-16 \(busy\)"):
            _acquire(slices, "v4-16", timeout_s=0.2)
        with pytest.raises(AllocationTimeoutError, match="1 x v4-32 at all: 0 of the 0 v4-32"):
            _acquire(slices, "v4-32", timeout_s=0.2)
        pids = held.engine.group.pids
        held.release()
        assert slices.has_free("v4-16", 1)  # warm: the next acquire of it takes it
        again = _acquire(slices, "v4-16")
        assert again.engine.group.pids == pids
        again.release()
    finally:
        slices.close()
    assert not any(_alive(pid) for pid in pids)


def test_a_multi_slice_acquire_spans_both_slices_with_megascale_ids() -> None:
    slices = LocalProcessSlices("v4-8,v4-8", start_timeout_s=120)
    try:
        held = _acquire(slices, "v4-8", num_slices=2)
        assert held.description["slice_names"] == ["sim-0-v4-8", "sim-1-v4-8"]
        ids = held.engine.experimental_distribute_values_from_function(
            lambda ctx: np.int32(os.environ["MEGASCALE_SLICE_ID"]))
        assert [int(i) for i in held.engine.local_results(ids)] == [0] * 4 + [1] * 4
        held.release()
        single = _acquire(slices, "v4-8")  # the warm pair is stopped to make room
        no_megascale = single.engine.experimental_distribute_values_from_function(
            lambda ctx: np.int32("MEGASCALE_SLICE_ID" in os.environ))
        assert not any(single.engine.local_results(no_megascale))
        single.release()
    finally:
        slices.close()

@pytest.mark.parametrize("closed", [False, True])
def test_an_acquire_waiting_for_capacity_gets_a_slice_released_meanwhile(
        closed: bool) -> None:
    slices = LocalProcessSlices("v4-8", start_timeout_s=120)
    try:
        held = _acquire(slices, "v4-8")
        pids = held.engine.group.pids
        if closed:  # a closed provider stops every released slice
            slices.close()
        result: list[HeldSlice] = []
        waiter = threading.Thread(target=lambda: result.append(
            _acquire(slices, "v4-8", timeout_s=120)))
        waiter.start()
        assert wait_for(lambda: slices.waiting("v4-8") == 1, 30)
        # Kept warm, the released slice would hold the capacity until the waiting
        # acquire timed out: it is stopped instead, and the waiter starts its own.
        held.release()
        waiter.join(150)
        assert result and result[0].engine.num_replicas_in_sync == 4
        assert not set(result[0].engine.group.pids) & set(pids)
        assert not any(_alive(pid) for pid in pids) and slices.warm() == []
        result[0].release()
    finally:
        slices.close()


def _cancelled_acquire(slices: LocalProcessSlices, waits: Callable[[], bool]
                       ) -> BaseException:
    """What an acquire of a v4-8 that would wait an hour raises when cancelled (as a
    stopping service does) once ``waits()`` says it is waiting."""
    cancel = Cancel()
    ended: list[BaseException] = []

    def wait() -> None:
        request = SliceRequest(accelerator_type="v4-8", timeout_s=3600)
        try:
            slices.acquire(request, "slice-waiting", cancel)
        except BaseException as e:
            ended.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_for(waits, 30), "the acquire never came to wait"
    cancel.set()
    waiter.join(30)
    assert not waiter.is_alive(), "the cancelled acquire still waits"
    (error,) = ended
    return error


def test_an_acquire_waiting_for_capacity_gives_up_when_cancelled() -> None:
    slices = LocalProcessSlices("v4-8", start_timeout_s=120)
    try:
        held = _acquire(slices, "v4-8")
        error = _cancelled_acquire(slices, lambda: slices.waiting("v4-8") == 1)
        assert isinstance(error, AllocationCancelledError), error
        assert "nothing is held" in str(error)
        assert slices.waiting("v4-8") == 0
        assert _doubled_sum(held) == 2 * sum(range(4))  # the holder is untouched
        held.release()
    finally:
        slices.close()


def test_an_acquire_waiting_for_a_prewarm_gives_up_when_cancelled(
        caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()

    class Gated(LocalProcessSlices):
        """Its prewarm's workers start only once the test opens the gate."""

        def _start_group(self, held: Any) -> ReplicaGroup:
            assert gate.wait(120), "the test never opened the gate"
            return super()._start_group(held)

    caplog.set_level("INFO", logger="jaxpod.service.capacity.pools")
    slices = Gated("v4-8", start_timeout_s=120)
    try:
        prewarming = slices.prewarm("v4-8")
        error = _cancelled_acquire(  # while the prewarm still runs
            slices, lambda: "waits for that slice's workers being prewarmed" in caplog.text)
        assert isinstance(error, AllocationCancelledError), error
        assert "prewarmed; nothing is held" in str(error)
        assert slices.waiting("v4-8") == 0
        gate.set()  # the prewarm ends as if nothing had happened, and its slice serves
        prewarming.join(120)
        (warm,) = slices.warm()
        held = _acquire(slices, "v4-8")
        assert held.engine.group is warm.group
        assert _doubled_sum(held) == 2 * sum(range(4))
        held.release()
    finally:
        gate.set()
        slices.close()


def _doubled_sum(held: HeldSlice) -> float:
    """2 x the sum of the replica ids, computed on ``held``'s workers."""
    engine = held.engine
    value = engine.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    return float(engine.reduce("SUM", engine.run(lambda v: v * 2, args=(value,)), axis=None))


def test_an_acquire_while_a_slice_is_prewarmed_waits_and_takes_it() -> None:
    started: list[ReplicaGroup] = []

    class Counting(LocalProcessSlices):
        def _start_group(self, held: Any) -> ReplicaGroup:
            started.append(super()._start_group(held))
            return started[-1]

    slices = Counting("v4-16", start_timeout_s=120)
    pids: list[int] = []
    try:
        prewarming = slices.prewarm("v4-16")
        assert slices.has_free("v4-16", 1)  # an acquire gets it without waiting for room
        # It comes while the workers start (seconds): without waiting for them, it
        # would find their capacity held, and they would be stopped for it.
        held = _acquire(slices, "v4-16")
        prewarming.join(60)
        assert len(started) == 1 and held.engine.group is started[0]
        pids = held.engine.group.pids
        assert _doubled_sum(held) == 2 * sum(range(8))
        held.release()
    finally:
        slices.close()
    assert pids and not any(_alive(pid) for pid in pids)


def test_workers_started_ahead_are_the_prewarmed_slices() -> None:
    assert prewarm_type("v4-8,v4-16", "") == "v4-8"  # the first slice's
    with pytest.raises(ValueError, match=r"has no v5p-8 slice \(it has v4-8, v4-16\)"):
        prewarm_type("v4-8,v4-16", "v5p-8")
    ahead = start_ahead("v4-8,v4-16", prewarm_type("v4-8,v4-16", "v4-16"), "cpu")
    pids = [w.pid for w in ahead.workers]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    slices = LocalProcessSlices("v4-8,v4-16", start_timeout_s=120, ahead=ahead)
    try:
        slices.prewarm("v4-16").join(120)
        assert [w.key for w in slices.warm()] == [("v4-16", 1)]
        held = _acquire(slices, "v4-16")
        assert held.engine.group.pids == pids
        assert _doubled_sum(held) == 2 * sum(range(8))
        held.release()
    finally:
        slices.close()
    assert not any(_alive(pid) for pid in pids)


def test_workers_started_ahead_that_nothing_takes_stop_with_the_provider() -> None:
    ahead = start_ahead("v4-8", "v4-8", "cpu")
    pids = [w.pid for w in ahead.workers]
    LocalProcessSlices("v4-8", ahead=ahead).close()
    assert wait_for(lambda: not any(_alive(pid) for pid in pids), 30)


# ------------------------------------------------------------------ jaxpod serve
def _summing_step(state: Any, batch: Any) -> Any:
    total = jaxpod.get_replica_context().all_reduce("SUM", batch.sum())
    return {"total": state["total"] + total}, {}


def _host_workers(service_pid: int) -> list[int]:
    """The service's host worker processes."""
    return sorted(pid for pid in descendants(service_pid)
                  if b"jaxpod.worker.host_process" in _cmdline(pid))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_serve_with_processes_starts_no_ray_and_runs_sessions_and_jobs(
        tmp_path: Path) -> None:
    service = start_service(tmp_path / "serve.log", "v4-16",
                            args=("--provider", "processes", "--prewarm", "--state-dir",
                                  str(tmp_path / "state")))
    try:
        # --prewarm: the first slice's workers start with the service, before any
        # acquire, and the first session gets them.
        assert wait_for(lambda: len(_host_workers(service.process.pid)) == 2, 60)
        prewarmed = _host_workers(service.process.pid)
        data = np.arange(16, dtype=np.float32).reshape(8, 2)
        with service.connect() as client:
            with client.strategy() as strategy:
                value = strategy.experimental_distribute_values_from_function(
                    lambda ctx: data[ctx.replica_id_in_sync_group])
                total = strategy.reduce("SUM", strategy.run(lambda x: x * 3, args=(value,)),
                                        axis=None)
                np.testing.assert_allclose(total, 3 * data.sum(axis=0))
                assert _host_workers(service.process.pid) == prewarmed
            # The job gets the slice the session released (kept warm).
            batches = [np.full(8, i, np.float32) for i in range(1, 4)]
            job = client.submit(_summing_step, steps=6, accelerator_type="v4-16",
                                initial_state={"total": np.float32(0)}, dataset=batches,
                                checkpoint_every=2, name="summing")
            final = job.wait(timeout=300, progress=False)
            assert final.state == "SUCCEEDED", final.error
            assert float(job.result().state["total"]) == float(
                sum(b.sum() for b in batches * 2))
        # Its readiness checks the provider it has, by that provider's name.
        ready = httpx.get(f"{service.http_url}/readyz", timeout=30).json()
        assert ready["ready"] and ready["checks"] == {
            "processes": True, "grpc": True, "store": True}, ready
        tree = descendants(service.process.pid)
        commands = [_cmdline(pid) for pid in tree]
        assert sum(b"jaxpod.worker.host_process" in c for c in commands) == 2
        assert not [c for c in commands if b"ray" in c.lower()], commands
        # A crashed service leaves no worker behind: they see their pipe end.
        workers = {p: s for p, s in tree.items()
                   if b"jaxpod.worker.host_process" in _cmdline(p)}
        os.kill(service.process.pid, signal.SIGKILL)
        assert not all_gone(workers, 30)
    finally:
        kill_service(service)


def test_provider_without_local_is_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", "serve", "--provider",
                           "processes"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode != 0
    assert "--slices and --provider need --local" in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--prewarm"], "--prewarm needs --local"),
    (["--local", "--provider", "processes", "--slices", "v4-8", "--prewarm", "v6e-8"],
     "--prewarm v6e-8: the simulated cluster 'v4-8' has no v6e-8 slice (it has v4-8)"),
])
def test_prewarm_needs_local_and_a_type_the_cluster_has(args: list[str], message: str
                                                        ) -> None:
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", "serve", "--port", "0",
                           "--http-port", "-1", *args], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr
