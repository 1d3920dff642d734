"""A host's checkpoints, in one process (8 CPU devices: 4 replicas of 2 logical devices).

A mirrored state of arrays of several shapes (split over the replicas, or kept whole
when no axis divides) and a typed PRNG key is saved and read back: with plain orbax in
this process (numpy, no target), and restored onto the mesh both ways a slice does it
(each device reading its replica's part and gathering on device, or reading its whole
copy), every replica equal to the saved values, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.values import PerReplica
from jaxpod.worker.checkpoints import HostCheckpoints, Layout, LeafSpec
from jaxpod.worker.device_assignment import MODEL_AXIS
from jaxpod.worker.replica_context import REPLICA_AXIS

REPLICAS = 4


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    devices = np.array(jax.devices()[:2 * REPLICAS]).reshape(REPLICAS, 2)
    return Mesh(devices, (REPLICA_AXIS, MODEL_AXIS))


def values() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {"w": rng.normal(size=(8, 6)).astype(np.float32),     # split along axis 0
            "b": rng.normal(size=(3,)).astype(np.float32),       # no axis divides: whole
            "t": rng.integers(0, 9, size=(3, 12)).astype(np.int8),  # split along axis 1
            "n": np.int32(7)}


def mirrored(value: np.ndarray, mesh: Mesh) -> PerReplica:
    """Every replica holding ``value``, as a job's state is."""
    stacked = np.broadcast_to(value, (REPLICAS, *np.shape(value)))
    return PerReplica(jax.device_put(stacked, NamedSharding(mesh, P(REPLICA_AXIS))))


def state(mesh: Mesh) -> dict[str, Any]:
    out = {k: mirrored(v, mesh) for k, v in values().items()}
    keys = jax.random.split(jax.random.key(11), REPLICAS)  # one key, each replica's copy
    same = jax.numpy.stack([keys[0]] * REPLICAS)
    out["key"] = PerReplica(jax.device_put(same, NamedSharding(mesh, P(REPLICA_AXIS))))
    return out


def test_leaves_are_split_over_the_replicas_where_an_axis_divides(mesh: Mesh) -> None:
    layout = Layout(mesh)
    specs = {k: layout.leaf_spec(v) for k, v in state(mesh).items()}
    assert {k: layout.split_axis(s) for k, s in specs.items()} == {
        "w": 0, "b": None, "t": 1, "n": None, "key": None}
    assert specs["key"] == LeafSpec((2,), "uint32", (None,), "threefry2x32")
    assert layout.stored(specs["w"]).spec == P(REPLICA_AXIS, None)


@pytest.mark.parametrize("gather", [True, False])
def test_a_saved_state_reads_back_bit_for_bit(mesh: Mesh, tmp_path: Path,
                                              gather: bool) -> None:
    saved = state(mesh)
    positions = [{"at": {"index": 5, "rows": 2}, "batch": 8}]
    host, reader = HostCheckpoints(), HostCheckpoints()
    try:
        host.save(str(tmp_path), 3, 2, saved, mesh, positions[0], "test/input")
        assert host.wait(str(tmp_path)) == 3
        assert host.committed(str(tmp_path)) == 3
        plain = ocp.StandardCheckpointer().restore(tmp_path / "3" / "state")
        for k, v in values().items():
            got = np.asarray(plain[k])
            assert got.dtype == v.dtype and np.array_equal(got, v), k
        key_data = np.asarray(jax.random.key_data(saved["key"].array[0]))
        assert np.array_equal(np.asarray(plain["key"]), key_data)

        treedef = jax.tree.structure(saved, is_leaf=lambda x: isinstance(x, PerReplica))
        skeleton = jax.tree.unflatten(treedef, range(treedef.num_leaves))
        back, position = reader.restore(str(tmp_path), 3, 2, skeleton, mesh, 0,
                                        gather=gather)
        assert position == positions[0]
        for k, v in values().items():
            array = back[k].array
            assert array.shape == (REPLICAS, *np.shape(v))
            assert array.sharding.is_equivalent_to(
                NamedSharding(mesh, P(REPLICA_AXIS)), array.ndim)
            assert np.array_equal(np.asarray(array), np.broadcast_to(v, array.shape)), k
        keys = back["key"].array
        assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
        assert np.array_equal(np.asarray(jax.random.key_data(keys)),
                              np.asarray(jax.random.key_data(saved["key"].array)))
    finally:
        host.close()
        reader.close()


def test_a_warm_slices_next_holder_saves_the_same_state_without_compiling(
        mesh: Mesh, tmp_path: Path) -> None:
    """The layout programs outlive ``close`` (a warm slice's reset between holders), as
    the engine's programs do: the next job with the same state compiles nothing to save
    it, and its checkpoint still reads back."""
    compiled: list[str] = []

    def count(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    host = HostCheckpoints()
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for job in ("first", "second"):
            before = len(compiled)
            host.save(str(tmp_path / job), 1, 2, state(mesh), mesh, {}, f"{job}/input")
            assert host.wait(str(tmp_path / job)) == 1
            host.close()
            if job == "first":
                assert len(compiled) > before  # the listener sees this save's compile
            else:
                assert len(compiled) == before
        plain = ocp.StandardCheckpointer().restore(tmp_path / "second" / "1" / "state")
        assert np.array_equal(np.asarray(plain["w"]), values()["w"])
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
        host.close()
