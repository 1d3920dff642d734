"""Warm slices: a released slice keeps its host workers for the next acquire.

Real Ray actors on a simulated cluster (a v4-16: 2 hosts x 4 chips; two v4-8s),
real multi-process JAX over gloo, driven through :class:`RaySlices` as the
coordinator drives it (and through :class:`CoordinatorService` for cluster status and
shutdown). Processes are told apart by pid and start time, so a restarted worker
never passes for a warm one. Every numeric result is compared with numpy.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import jaxpod
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.service.api.coordinator import CoordinatorService
from jaxpod.service.capacity.local_cluster import LocalTPUCluster, is_running
from jaxpod.service.capacity.pools import RaySlices
from jaxpod.service.capacity.requests import SliceRequest
from jaxpod.service.capacity.resolvers.ray import snapshot
from jaxpod.service.sessions import SessionManager
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.held import HeldSlice
from jaxpod.shipping import ship
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

CLUSTER_SLICES = "v4-16,v4-8,v4-8"
GONE_TIMEOUT_S = 60.0


def _affine(x: jax.Array) -> jax.Array:
    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    return x * 3.0 + ctx.replica_id_in_sync_group


def _square(x: jax.Array) -> jax.Array:
    return x * x


@pytest.fixture(scope="module")
def slices(ray_cluster: LocalTPUCluster) -> Iterator[RaySlices]:
    provider = RaySlices(start_timeout_s=120)
    try:
        yield provider
    finally:
        provider.close()


def _acquire(slices: RaySlices, accelerator_type: str = "v4-16", num_slices: int = 1,
             steps_per_run: int = 1) -> HeldSlice:
    request = SliceRequest(accelerator_type=accelerator_type,
                                     num_slices=num_slices, steps_per_run=steps_per_run,
                                     timeout_s=60)
    return slices.acquire(request, f"slice-{accelerator_type}")


def _processes(held: HeldSlice) -> dict[int, str]:
    """The slice's worker pids with their start times (a reused pid is another process)."""
    return {pid: _start_time(pid) for pid in held.engine.group.pids}


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _all_gone(processes: dict[int, str]) -> bool:
    return bool(wait_for(lambda: not any(is_running(p, s) for p, s in processes.items()),
                         GONE_TIMEOUT_S))


def _check_affine(engine: GroupEngine, fn: Any, seed: int) -> None:
    x = np.random.default_rng(seed).normal(size=(5,)).astype(np.float32)
    got = engine.local_results(engine.run(fn, args=(x,)))
    assert len(got) == engine.num_replicas_in_sync == 8
    for replica, part in enumerate(got):
        np.testing.assert_allclose(part, x * 3.0 + replica, rtol=1e-6)


def test_released_slice_is_reused_with_its_workers_and_functions(slices: RaySlices) -> None:
    held = _acquire(slices)
    group, engine, processes = held.engine.group, held.engine, _processes(held)
    defined = engine.define(ship(_square))
    _check_affine(engine, _affine, seed=0)
    old_value = engine.run(defined, args=(np.arange(4.0, dtype=np.float32),))
    batches = [np.arange(16.0, dtype=np.float32).reshape(8, 2) + i for i in range(3)]
    iterator = iter(engine.experimental_distribute_dataset(batches))
    next(iterator)
    assert all(s["num_values"] > 0 and s["num_iterators"] == 1 for s in engine.stats())

    held.release()
    held.release()  # idempotent: parked once
    assert [w.group for w in slices.warm()] == [group]
    sent: list[str] = []
    real_call = group.call

    def recording_call(op: Any, **kwargs: Any) -> Any:  # the real call, recorded
        sent.append(type(op).__name__)
        return real_call(op, **kwargs)

    group.call = recording_call  # type: ignore[method-assign]
    again = _acquire(slices, steps_per_run=2)  # another configuration, same workers
    try:
        assert again.engine.group is group and again.engine is not engine
        assert _processes(again) == processes
        assert all(is_running(p, s) for p, s in processes.items())
        assert slices.warm() == []
        assert again.engine.steps_per_run == 2
        for host in again.engine.stats():
            assert (host["num_values"], host["num_iterators"], host["device_bytes"]) == (0, 0, 0)
        # The workers kept the function: its id alone runs it (an unknown id would raise).
        x = np.random.default_rng(1).normal(size=(6,)).astype(np.float32)
        squared = again.engine.local_results(again.engine.run(defined, args=(x,)))
        for part in squared:
            np.testing.assert_allclose(part, x * x, rtol=1e-6)
        _check_affine(again.engine, _affine, seed=2)  # known to the new engine too
        assert "Define" not in sent, sent
        with pytest.raises(ValueError, match="another replica group"):
            again.engine.run(defined, args=(old_value,))  # the last holder's values are gone
    finally:
        del group.call
        again.release()
    assert [w.group for w in slices.warm()] == [group]


