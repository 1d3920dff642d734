"""Whole-slice allocation on a real local Ray cluster: two v4-16 slices and one v4-8.

Every test is followed by a check that the cluster is back where it started: the same
free TPU, CPU, head and slice-name resources, and no live placement group.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from jaxpod.errors import AllocationCancelledError, AllocationTimeoutError, JaxpodError
from jaxpod.service.capacity.allocation import Allocation, AllocationEvent
from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.local_cluster import LocalTPUCluster
from jaxpod.service.capacity.resolvers.base import MEGASCALE_VARS
from jaxpod.service.capacity.resolvers.ray import RayResolver, discover_slices, snapshot
from jaxpod.timeouts import wait_for

CLUSTER_SLICES = "v4-16,v4-16,v4-8"
V4_16 = ("sim-0-v4-16", "sim-1-v4-16")
V4_8 = "sim-2-v4-8"


def _scarce() -> dict[str, float]:
    """The cluster's free resources that allocations take (all of them but memory)."""
    return {k: v for k, v in ray.available_resources().items()
            if k in ("TPU", "CPU") or k.startswith(("TPU-", "sim-")) or "_group_" in k}


def _live_groups() -> set[str]:
    return {pg_id for pg_id, g in placement_group_table().items() if g["state"] != "REMOVED"}


@pytest.fixture(autouse=True)
def back_to_start(ray_cluster: LocalTPUCluster) -> Iterator[None]:
    """After each test: no live placement group and every resource free again."""
    before = _scarce()
    assert not _live_groups()
    yield
    settled = wait_for(lambda: _scarce() == before and not _live_groups(), 15.0)
    assert settled, f"leaked: groups {_live_groups()}, resources {_scarce()} != {before}"


@pytest.fixture
def allocator() -> Iterator[SliceAllocator]:
    allocator = SliceAllocator()
    yield allocator
    allocator.release_all()


def _node_of() -> dict[tuple[str, int], dict[str, Any]]:
    """(slice name, worker id) -> Ray node, straight from the nodes' labels."""
    return {(n["Labels"]["ray.io/tpu-slice-name"], int(n["Labels"]["ray.io/tpu-worker-id"])): n
            for n in ray.nodes() if n["Alive"] and "ray.io/tpu-slice-name" in n["Labels"]}


def _states() -> dict[str, str]:
    slices, _ = snapshot()
    return {s.info.name: s.state for s in slices}


def _on(kind: str) -> tuple[threading.Event, Callable[[AllocationEvent], None]]:
    seen = threading.Event()

    def callback(event: AllocationEvent) -> None:
        if event.kind == kind:
            seen.set()

    return seen, callback


def test_allocate_one_slice(allocator: SliceAllocator) -> None:
    allocation = allocator.allocate("v4-16", timeout_s=30)
    (s,) = allocation.slices
    name = s.info.name
    assert name in V4_16
    nodes = _node_of()
    assert [h.worker_id for h in s.hosts] == [0, 1]
    for h in s.hosts:
        assert h.bundle_index == h.worker_id
        assert (h.process_id, h.num_processes) == (h.worker_id, 2)
        assert h.node_id == nodes[(name, h.worker_id)]["NodeID"]
        assert (h.node_ip, h.chips) == ("127.0.0.1", 4)
        assert dict(h.env) == {
            "TPU_NAME": name, "TPU_WORKER_ID": str(h.worker_id),
            "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2",
            "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
        }
        assert set(h.unset_env) == set(MEGASCALE_VARS)  # no stale multi-slice values
    hosts_table = placement_group_table(s.placement_group)
    assert hosts_table["state"] == "CREATED"
    assert hosts_table["bundles_to_node_id"] == {
        i: nodes[(name, i)]["NodeID"] for i in range(2)}
    assert all(b == {"TPU": 4.0, "CPU": 1.0, name: 1.0} for b in hosts_table["bundles"].values())
    head_table = placement_group_table(s.head_placement_group)
    assert head_table["bundles"] == {0: {"TPU-v4-16-head": 1.0}}
    assert head_table["bundles_to_node_id"] == {0: nodes[(name, 0)]["NodeID"]}
    assert allocation.coordinator_host == "127.0.0.1"
    assert _states()[name] == "busy"
    assert ray.available_resources().get("TPU-v4-16-head") == 1.0  # the other slice's

    allocation.release()
    assert allocation.released and not allocator.live()
    # Release returns capacity immediately: the very next look sees the slice idle.
    assert _states()[name] == "idle"
    allocation.release()  # idempotent


