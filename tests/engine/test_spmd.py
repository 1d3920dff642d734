"""``strategy.spmd``: a global-view program called step by step, on every backend.

The state stays on the devices between calls with the sharding ``init`` gave it; every
expected value is computed with numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import ATOL, RTOL
from jax.sharding import PartitionSpec as P

import jaxpod

MESH = {"data": 4, "model": 2}
ROWS, IN, OUT = 16, 8, 4
LR = 0.1


def init() -> dict[str, jax.Array]:
    w = jnp.arange(IN * OUT, dtype=jnp.float32).reshape(IN, OUT) / (IN * OUT)
    # Bare specs name the mesh's axes: the mesh is current while init traces.
    return {"w": jax.lax.with_sharding_constraint(w, P("data", "model")),
            "b": jnp.zeros((OUT,), jnp.float32)}


def step(state: dict[str, jax.Array], x: jax.Array, y: jax.Array
         ) -> tuple[dict[str, jax.Array], jax.Array]:
    assert jaxpod.mesh().shape == MESH  # the slice's mesh, while tracing

    def loss_fn(s: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((x @ s["w"] + s["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    return jax.tree.map(lambda p, g: p - LR * g, state, grads), loss


def np_steps(batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[dict[str, np.ndarray],
                                                                    list[float]]:
    w = np.arange(IN * OUT, dtype=np.float64).reshape(IN, OUT) / (IN * OUT)
    b = np.zeros(OUT)
    losses = []
    for x, y in batches:
        err = x @ w + b - y
        losses.append(float(np.mean(err ** 2)))
        g = 2 * err / err.size
        w, b = w - LR * x.T @ g, b - LR * g.sum(0)
    return {"w": w, "b": b}, losses


def test_spmd_keeps_sharded_state_on_the_devices_and_matches_numpy(
        strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(8)
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(ROWS, IN)).astype(np.float32),
                rng.normal(size=(ROWS, OUT)).astype(np.float32)) for _ in range(3)]
    state = strategy.spmd(init, mesh=MESH)()
    assert tuple(state["w"].shape) == (IN, OUT)  # a global value: no replica axis
    train = strategy.spmd(step, mesh=MESH, batch_sharding=P("data"))
    losses = []
    for x, y in batches:
        state, loss = train(state, x, y)
        losses.append(float(np.asarray(loss)))
    expected, expected_losses = np_steps(batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=RTOL, atol=ATOL)
    for key in expected:
        np.testing.assert_allclose(np.asarray(state[key]), expected[key], rtol=RTOL, atol=ATOL)


def test_spmd_default_mesh_splits_rows_over_data(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(8)
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    col = np.arange(5, dtype=np.float32)  # 5 rows do not divide: replicated

    def fn(a: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        assert jaxpod.mesh().shape == {"data": 8}
        return (a * 2).sum(axis=1), c.sum()

    rows, total = strategy.spmd(fn)(x, col)
    np.testing.assert_allclose(np.asarray(rows), (x * 2).sum(axis=1))
    np.testing.assert_allclose(np.asarray(total), col.sum())


def test_spmd_refuses_per_replica_values_and_bad_arguments(
        strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(8)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    with pytest.raises(TypeError, match=r"PerReplica value .* cannot be an argument"):
        strategy.spmd(lambda v: v + 1)(per_replica)
    with pytest.raises(TypeError, match="batch_sharding must be one"):
        strategy.spmd(step, mesh=MESH, batch_sharding=("data",))
    with pytest.raises(ValueError, match="only one axis may be -1"):
        strategy.spmd(step, mesh={"data": -1, "model": -1})
    with pytest.raises(TypeError, match="fn must be a function"):
        strategy.spmd(3)
    # A mesh the slice cannot hold fails on the devices, with the sizes named.
    with pytest.raises(ValueError, match="the slice has 8"):
        strategy.spmd(init, mesh={"data": 3})()
    # Values stay on the mesh that made them.
    state = strategy.spmd(init, mesh=MESH)()
    with pytest.raises(ValueError, match="Use the same mesh="):
        strategy.spmd(lambda s: s["w"] * 2, mesh={"data": 8})(state)
    # The strategy still computes afterwards.
    doubled = strategy.spmd(lambda s: s["b"] + 1, mesh=MESH)(state)
    np.testing.assert_allclose(np.asarray(doubled), np.ones(OUT))


def test_cross_replica_methods_take_a_global_value_as_one_value(
        strategy_of: Callable[..., Any]) -> None:
    """A global value has no replicas: ``reduce`` with ``axis=None`` gives it whole and
    with an axis reduces along it; ``gather`` refuses it, naming the fix; its local
    results are the value itself, on every backend alike."""
    strategy = strategy_of(8)
    x = np.arange(ROWS * OUT, dtype=np.float32).reshape(ROWS, OUT)
    rows, total = strategy.spmd(lambda v: (v * 2, jnp.sum(v)), batch_sharding=P("data"))(x)
    for op in ("SUM", "MEAN", "MAX"):
        np.testing.assert_allclose(strategy.reduce(op, total, axis=None), x.sum(), rtol=RTOL)
        np.testing.assert_allclose(strategy.reduce(op, rows, axis=None), x * 2, rtol=RTOL)
    np.testing.assert_allclose(strategy.reduce("SUM", rows, axis=0), (x * 2).sum(0), rtol=RTOL)
    np.testing.assert_allclose(strategy.reduce("MEAN", rows, axis=1), (x * 2).mean(1),
                               rtol=RTOL)
    with pytest.raises(TypeError, match="global"):
        strategy.gather(rows, axis=0)
    local = strategy.experimental_local_results(rows)
    assert len(local) == 1
    np.testing.assert_allclose(np.asarray(local[0]), x * 2, rtol=RTOL)