def _traced_loudly(x: jax.Array) -> jax.Array:
    print("tracing _traced_loudly")  # on the workers, once per trace
    return x + 1.0


def test_a_warm_slice_keeps_its_compiled_programs(slices: RaySlices) -> None:
    x = np.arange(4, dtype=np.float32)
    held = _acquire(slices)
    held.engine.capture_output(True)
    held.engine.run(_traced_loudly, args=(x,))
    assert all("tracing _traced_loudly" in lines for lines in held.engine.take_output())
    held.release()
    again = _acquire(slices, steps_per_run=3)  # the same device assignment
    try:
        again.engine.capture_output(True)
        for part in again.engine.local_results(
                again.engine.run(_traced_loudly, args=(x,))):
            np.testing.assert_array_equal(part, x + 1.0)
        assert again.engine.take_output() == [[], []]  # nothing traced again
    finally:
        again.release()


def test_warm_slice_whose_worker_died_is_replaced(slices: RaySlices) -> None:
    held = _acquire(slices)
    held.release()
    processes = _processes(held)
    victim = held.engine.group.pids[1]
    os.kill(victim, signal.SIGKILL)
    assert _all_gone({victim: processes[victim]})

    fresh = _acquire(slices)
    try:
        assert fresh.engine.group is not held.engine.group
        assert not set(_processes(fresh)) & set(processes)
        assert _all_gone(processes), "the lost slice's other worker was not stopped"
        _check_affine(fresh.engine, _affine, seed=3)
    finally:
        fresh.release()
    assert [w.group for w in slices.warm()] == [fresh.engine.group]


def test_acquire_without_free_capacity_stops_warm_slices_holding_it(
        slices: RaySlices) -> None:
    both = _acquire(slices, "v4-8", num_slices=2)
    both.release()
    processes = _processes(both)
    assert any(w.key == ("v4-8", 2) for w in slices.warm())
    one = _acquire(slices, "v4-8", num_slices=1)  # both v4-8s are warm: one must go
    try:
        assert not any(w.key == ("v4-8", 2) for w in slices.warm())
        assert _all_gone(processes)
        assert one.engine.num_replicas_in_sync == 4
        x = np.arange(3.0, dtype=np.float32)
        for part in one.engine.local_results(one.engine.run(_square, args=(x,))):
            np.testing.assert_allclose(part, x * x)
    finally:
        one.release()


def test_cluster_status_shows_warm_slices_free_and_shutdown_stops_them(
        ray_cluster: LocalTPUCluster) -> None:
    provider = RaySlices(start_timeout_s=120)
    service = CoordinatorService(provider, SessionManager(lease_s=120))
    session = service.sessions.open()
    try:
        info = asyncio.run(service.AcquireSlice(pb.AcquireSliceRequest(
            session_id=session.id, accelerator_type="v4-8", timeout_s=60), None))
        held = session.slice(info.slice_id)
        processes = _processes(held)
        assert _holders(service)[info.slice_names[0]] == tensors.holder_label(session.id)

        asyncio.run(service.ReleaseSlice(pb.SliceRequest(
            session_id=session.id, slice_id=info.slice_id), None))
        assert [w.group for w in provider.warm()] == [held.engine.group]
        assert _holders(service)[info.slice_names[0]] == ""  # free to every client
        ray_slices, _ = snapshot()  # still reserved in Ray: its workers keep their bundles
        assert not next(s for s in ray_slices if s.info.name == info.slice_names[0]).idle
        assert all(is_running(p, s) for p, s in processes.items())

        asyncio.run(service.close_all())  # what `jaxpod serve` does on SIGTERM
        assert provider.warm() == []
        assert _all_gone(processes), "warm workers survived the service's shutdown"
        assert provider.allocator.live() == ()
    finally:
        provider.close()


def _holders(service: CoordinatorService) -> dict[str, str]:
    reply = asyncio.run(service.ClusterStatus(pb.Empty(), None))
    return {s.name: s.holder for s in reply.slices}