def test_allocate_two_slices_sets_megascale(allocator: SliceAllocator) -> None:
    with allocator.allocate("v4-16", num_slices=2, timeout_s=30) as allocation:
        names = [s.info.name for s in allocation.slices]
        assert sorted(names) == list(V4_16)
        hosts = allocation.hosts
        assert [h.process_id for h in hosts] == [0, 1, 2, 3]
        assert all(h.num_processes == 4 for h in hosts)
        assert [(h.slice_index, h.worker_id) for h in hosts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        coordinator = _node_of()[(names[0], 0)]["NodeManagerAddress"]
        for h in hosts:
            assert h.slice_name == names[h.slice_index]
            assert {k: v for k, v in h.env.items() if k.startswith("MEGASCALE_")} == {
                "MEGASCALE_COORDINATOR_ADDRESS": coordinator,
                "MEGASCALE_NUM_SLICES": "2",
                "MEGASCALE_SLICE_ID": str(h.slice_index),
                "MEGASCALE_PORT": "8081",
            }
            assert h.env["TPU_NAME"] == h.slice_name
            assert h.unset_env == ()
        # apply_env replaces stale values in a process environment.
        environ = {"MEGASCALE_SLICE_ID": "7", "MEGASCALE_NUM_SLICES": "9", "PATH": "/bin"}
        hosts[3].apply_env(environ)
        assert (environ["MEGASCALE_SLICE_ID"], environ["MEGASCALE_NUM_SLICES"],
                environ["PATH"]) == ("1", "2", "/bin")
        assert set(_states().values()) >= {"busy"}
        assert all(_states()[n] == "busy" for n in names)
    assert all(_states()[n] == "idle" for n in names)


def test_single_slice_unsets_stale_megascale(allocator: SliceAllocator) -> None:
    with allocator.allocate("v4-8", timeout_s=30) as allocation:
        (host,) = allocation.hosts
        assert (host.slice_name, host.worker_id, host.env["TPU_WORKER_HOSTNAMES"]) == (
            V4_8, 0, "127.0.0.1")
        environ = {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_COORDINATOR_ADDRESS": "stale"}
        host.apply_env(environ)
        assert not any(k.startswith("MEGASCALE_") for k in environ)
        assert environ["TPU_NAME"] == V4_8


def test_more_than_exists_times_out(allocator: SliceAllocator) -> None:
    start = time.monotonic()
    with pytest.raises(AllocationTimeoutError) as info:
        allocator.allocate("v4-16", num_slices=3, timeout_s=1.5)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 6.0
    message = str(info.value)
    assert "3 x v4-16 slice(s) (2 hosts x {TPU: 4, CPU: 1} each) within 1.5 s" in message
    assert "JAXPOD_ALLOCATION_TIMEOUT_S" in message
    assert "2 of the 2 v4-16 slice(s) in the cluster are idle" in message
    assert f"{V4_16[0]} (idle), {V4_16[1]} (idle); v4-8: {V4_8} (idle)" in message
    assert isinstance(info.value, JaxpodError) and isinstance(info.value, TimeoutError)


def test_type_missing_from_cluster_times_out(allocator: SliceAllocator) -> None:
    with pytest.raises(AllocationTimeoutError, match="0 of the 0 v5p-8 slice"):
        allocator.allocate("v5p-8", timeout_s=0.5)


def test_unknown_type_is_rejected_at_once(allocator: SliceAllocator) -> None:
    with pytest.raises(ValueError, match="Unknown TPU accelerator type 'v9-8'"):
        allocator.allocate("v9-8")


def test_timeout_comes_from_the_environment(allocator: SliceAllocator,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXPOD_ALLOCATION_TIMEOUT_S", "0.5")
    with pytest.raises(AllocationTimeoutError, match=r"within 0\.5 s"):
        allocator.allocate("v4-16", num_slices=3)
    monkeypatch.setenv("JAXPOD_ALLOCATION_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="JAXPOD_ALLOCATION_TIMEOUT_S='soon'"):
        allocator.allocate("v4-16")


def test_two_requests_for_the_one_free_slice(allocator: SliceAllocator) -> None:
    barrier = threading.Barrier(2)

    def request() -> Allocation | AllocationTimeoutError:
        barrier.wait(timeout=10)
        try:
            return allocator.allocate("v4-8", timeout_s=3)
        except AllocationTimeoutError as e:
            return e

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: request(), range(2)))
    won = [r for r in results if isinstance(r, Allocation)]
    lost = [r for r in results if isinstance(r, AllocationTimeoutError)]
    assert (len(won), len(lost)) == (1, 1)
    assert won[0].slices[0].info.name == V4_8
    assert f"v4-8: {V4_8} (busy)" in str(lost[0])
    won[0].release()


def test_two_multi_slice_requests_do_not_deadlock(allocator: SliceAllocator) -> None:
    """Both want both v4-16 slices: one gets both, the other none (never one each)."""
    barrier = threading.Barrier(2)

    def request() -> Allocation | AllocationTimeoutError:
        barrier.wait(timeout=10)
        try:
            return allocator.allocate("v4-16", num_slices=2, timeout_s=4)
        except AllocationTimeoutError as e:
            return e

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: request(), range(2)))
    won = [r for r in results if isinstance(r, Allocation)]
    assert len(won) == 1
    assert sorted(s.info.name for s in won[0].slices) == list(V4_16)
    won[0].release()


