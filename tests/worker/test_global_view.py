"""A global-view job's programs on one host (8 CPU devices, mesh ``data`` 4 x ``model`` 2).

``init_fn`` leaves keep their shardings through donated loops fed by the engine's
infeed, batches are split as ``batch_sharding`` says, the results equal numpy, and a
checkpoint restores onto the shardings ``init_fn`` gives without running it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpod
from jaxpod.worker.checkpoints import HostCheckpoints
from jaxpod.worker.device_assignment import DeviceAssignment
from jaxpod.worker.engine import Engine
from jaxpod.worker.global_view import GlobalValue, GlobalView

ROWS, FEATURES = 16, 6
MESH = {"data": -1, "model": 2}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(DeviceAssignment.build(None))


def init_fn() -> dict[str, Any]:
    assert dict(jaxpod.mesh().shape) == {"data": 4, "model": 2}
    return {"w": jax.lax.with_sharding_constraint(
                jnp.arange(FEATURES * 8, dtype=jnp.float32).reshape(FEATURES, 8),
                P(None, "model")),
            "big": jax.lax.with_sharding_constraint(jnp.ones((32, 4), jnp.float32),
                                                    P(("data", "model"))),
            "key": jax.random.key(3)}


def step_fn(state: Any, batch: Any) -> Any:
    seen = jax.lax.with_sharding_constraint(batch["x"], P("data"))
    total = jnp.sum(seen)
    new = {"w": state["w"] * 0.5 + total, "big": state["big"] + jnp.mean(batch["x"]),
           "key": jax.random.split(state["key"])[0]}
    return new, {"total": total}


def data(count: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32)} for _ in range(count)]


def leaf_arrays(state: Any) -> dict[str, jax.Array]:
    return {k: v.array for k, v in state.items()}


@pytest.mark.parametrize("in_loop", [True, False])
def test_loops_keep_the_shardings_donate_the_state_and_match_numpy(engine: Engine,
                                                                   in_loop: bool) -> None:
    """``in_loop``: the mesh keeps the engine's device order and the loop lays the rows
    out; else (TPU meshes follow the torus) they are resharded onto it first."""
    view = GlobalView(engine, MESH, None)
    view._same_order = in_loop
    state = view.init(init_fn)
    first = leaf_arrays(state)
    assert first["w"].sharding.spec == P(None, "model")
    assert {s.data.shape for s in first["big"].addressable_shards} == {(4, 4)}
    iterator = iter(engine.experimental_distribute_dataset(data()))
    state, outputs = view.run_steps(step_fn, iterator, 3, state)
    after = leaf_arrays(state)
    assert all(a.is_deleted() for k, a in first.items() if k != "key")  # donated
    assert after["w"].sharding.spec == P(None, "model")
    assert {s.data.shape for s in after["big"].addressable_shards} == {(4, 4)}
    w = np.arange(FEATURES * 8, dtype=np.float64).reshape(FEATURES, 8)
    big = np.ones((32, 4))
    totals = []
    for batch in data():
        totals.append(batch["x"].astype(np.float64).sum())
        w, big = w * 0.5 + totals[-1], big + batch["x"].astype(np.float64).mean()
    np.testing.assert_allclose(np.asarray(after["w"]), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(after["big"]), big, rtol=1e-5)
    assert outputs["total"].shape == (3,)
    # A global value is one value: reduce along its steps' axis, as the hosts do.
    total = engine.reduce("MEAN", outputs["total"].array, 0)
    np.testing.assert_allclose(total, np.mean(totals), rtol=1e-5)


def test_a_checkpoint_restores_onto_init_fns_shardings(engine: Engine, tmp_path: Path) -> None:
    view = GlobalView(engine, MESH, None)
    iterator = iter(engine.experimental_distribute_dataset(data()))
    state, _ = view.run_steps(step_fn, iterator, 2, view.init(init_fn))
    host = HostCheckpoints()
    try:
        host.save(str(tmp_path), 2, 2, state, engine.mesh, None, "test/input")
        assert host.wait(str(tmp_path)) == 2
    finally:
        host.close()
    skeleton = {"big": 0, "key": 1, "w": 2}  # leaf indices in tree order
    reader = HostCheckpoints()
    try:
        restored, position = reader.restore(str(tmp_path), 2, 2, skeleton, engine.mesh, 0,
                                            targets=view.abstract_init(init_fn))
    finally:
        reader.close()
    assert position is None
    for key, value in leaf_arrays(state).items():
        got = restored[key].array
        assert isinstance(restored[key], GlobalValue) and got.sharding == value.sharding, key
        same = (jax.random.key_data(got), jax.random.key_data(value)) if key == "key" \
            else (got, value)
        assert np.array_equal(np.asarray(same[0]), np.asarray(same[1])), key


def test_batch_sharding_splits_each_leaf_as_given(engine: Engine) -> None:
    seen: dict[str, Any] = {}

    def inspect(state: Any, batch: Any) -> Any:
        for name, x in batch.items():
            jax.debug.inspect_array_sharding(
                x, callback=lambda s, name=name, shape=x.shape: seen.setdefault(
                    name, tuple(s.shard_shape(shape))))
        return state, {}

    view = GlobalView(engine, MESH, {"x": P("data"), "y": P(None, "model")})
    batches = [{"x": np.ones((ROWS, 4), np.float32), "y": np.ones((ROWS, 4), np.float32)}]
    view.run_steps(inspect, iter(engine.experimental_distribute_dataset(batches)), 1, ())
    assert seen == {"x": (ROWS // 4, 4), "y": (ROWS, 2)}


@pytest.mark.parametrize("step, batch_rows, sharding, message", [
    (step_fn, 12, None, "must split evenly over the slice's 8 devices"),
    (lambda s, b: (s, {"v": b["x"][0]}), ROWS, None, "output 'v' must be a scalar"),
    (step_fn, ROWS, {"z": P()}, "batch_sharding must be one PartitionSpec"),
])
def test_what_a_global_step_cannot_take_is_said(engine: Engine, step: Any, batch_rows: int,
                                                sharding: Any, message: str) -> None:
    view = GlobalView(engine, MESH, sharding)
    batches = [{"x": np.ones((batch_rows, FEATURES), np.float32)}]
    state = view.init(init_fn)
    with pytest.raises((ValueError, TypeError), match=message):
        view.run_steps(step, iter(engine.experimental_distribute_dataset(batches)), 1, state)


def test_a_mesh_that_does_not_fit_the_slice_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="the slice has 8"):
        GlobalView(engine, {"data": 3}, None)
    with pytest.raises(RuntimeError, match="outside a global-view job"):
        jaxpod.mesh()
