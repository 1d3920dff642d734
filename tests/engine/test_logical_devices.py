"""Device assignments and logical devices (model parallelism inside a replica)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import ATOL, RTOL, tf_rebatch

import jaxpod
from jaxpod.pieces import Streamed


def np_tiling(mesh_shape: Sequence[int], computation_shape: Sequence[int]) -> list[list[int]]:
    """Device ids of each replica: the mesh (devices in row-major order) cut into
    blocks of ``computation_shape``, blocks and the devices inside a block both in
    row-major order."""
    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    grid = [m // c for m, c in zip(mesh_shape, computation_shape, strict=True)]
    blocks = []
    for g in np.ndindex(*grid):
        index = tuple(slice(i * c, (i + 1) * c)
                      for i, c in zip(g, computation_shape, strict=True))
        blocks.append(ids[index].ravel().tolist())
    return blocks


def ids(devices: np.ndarray) -> list[list[int]]:
    return [[d.id for d in row] for row in devices]


def build(mesh_shape: Sequence[int], computation_shape: Sequence[int] | None,
          num_replicas: int | None = None) -> jaxpod.DeviceAssignment:
    topology = jaxpod.Topology.from_devices(jax.devices(), mesh_shape=mesh_shape)
    return jaxpod.DeviceAssignment.build(topology, computation_shape, num_replicas)


# ------------------------------------------------------------ device assignment
@pytest.mark.parametrize("n", [1, 2, 8])
def test_build_from_a_device_list(n: int) -> None:
    da = jaxpod.DeviceAssignment.build(jax.devices()[:n])
    assert da.topology.mesh_shape == (n, 1, 1, 1)
    assert da.num_replicas == n
    assert da.num_cores_per_replica == 1
    assert da.mesh.axis_names == ("replica", "model")
    assert da.mesh.devices.shape == (n, 1)
    assert ids(da.replica_devices) == [[i] for i in range(n)]
    strategy = jaxpod.TPUStrategy(device_assignment=da)
    assert strategy.num_replicas_in_sync == n


def test_topology_of_all_devices() -> None:
    topology = jaxpod.Topology.from_devices()
    assert topology.mesh_shape == (8, 1, 1, 1)
    assert topology.num_devices == 8
    shaped = jaxpod.Topology.from_devices(jax.devices(), mesh_shape=(2, 2, 1, 2))
    assert shaped.devices.shape == (2, 2, 1, 2)
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(shaped.devices),
                                  np.arange(8).reshape(2, 2, 1, 2))


TILINGS: list[tuple[tuple[int, ...], list[int] | None, int | None]] = [
    ((4, 1, 1, 2), [1, 1, 1, 2], None),
    ((2, 2, 1, 2), [1, 2, 1, 2], None),
    ((2, 2, 1, 2), [2, 1, 1, 1], None),
    ((2, 2, 2, 1), [1, 2, 2, 1], 1),
    ((8, 1, 1, 1), [2, 1, 1, 1], 3),
    ((2, 2, 1, 2), None, None),
    ((2, 2, 1, 2), [2, 2, 1, 2], None),
]


@pytest.mark.parametrize(("mesh_shape", "computation_shape", "num_replicas"), TILINGS)
def test_build_tiles_the_mesh(mesh_shape: tuple[int, ...], computation_shape: list[int] | None,
                              num_replicas: int | None) -> None:
    da = build(mesh_shape, computation_shape, num_replicas)
    shape = computation_shape or [1] * len(mesh_shape)
    blocks = np_tiling(mesh_shape, shape)
    want = blocks if num_replicas is None else blocks[:num_replicas]
    assert da.num_replicas == len(want)
    assert da.num_cores_per_replica == math.prod(shape)
    assert ids(da.replica_devices) == want
    assert da.mesh.axis_names == ("replica", "model")
    assert ids(da.mesh.devices) == want
    assert tuple(da.computation_shape) == tuple(shape)


@pytest.mark.parametrize(("computation_shape", "num_replicas", "match"), [
    ([1, 1, 1], None, "computation_shape"),  # wrong rank
    ([1, 1, 1, 1, 1], None, "computation_shape"),
    ([0, 1, 1, 2], None, "positive"),
    ([-1, 1, 1, 2], None, "positive"),
    ([3, 1, 1, 1], None, "fit"),  # does not divide
    ([8, 1, 1, 1], None, "fit"),  # bigger than the mesh
    ([1, 1, 1, 2], 5, "replicas"),  # only 4 fit
    ([1, 1, 1, 2], 0, "num_replicas"),
])
def test_build_rejects_bad_shapes(computation_shape: list[int], num_replicas: int | None,
                                  match: str) -> None:
    topology = jaxpod.Topology.from_devices(jax.devices(), mesh_shape=(4, 1, 1, 2))
    with pytest.raises(ValueError, match=match):
        jaxpod.DeviceAssignment.build(topology, computation_shape, num_replicas)


def test_topology_rejects_a_mesh_shape_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="mesh_shape"):
        jaxpod.Topology.from_devices(jax.devices(), mesh_shape=(3, 1, 1, 2))
    with pytest.raises(ValueError, match="device"):
        jaxpod.Topology.from_devices([])


# ---------------------------------------------------------------- logical devices
def test_model_parallel_step_equals_numpy(model_parallel_strategy: jaxpod.TPUStrategy) -> None:
    """4 replicas x 2 logical devices; input split over the logical devices, weights
    replicated, one intermediate assigned to logical device 1: the annotations change
    placement only, so the results are the plain math, and data parallelism still
    works across replicas (all_reduce, reduce, gather)."""
    strategy = model_parallel_strategy
    assert strategy.num_replicas_in_sync == 4
    assert strategy.device_assignment.num_cores_per_replica == 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    shardings: list[Any] = []

    def fn(batch: jax.Array, w: jax.Array) -> dict[str, jax.Array]:
        xs = strategy.experimental_split_to_logical_devices(batch, [2, 1])
        jax.debug.inspect_array_sharding(xs, callback=shardings.append)
        h = xs @ strategy.experimental_replicate_to_logical_devices(w)
        h = strategy.experimental_assign_to_logical_device(jnp.tanh(h), 1)
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return {"h": h, "total": ctx.all_reduce("SUM", jnp.sum(h, axis=0))}

    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    out = strategy.run(fn, args=(batch, w))
    want = np.tanh(x.astype(np.float64) @ w)
    np.testing.assert_allclose(strategy.gather(out["h"], 0), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(strategy.reduce("MEAN", out["h"], axis=0), want.mean(axis=0),
                               rtol=RTOL, atol=ATOL)
    for total in np.asarray(out["total"].array):
        np.testing.assert_allclose(total, want.sum(axis=0), rtol=1e-4, atol=1e-4)
    # the split really shards each replica's rows over its 2 logical devices
    assert len(shardings) == 1
    assert shardings[0].shard_shape((8, 6)) == (4, 6)


@pytest.mark.parametrize("dims", [[2, 2], [4, 1], [1, 4]])
def test_four_logical_devices(four_core_strategy: jaxpod.TPUStrategy, dims: list[int]) -> None:
    strategy = four_core_strategy
    assert strategy.num_replicas_in_sync == 2
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(2, 8, 4)).astype(np.float32)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: xs[ctx.replica_id_in_sync_group])
    shardings: list[Any] = []

    def fn(v: jax.Array) -> jax.Array:
        s = strategy.experimental_split_to_logical_devices(v, dims)
        jax.debug.inspect_array_sharding(s, callback=shardings.append)
        return strategy.experimental_replicate_to_logical_devices(jnp.sin(s) * 2.0)

    out = strategy.run(fn, args=(value,))
    np.testing.assert_allclose(np.asarray(out.array), np.sin(xs) * 2.0, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(strategy.reduce("SUM", out), (np.sin(xs) * 2.0).sum(axis=0),
                               rtol=RTOL, atol=ATOL)
    assert shardings[0].shard_shape((8, 4)) == (8 // dims[0], 4 // dims[1])


def test_local_results_of_a_value_split_over_logical_devices(
        model_parallel_strategy: jaxpod.TPUStrategy) -> None:
    """A step output left split over the logical devices is still each replica's whole
    value in ``experimental_local_results``."""
    strategy = model_parallel_strategy
    xs = np.arange(4 * 4 * 6, dtype=np.float32).reshape(4, 4, 6)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: xs[ctx.replica_id_in_sync_group])
    out = strategy.run(
        lambda v: strategy.experimental_split_to_logical_devices(v * 2.0, [2, 1]),
        args=(value,))
    np.testing.assert_array_equal(strategy.gather(out, 0), (xs * 2.0).reshape(16, 6))
    results = strategy.experimental_local_results(out)
    assert len(results) == 4
    for got, want in zip(results, xs * 2.0, strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_gather_parts_as_views_and_streamed(model_parallel_strategy: jaxpod.TPUStrategy
                                           ) -> None:
    """What a host worker streams for a remote gather: a component one device holds
    whole is a view of its memory, a component split over logical devices is assembled,
    and the streamed buffer is a view carrying exactly the rows' bytes."""
    strategy = model_parallel_strategy
    xs = np.arange(4 * 4 * 6, dtype=np.float32).reshape(4, 4, 6) - 7.5
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: xs[ctx.replica_id_in_sync_group])
    split = strategy.run(
        lambda v: strategy.experimental_split_to_logical_devices(v * 2.0, [2, 1]),
        args=(value,))
    for source, want, whole in ((value, xs, True), (split, xs * 2.0, False)):
        ax, parts = strategy.extended.gather_parts(source, 0, replicas=(1, 3), views=True)
        assert ax == 0 and len(parts) == 2
        for got, expected in zip(parts, want[[1, 3]], strict=True):
            np.testing.assert_array_equal(got, expected)
            assert got.flags.owndata is not whole  # whole components are device views
        streamed = Streamed(parts[1])  # what a worker sends: a view, not a copy
        assert streamed.nbytes == want[3].nbytes and streamed.data == want[3].tobytes()
        assert np.shares_memory(np.frombuffer(streamed.data, np.uint8), parts[1])


