"""The replica context: identity, collectives (values and gradients), and the
cross-replica / default contexts outside ``run``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import ATOL, NP_REDUCERS, RTOL, assert_trees_close

import jaxpod


def distribute(strategy: jaxpod.TPUStrategy, per_replica: np.ndarray) -> jaxpod.PerReplica:
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: per_replica[ctx.replica_id_in_sync_group])


def stacked(strategy: jaxpod.TPUStrategy, value: jaxpod.PerReplica) -> np.ndarray:
    return np.stack(strategy.experimental_local_results(value))


def ctx_now() -> jaxpod.ReplicaContext:
    ctx = jaxpod.get_replica_context()
    assert isinstance(ctx, jaxpod.ReplicaContext)
    return ctx


# --------------------------------------------------------------------- identity
@pytest.mark.in_process
def test_replica_identity_inside_run(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    seen: list[int] = []

    def fn() -> dict[str, jax.Array]:
        ctx = ctx_now()
        seen.append(ctx.num_replicas_in_sync)
        return {"id": ctx.replica_id_in_sync_group,
                "id_f": jnp.asarray(ctx.replica_id_in_sync_group, jnp.float32) * 1.5}

    out = sstrategy.run(fn)
    assert seen == [r]  # traced once; a Python int
    np.testing.assert_array_equal(stacked(sstrategy, out["id"]), np.arange(r))
    np.testing.assert_allclose(stacked(sstrategy, out["id_f"]), np.arange(r) * 1.5)


# --------------------------------------------------------------------- all_reduce
def test_all_reduce_every_op_on_a_pytree(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    a = rng.normal(size=(r, 3)).astype(np.float32)
    b = rng.integers(-5, 5, size=(r, 2, 2)).astype(np.int32)
    ops: list[Any] = ["SUM", "mean", jaxpod.ReduceOp.MIN, jaxpod.ReduceOp.MAX]

    def fn(a: jax.Array, b: jax.Array) -> list[Any]:
        ctx = ctx_now()
        return [ctx.all_reduce(op, {"a": a, "b": (b,)}) for op in ops]

    out = sstrategy.run(fn, args=(distribute(sstrategy, a), distribute(sstrategy, b)))
    for op, got in zip(ops, out, strict=True):
        name = op.value if isinstance(op, jaxpod.ReduceOp) else op.upper()
        want = {"a": NP_REDUCERS[name](a, axis=0), "b": (NP_REDUCERS[name](b, axis=0),)}
        for replica_result in sstrategy.experimental_local_results(got):
            assert_trees_close(replica_result, want)
    mean_b = sstrategy.experimental_local_results(out[1]["b"][0])[0]
    assert np.issubdtype(mean_b.dtype, np.floating)


def test_all_reduce_of_python_scalars(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync

    def fn() -> jax.Array:
        return ctx_now().all_reduce("SUM", 2.0)

    np.testing.assert_allclose(stacked(sstrategy, sstrategy.run(fn)), np.full(r, 2.0 * r))


# --------------------------------------------------------------------- all_gather
def test_all_gather_concatenates_in_replica_order(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.random.default_rng(1).normal(size=(r, 2, 3)).astype(np.float32)

    def fn(x: jax.Array) -> dict[str, Any]:
        ctx = ctx_now()
        return {"0": ctx.all_gather(x, 0), "1": ctx.all_gather(x, 1),
                "-1": ctx.all_gather(x, -1), "tree": ctx.all_gather({"x": x, "y": (x[0],)}, 0)}

    out = sstrategy.run(fn, args=(distribute(sstrategy, xs),))
    want = {"0": np.concatenate(list(xs), 0), "1": np.concatenate(list(xs), 1),
            "-1": np.concatenate(list(xs), -1),
            "tree": {"x": np.concatenate(list(xs), 0),
                     "y": (np.concatenate([x[0] for x in xs], 0),)}}
    for replica_result in sstrategy.experimental_local_results(out):
        assert_trees_close(replica_result, want)


# ---------------------------------------------------------------------- gradients
def _grad_run(strategy: jaxpod.TPUStrategy, xs: np.ndarray, ws: np.ndarray,
              collective: Callable[[jaxpod.ReplicaContext, jax.Array], jax.Array]
              ) -> np.ndarray:
    """Per replica r: d/dx_r of sum(w_r * collective(x_r)), stacked over replicas."""

    def fn(x: jax.Array, w: jax.Array) -> jax.Array:
        ctx = ctx_now()
        return jax.grad(lambda x: jnp.sum(w * collective(ctx, x)))(x)

    out = strategy.run(fn, args=(distribute(strategy, xs), distribute(strategy, ws)))
    return stacked(strategy, out)


def test_gradient_of_all_reduce_sum_is_all_reduce_sum(sstrategy: jaxpod.TPUStrategy) -> None:
    """loss_r = <w_r, sum_q x_q>  =>  d loss_r / d x_r = sum_q w_q (TF's all-reduce
    gradient: the incoming gradients of every replica, summed)."""
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(r, 3)).astype(np.float32)
    ws = rng.normal(size=(r, 3)).astype(np.float32)
    got = _grad_run(sstrategy, xs, ws, lambda ctx, x: ctx.all_reduce("SUM", x))
    np.testing.assert_allclose(got, np.broadcast_to(ws.sum(axis=0), (r, 3)), rtol=RTOL,
                               atol=ATOL)


def test_gradient_of_all_reduce_mean(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(r, 2, 2)).astype(np.float32)
    ws = rng.normal(size=(r, 2, 2)).astype(np.float32)
    got = _grad_run(sstrategy, xs, ws, lambda ctx, x: ctx.all_reduce(jaxpod.ReduceOp.MEAN, x))
    np.testing.assert_allclose(got, np.broadcast_to(ws.sum(axis=0) / r, xs.shape), rtol=RTOL,
                               atol=ATOL)


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_gradient_of_all_reduce_min_max_goes_to_the_extremum(
        sstrategy: jaxpod.TPUStrategy, op: str) -> None:
    """The summed upstream gradient goes to the replicas holding the extremum,
    shared equally among ties (integer-valued inputs make ties likely)."""
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(4)
    xs = rng.integers(-2, 2, size=(r, 6)).astype(np.float32)
    xs[:, 0] = 1.0  # a column where every replica ties
    ws = rng.normal(size=(r, 6)).astype(np.float32)
    got = _grad_run(sstrategy, xs, ws, lambda ctx, x: ctx.all_reduce(op, x))
    extreme = xs.max(axis=0) if op == "MAX" else xs.min(axis=0)
    at = (xs == extreme).astype(np.float64)
    want = ws.sum(axis=0) * at / at.sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("axis", [0, 1])
def test_gradient_of_all_gather_is_reduce_scatter(sstrategy: jaxpod.TPUStrategy,
                                                  axis: int) -> None:
    """loss_r = <W_r, concat_q x_q>  =>  d loss_r / d x_r = sum_q (slice r of W_q)."""
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(5 + axis)
    xs = rng.normal(size=(r, 2, 3)).astype(np.float32)
    gathered_shape = (2 * r, 3) if axis == 0 else (2, 3 * r)
    ws = rng.normal(size=(r, *gathered_shape)).astype(np.float32)
    got = _grad_run(sstrategy, xs, ws, lambda ctx, x: ctx.all_gather(x, axis))
    total = ws.sum(axis=0)
    want = np.stack([np.split(total, r, axis=axis)[i] for i in range(r)])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_gradient_through_an_all_reduced_loss(sstrategy: jaxpod.TPUStrategy) -> None:
    """loss = SUM-all-reduce of the replicas' squared errors / N, differentiated on each
    replica w.r.t. the mirrored weights: with TF's all-reduce gradient every replica
    gets (R / N) * grad of its own shard's loss, and all-reducing those (as an
    optimizer would) gives R times the full-batch gradient."""
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(7)
    n = 4 * r
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=(n,)).astype(np.float32)
    w = rng.normal(size=(3,)).astype(np.float32)
    batch = next(iter(sstrategy.experimental_distribute_dataset([{"x": x, "y": y}])))

    def fn(batch: dict[str, jax.Array], w: jax.Array) -> dict[str, jax.Array]:
        ctx = ctx_now()

        def loss(w: jax.Array) -> jax.Array:
            per_example = (batch["x"] @ w - batch["y"]) ** 2
            return ctx.all_reduce("SUM", jnp.sum(per_example)) / n

        grad = jax.grad(loss)(w)
        return {"grad": grad, "summed": ctx.all_reduce("SUM", grad)}

    out = sstrategy.run(fn, args=(batch, w))
    x64, y64, w64 = (a.astype(np.float64) for a in (x, y, w))
    shard_grads = np.stack([2 * xs.T @ (xs @ w64 - ys)
                            for xs, ys in zip(np.split(x64, r), np.split(y64, r), strict=True)])
    np.testing.assert_allclose(stacked(sstrategy, out["grad"]), shard_grads * r / n,
                               rtol=1e-4, atol=1e-5)
    full = 2 * x64.T @ (x64 @ w64 - y64) / n
    np.testing.assert_allclose(stacked(sstrategy, out["summed"]),
                               np.broadcast_to(r * full, (r, 3)), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------- contexts outside of run
def test_default_context_outside_any_strategy() -> None:
    assert jaxpod.get_strategy() is None
    ctx = jaxpod.get_replica_context()
    assert isinstance(ctx, jaxpod.ReplicaContext)
    assert ctx.num_replicas_in_sync == 1
    assert ctx.replica_id_in_sync_group == 0
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for op in ("SUM", "MEAN", "MIN", "MAX"):
        assert_trees_close(jax.tree.map(np.asarray, ctx.all_reduce(op, {"x": x})), {"x": x})
    np.testing.assert_array_equal(np.asarray(ctx.all_gather(x, 1)), x)
    with pytest.raises(ValueError):
        ctx.all_reduce("PROD", x)


def test_scope_enters_the_cross_replica_context(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2)
    other = strategy_of(8)
    with strategy.scope() as entered:
        assert entered is strategy
        assert jaxpod.get_strategy() is strategy
        assert jaxpod.get_replica_context() is None
        with other.scope():
            assert jaxpod.get_strategy() is other
        assert jaxpod.get_strategy() is strategy

        def fn() -> jax.Array:
            return jnp.asarray(ctx_now().num_replicas_in_sync)

        out = strategy.run(fn)  # inside run: a replica context again
        assert [int(v) for v in strategy.experimental_local_results(out)] == [2, 2]
        assert jaxpod.get_replica_context() is None
    assert jaxpod.get_strategy() is None
    assert isinstance(jaxpod.get_replica_context(), jaxpod.ReplicaContext)


def test_scope_is_left_when_the_block_raises(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2)
    with pytest.raises(RuntimeError, match="inside"), strategy.scope():
        raise RuntimeError("inside")
    assert jaxpod.get_strategy() is None


@pytest.mark.in_process
def test_get_strategy_inside_run_is_the_running_strategy(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """TF: "strategy.run ... enter[s] the scope automatically", so
    ``get_strategy()`` inside the step function is the strategy running it."""
    strategy = strategy_of(2)
    seen: list[Any] = []

    def fn() -> jax.Array:
        seen.append(jaxpod.get_strategy())
        return jnp.zeros(())

    strategy.run(fn)
    assert seen == [strategy]
    assert jaxpod.get_strategy() is None


def test_row_mask_requires_a_batch(strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2)
    value = distribute(strategy, np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="batch"):
        strategy.run(lambda v: ctx_now().valid_row_mask, args=(value,))
    with pytest.raises(ValueError, match="batch"):
        strategy.run(lambda v: ctx_now().num_valid_rows, args=(np.ones(3, np.float32),))
    with pytest.raises(ValueError, match="batch"):
        _ = jaxpod.get_replica_context().num_valid_rows  # type: ignore[union-attr]