def test_waiting_request_gets_the_slice_after_release(allocator: SliceAllocator) -> None:
    first = allocator.allocate("v4-8", timeout_s=30)
    waiting, on_event = _on("waiting")
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(allocator.allocate, "v4-8", timeout_s=60, on_event=on_event)
        assert waiting.wait(timeout=30)
        released_at = time.monotonic()
        first.release()
        allocation = second.result(timeout=30)
    assert time.monotonic() - released_at < 5.0
    assert allocation.slices[0].info.name == V4_8
    allocation.release()


def test_cancel_while_waiting(allocator: SliceAllocator) -> None:
    holder = allocator.allocate("v4-8", timeout_s=30)
    waiting, on_event = _on("waiting")
    cancel = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(allocator.allocate, "v4-8", timeout_s=60, cancel=cancel,
                              on_event=on_event)
        assert waiting.wait(timeout=30)
        cancel.set()
        with pytest.raises(AllocationCancelledError, match="cancelled; nothing is reserved"):
            pending.result(timeout=10)
    holder.release()


def test_partial_reservation_is_released_when_hosts_stay_busy(
        allocator: SliceAllocator) -> None:
    """The head is claimed, then someone outside jaxpod takes a host's chips first."""
    intruders = []

    def take_worker_1(event: AllocationEvent) -> None:
        if event.kind == "heads_claimed":
            (name,) = event.slices
            group = placement_group([{"TPU": 4}], bundle_label_selector=[
                {"ray.io/tpu-slice-name": name, "ray.io/tpu-worker-id": "1"}])
            intruders.append(group)
            assert group.wait(30)

    try:
        with pytest.raises(AllocationTimeoutError, match=r"head of each slice was reserved but "
                                                         r"not all hosts became free") as info:
            allocator.allocate("v4-16", timeout_s=3, on_event=take_worker_1)
        assert "worker 1 has 0/4 TPU free" in str(info.value)
        # Nothing of the attempt is left: its head reservation is gone.
        (intruder,) = intruders
        live = _live_groups()
        assert live == {intruder.id.hex()}
    finally:
        for group in intruders:
            remove_placement_group(group)


def test_async_cancel_releases_everything(allocator: SliceAllocator) -> None:
    holder = allocator.allocate("v4-8", timeout_s=30)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        waiting = asyncio.Event()

        def on_event(event: AllocationEvent) -> None:
            if event.kind == "waiting":
                loop.call_soon_threadsafe(waiting.set)

        task = asyncio.ensure_future(
            allocator.allocate_async("v4-8", timeout_s=60, on_event=on_event))
        await asyncio.wait_for(waiting.wait(), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)

    asyncio.run(scenario())
    holder.release()


def test_async_allocate(allocator: SliceAllocator) -> None:
    async def scenario() -> Allocation:
        return await allocator.allocate_async("v4-16", timeout_s=30)

    allocation = asyncio.run(scenario())
    assert allocation.slices[0].info.name in V4_16
    allocation.release()


def test_ray_resolver_sees_every_slice() -> None:
    info = RayResolver().resolve()
    assert [(s.name, s.accelerator_type, s.num_hosts, s.complete) for s in info.slices] == [
        (V4_16[0], "v4-16", 2, True), (V4_16[1], "v4-16", 2, True), (V4_8, "v4-8", 1, True)]
    assert info.notes == ()


def test_slices_missing_a_host_are_unhealthy_and_skipped() -> None:
    """Real node data with one host of a slice gone (as when a TPU VM is preempted)."""
    from ray._private.state import available_resources_per_node

    nodes = ray.nodes()
    gone = next(n for n in nodes if n["Labels"].get("ray.io/tpu-slice-name") == V4_16[0]
                and n["Labels"]["ray.io/tpu-worker-id"] == "1")
    nodes = [n for n in nodes if n is not gone]
    slices, _ = discover_slices(nodes, available_resources_per_node())
    broken = next(s for s in slices if s.info.name == V4_16[0])
    assert broken.problems == ("1/2 hosts present, missing worker(s) [1]",)
    assert (broken.state, broken.idle) == ("unhealthy", False)