def test_model_parallel_partial_batches(model_parallel_strategy: jaxpod.TPUStrategy) -> None:
    strategy = model_parallel_strategy
    data = np.random.default_rng(2).normal(size=(10, 4)).astype(np.float32)
    elements = [data[:8], data[8:]]
    expected = tf_rebatch(elements, 8, 4)

    def fn(batch: jax.Array) -> jax.Array:
        return strategy.experimental_split_to_logical_devices(batch, [1, 2]) + 1.0

    for batch, want in zip(strategy.experimental_distribute_dataset(elements), expected,
                           strict=True):
        out = strategy.run(fn, args=(batch,))
        real = np.concatenate(want) + 1.0
        np.testing.assert_allclose(strategy.gather(out, 0), real, rtol=RTOL)
        np.testing.assert_allclose(strategy.reduce("MEAN", out, axis=0), real.mean(axis=0),
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("shape", "dims", "match"), [
    ((8, 6), [2], "rank"),  # one entry per dimension
    ((8, 6), [2, 1, 1], "rank"),
    ((8, 6), [1, 1], "product"),
    ((8, 6), [2, 2], "product"),
    ((7, 6), [2, 1], "divisible"),
    ((8, 5), [1, 2], "divisible"),
    ((8, 6), [-1, -2], "positive"),
])
def test_split_validation(model_parallel_strategy: jaxpod.TPUStrategy, shape: tuple[int, ...],
                          dims: list[int], match: str) -> None:
    strategy = model_parallel_strategy
    value = strategy.experimental_distribute_values_from_function(
        lambda _: np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match=match):
        strategy.run(lambda v: strategy.experimental_split_to_logical_devices(v, dims),
                     args=(value,))


