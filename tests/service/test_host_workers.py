"""Host workers on the simulated local cluster: one JAX process per TPU host.

Real Ray actors on a simulated v4-16 (2 hosts x 4 chips), real multi-process JAX over
gloo. Every answer is compared with the in-process engine on this process's 8
simulated devices, and with numpy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpod
from jaxpod import operations as ops
from jaxpod.pieces import PieceLayout
from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.local_cluster import LocalTPUCluster
from jaxpod.service.capacity.pools import placements
from jaxpod.service.capacity.ray_workers import RayWorkers
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.group_results import GatherParts
from jaxpod.service.slices.replica_group import ReplicaGroup

CLUSTER_SLICES = "v4-16,v4-16"  # one for the shared group, one for start-up faults


@pytest.fixture(scope="module")
def local() -> jaxpod.TPUStrategy:
    return jaxpod.TPUStrategy()


def _step(x: jax.Array, scale: jax.Array) -> dict[str, jax.Array]:
    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    return {"y": x * scale + ctx.replica_id_in_sync_group,
            "total": ctx.all_reduce("SUM", jnp.sum(x, axis=0)),
            "gathered": ctx.all_gather(x, axis=0)}


def test_group_spans_two_hosts(group: GroupEngine) -> None:
    info = group.group.info
    assert [i["process_index"] for i in info] == [0, 1]
    assert all(i["global_devices"] == 8 and i["local_devices"] == 4 for i in info)
    assert group.num_replicas_in_sync == 8


def test_large_results_are_read_in_place_from_workers_on_this_machine(
        group: GroupEngine) -> None:
    # Both simulated hosts run here: the handshake found their memory readable.
    lenders = [c.lender for c in group.group._channels]
    assert len(set(lenders)) == 2 and os.getpid() not in lenders and 0 not in lenders
    data = np.random.default_rng(5).normal(size=(8, 300, 100)).astype(np.float32)  # 117 KiB

    def value_fn(ctx: jaxpod.ValueContext) -> np.ndarray:
        return data[ctx.replica_id_in_sync_group]

    value = group.experimental_distribute_values_from_function(value_fn)
    np.testing.assert_array_equal(group.gather(value, axis=0), data.reshape(2400, 100))
    for got, want in zip(group.local_results(value), data, strict=True):
        np.testing.assert_array_equal(got, want)
    # Received as the service streams a gather: pieces, each behind its prefix.
    layout = PieceLayout(piece_bytes=50_000, prefix=lambda n: b"<" + n.to_bytes(4) + b">")
    (gathered,) = jax.tree.leaves(group.gather_parts(value, 0, layout),
                                  is_leaf=lambda x: isinstance(x, GatherParts))
    for replica, part in enumerate(gathered.parts):
        rows = data[replica].tobytes()
        assert len(part.pieces) == 3 and all(type(p) is bytes for p in part.pieces)
        assert part.nbytes == len(rows)
        assert b"".join(part.pieces) == b"".join(
            layout.prefix(len(rows[i:i + 50_000])) + rows[i:i + 50_000]
            for i in range(0, len(rows), 50_000))


def test_run_reduce_gather_local_results_match_in_process(
        group: GroupEngine, local: jaxpod.TPUStrategy) -> None:
    data = np.random.default_rng(0).normal(size=(8, 5, 3)).astype(np.float32)

    def value_fn(ctx: jaxpod.ValueContext) -> np.ndarray:
        return data[ctx.replica_id_in_sync_group]

    rv = group.experimental_distribute_values_from_function(value_fn)
    lv = local.experimental_distribute_values_from_function(value_fn)
    ro = group.run(_step, args=(rv, np.float32(3.0)))
    lo = local.run(_step, args=(lv, np.float32(3.0)))
    for name in ("y", "total", "gathered"):
        got = group.local_results(ro[name])
        want = local.experimental_local_results(lo[name])
        assert len(got) == len(want) == 8
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    for op in ("SUM", "MEAN", "MIN", "MAX"):
        for axis in (None, 0, 1):
            np.testing.assert_allclose(group.reduce(op, ro["y"], axis=axis),
                                       local.reduce(op, lo["y"], axis=axis), rtol=1e-5)
    for axis in (0, 1):
        np.testing.assert_allclose(group.gather(ro["y"], axis=axis),
                                   local.gather(lo["y"], axis=axis))
    # And against numpy directly.
    y = data * 3.0 + np.arange(8, dtype=np.float32)[:, None, None]
    np.testing.assert_allclose(group.gather(ro["y"], axis=0), y.reshape(40, 3), rtol=1e-6)
    np.testing.assert_allclose(group.reduce("SUM", ro["total"]), 8 * data.sum(axis=(0, 1)),
                               rtol=1e-5)


def test_dataset_sharding_sees_every_element_once_per_epoch(group: GroupEngine) -> None:
    # 6 global batches of 8 rows, each row tagged with its global index.
    ids = np.arange(48, dtype=np.int32)
    batches = [ids[i:i + 8] for i in range(0, 48, 8)]
    dataset = group.experimental_distribute_dataset(batches)
    for _epoch in range(2):
        seen = [group.local_results(b) for b in dataset]
        rows = np.concatenate([r for step in seen for r in step])
        np.testing.assert_array_equal(np.sort(rows), ids)  # each exactly once


def test_run_steps_with_infeed_over_generated_dataset(group: GroupEngine,
                                                      local: jaxpod.TPUStrategy) -> None:
    """A dataset produced on each host by a function: never held whole anywhere."""
    steps, rows, features = 40, 4, 16

    def dataset_fn(ctx: jaxpod.InputContext) -> Iterator[np.ndarray]:
        replicas_here = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        for s in range(steps):
            for r in range(replicas_here):
                replica = ctx.input_pipeline_id * replicas_here + r
                yield np.full((rows, features), s * 100 + replica, np.float32)

    def train(state: jax.Array, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return state + ctx.all_reduce("SUM", jnp.mean(batch)), jnp.mean(batch)

    dataset = group.distribute_datasets_from_function(dataset_fn)
    it = iter(dataset)
    state = np.float32(0.0)
    calls = 0
    while True:
        try:
            state, out = group.make_values(train, lambda f: ops.RunSteps(
                f, it.id, 16, group.handles(state)))  # noqa: B023
        except jaxpod.EndOfDataError:
            break
        calls += 1
    assert calls == 3  # 16 + 16 + 8 steps
    expected = sum(sum(s * 100 + r for r in range(8)) for s in range(steps))
    np.testing.assert_allclose(group.local_results(state),
                               np.full(8, expected, np.float32), rtol=1e-6)
    last = group.local_results(out)
    np.testing.assert_allclose(last, [(steps - 1) * 100 + r for r in range(8)])


def test_user_exception_in_step_function_reaches_caller(group: GroupEngine) -> None:
    value = group.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))

    def broken(x: jax.Array) -> jax.Array:
        raise KeyError("no such feature: 'age'")

    with pytest.raises(KeyError, match="no such feature") as info:
        group.run(broken, args=(value,))
    assert any("Remote traceback" in note for note in info.value.__notes__)
    # The group keeps serving after a user error.
    out = group.run(lambda x: x + 1, args=(value,))
    np.testing.assert_allclose(group.gather(out, axis=0), np.repeat(np.arange(8), 2) + 1)


def test_user_exception_in_dataset_function_reaches_caller(group: GroupEngine) -> None:
    def dataset_fn(ctx: jaxpod.InputContext) -> Iterator[np.ndarray]:
        yield np.zeros((2, 2), np.float32)
        raise OSError("shard file gs://bucket/part-7 is corrupt")

    it = iter(group.distribute_datasets_from_function(dataset_fn))
    with pytest.raises(OSError, match="part-7 is corrupt"):
        for _ in range(10):
            next(it)


def test_handles_are_freed_when_values_are_collected(group: GroupEngine) -> None:
    value = group.experimental_distribute_values_from_function(
        lambda ctx: np.ones((256,), np.float32))
    before = group.stats()
    del value
    after = group.stats()  # the stats call itself flushes the pending free
    assert all(a["num_values"] == b["num_values"] - 1 for a, b in zip(after, before,
                                                                       strict=True))
    assert all(a["device_bytes"] < b["device_bytes"] for a, b in zip(after, before,
                                                                      strict=True))


def test_iterators_are_freed_when_dropped(group: GroupEngine) -> None:
    dataset = group.experimental_distribute_dataset([np.zeros((8, 2), np.float32)] * 4)
    it = iter(dataset)
    next(it)
    with_iterator = group.stats()
    del it
    after = group.stats()
    assert all(a["num_iterators"] == b["num_iterators"] - 1 for a, b in zip(
        after, with_iterator, strict=True))


def test_host_that_never_joins_gives_worker_start_error(ray_cluster: LocalTPUCluster) -> None:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    allocation = SliceAllocator().allocate("v4-16", timeout_s=60)
    hosts = placements(allocation)

    @ray.remote
    class Squatter:
        """Holds host 1's chips, as a stray process on that host would."""

        def ready(self) -> bool:
            return True

    squatter = Squatter.options(  # type: ignore[attr-defined]
        num_cpus=hosts[1].num_cpus, resources=hosts[1].resources,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            hosts[1].placement_group, placement_group_bundle_index=hosts[1].bundle_index),
    ).remote()
    try:
        assert ray.get(squatter.ready.remote(), timeout=60)
        start = time.monotonic()
        with pytest.raises(jaxpod.WorkerStartError, match=r"JAXPOD_WORKER_START_TIMEOUT_S"):
            ReplicaGroup.start(hosts, devices_per_host=4, launcher=RayWorkers(),
                               start_timeout_s=8)
        elapsed = time.monotonic() - start
        assert 8 <= elapsed < 8 + 15, elapsed  # waited the time-out, then gave up cleanly
    finally:
        ray.kill(squatter)
        allocation.release()