@pytest.mark.parametrize("device_id", [2, -1, 7])
def test_assign_rejects_an_unknown_logical_device(
        model_parallel_strategy: jaxpod.TPUStrategy, device_id: int) -> None:
    strategy = model_parallel_strategy
    with pytest.raises(ValueError, match=str(device_id)):
        strategy.run(lambda: strategy.experimental_assign_to_logical_device(
            jnp.zeros((2,)), device_id))


@pytest.mark.one_logical_device
def test_annotations_on_one_logical_device(sstrategy: jaxpod.TPUStrategy) -> None:
    """With one logical device per replica the annotations are identities, and still
    validated."""
    r = sstrategy.num_replicas_in_sync
    xs = np.random.default_rng(3).normal(size=(r, 4, 2)).astype(np.float32)
    value = sstrategy.experimental_distribute_values_from_function(
        lambda ctx: xs[ctx.replica_id_in_sync_group])

    def fn(v: jax.Array) -> jax.Array:
        a = sstrategy.experimental_split_to_logical_devices(v, [1, 1])
        b = sstrategy.experimental_replicate_to_logical_devices(a)
        return sstrategy.experimental_assign_to_logical_device(b * 3.0, 0)

    out = sstrategy.run(fn, args=(value,))
    np.testing.assert_allclose(np.stack(sstrategy.experimental_local_results(out)), xs * 3.0)
    with pytest.raises(ValueError, match="product"):
        sstrategy.run(lambda v: sstrategy.experimental_split_to_logical_devices(v, [2, 1]),
                      args=(value,))
    with pytest.raises(ValueError, match="logical_device_id"):
        sstrategy.run(lambda v: sstrategy.experimental_assign_to_logical_device(v, 1),
                      args=(value,))


def test_default_strategy_uses_every_device() -> None:
    strategy = jaxpod.TPUStrategy(resolver="local")
    assert strategy.num_replicas_in_sync == len(jax.devices()) == 8
    assert strategy.cluster_resolver == "local"
    assert strategy.steps_per_run == 1
    assert strategy.device_assignment.num_cores_per_replica == 1
