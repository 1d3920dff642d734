"""``run``, ``reduce``, ``gather``, ``experimental_local_results`` and
``experimental_distribute_values_from_function`` on 1, 2 and 8 replicas.

Every expected value is computed with numpy from the per-replica inputs
(``engine_np_reference``), never read back from the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import (
    ATOL,
    RTOL,
    assert_trees_close,
    np_reduce,
    pad_to,
    row_counts,
    tf_rebatch,
)

import jaxpod

OPS = ("SUM", "MEAN", "MIN", "MAX")


def distribute(strategy: jaxpod.TPUStrategy, per_replica: np.ndarray) -> jaxpod.PerReplica:
    """Replica ``r`` gets ``per_replica[r]``."""
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: per_replica[ctx.replica_id_in_sync_group])
    assert isinstance(value, jaxpod.PerReplica)
    return value


def local(strategy: jaxpod.TPUStrategy, value: Any) -> list[Any]:
    results = strategy.experimental_local_results(value)
    assert isinstance(results, tuple)
    assert len(results) == strategy.num_replicas_in_sync
    return list(results)


# ---------------------------------------------------------------------------- run
def test_run_gives_each_replica_its_component_and_mirrors_the_rest(
        sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(r, 4, 3)).astype(np.float32)
    w_np = rng.normal(size=(3,)).astype(np.float32)
    w_jax = jnp.asarray(rng.normal(size=(3,)).astype(np.float32))

    def fn(x: jax.Array, w: jax.Array, v: jax.Array, c: float) -> jax.Array:
        return x * w + v + c

    out = sstrategy.run(fn, args=(distribute(sstrategy, xs), w_np, w_jax, 2.5))
    assert isinstance(out, jaxpod.PerReplica)
    assert out.array.shape == (r, 4, 3)
    assert out.shape == (4, 3)
    assert out.num_replicas == r
    assert out.valid_rows is None
    for i, got in enumerate(local(sstrategy, out)):
        np.testing.assert_allclose(got, xs[i] * w_np + np.asarray(w_jax) + 2.5,
                                   rtol=RTOL, atol=ATOL)


def test_run_with_kwargs_and_nested_outputs(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(r, 5, 2)).astype(np.float32)
    offset = rng.normal(size=(2,)).astype(np.float32)

    def fn(x: jax.Array, *, scale: float, extra: dict[str, jax.Array]) -> dict[str, Any]:
        return {
            "scaled": x * scale,
            "pair": (jnp.sum(x), jnp.max(x, axis=0)),
            "list": [x[:1] + extra["offset"], 7],
        }

    out = sstrategy.run(fn, args=(distribute(sstrategy, xs),),
                        kwargs={"scale": 3.0, "extra": {"offset": offset}})
    assert set(out) == {"scaled", "pair", "list"}
    assert isinstance(out["pair"], tuple)
    assert isinstance(out["list"], list)
    for leaf in jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, jaxpod.PerReplica)):
        assert isinstance(leaf, jaxpod.PerReplica)
    results = local(sstrategy, out)
    for i, got in enumerate(results):
        want = {
            "scaled": xs[i] * 3.0,
            "pair": (np.sum(xs[i]), np.max(xs[i], axis=0)),
            "list": [xs[i][:1] + offset, np.asarray(7)],
        }
        assert_trees_close(got, want)


def test_run_passes_per_replica_kwargs(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.arange(r * 3, dtype=np.float32).reshape(r, 3)
    ys = (np.arange(r * 3, dtype=np.float32) * 10).reshape(r, 3)

    def fn(x: jax.Array, y: jax.Array) -> jax.Array:
        return x - y

    out = sstrategy.run(fn, kwargs={"y": distribute(sstrategy, ys),
                                    "x": distribute(sstrategy, xs)})
    np.testing.assert_allclose(np.stack(local(sstrategy, out)), xs - ys)


@pytest.mark.in_process
def test_run_compiles_once_per_input_signature(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    traces = 0

    def fn(x: jax.Array, y: jax.Array) -> jax.Array:
        nonlocal traces
        traces += 1
        return x * y

    rng = np.random.default_rng(2)
    for _ in range(3):  # new values, same shapes: one trace
        xs = rng.normal(size=(r, 3)).astype(np.float32)
        y = rng.normal(size=(3,)).astype(np.float32)
        out = sstrategy.run(fn, args=(distribute(sstrategy, xs), y))
        np.testing.assert_allclose(np.stack(local(sstrategy, out)), xs * y, rtol=RTOL)
    assert traces == 1
    bigger = rng.normal(size=(r, 4)).astype(np.float32)
    sstrategy.run(fn, args=(distribute(sstrategy, bigger), np.ones(4, np.float32)))
    assert traces == 2
    sstrategy.run(fn, args=(distribute(sstrategy, xs), y))
    assert traces == 2


def test_run_without_args_and_replica_ids(sstrategy: jaxpod.TPUStrategy) -> None:
    """TF's reduce example: each replica returns its id; SUM is 0 + 1 + ... + R-1."""

    def step_fn() -> jax.Array:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return ctx.replica_id_in_sync_group

    out = sstrategy.run(step_fn)
    r = sstrategy.num_replicas_in_sync
    assert [int(v) for v in local(sstrategy, out)] == list(range(r))
    assert int(sstrategy.reduce("SUM", out, axis=None)) == sum(range(r))


# ------------------------------------------------------------------------- reduce
def test_reduce_axis_none_is_elementwise_over_replicas(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.random.default_rng(3).normal(size=(r, 2, 3)).astype(np.float32)
    value = distribute(sstrategy, xs)
    spellings: dict[str, list[Any]] = {
        "SUM": ["SUM", "sum", jaxpod.ReduceOp.SUM],
        "MEAN": ["MEAN", "Mean", jaxpod.ReduceOp.MEAN],
        "MIN": ["MIN", jaxpod.ReduceOp.MIN],
        "MAX": ["max", jaxpod.ReduceOp.MAX],
    }
    for op, names in spellings.items():
        want = np_reduce(op, list(xs), axis=None)
        for name in names:
            got = sstrategy.reduce(name, value, axis=None)
            assert isinstance(got, np.ndarray)
            assert got.shape == (2, 3)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(name))
        # axis defaults to None
        np.testing.assert_allclose(sstrategy.reduce(op, value), want, rtol=RTOL, atol=ATOL)


def test_reduce_along_an_axis(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.random.default_rng(4).normal(size=(r, 4, 3)).astype(np.float32)
    value = distribute(sstrategy, xs)
    for op in OPS:
        for axis in (0, 1, -1, -2):
            got = sstrategy.reduce(op, value, axis=axis)
            want = np_reduce(op, list(xs), axis=axis)
            assert got.shape == want.shape, (op, axis)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{op} {axis}")


def test_reduce_tf_per_example_example(sstrategy: jaxpod.TPUStrategy) -> None:
    """TF's docs: examples [0..3] on replica 0, [4..7] on replica 1, and so on."""
    r = sstrategy.num_replicas_in_sync
    per_example = np.arange(4 * r, dtype=np.float32).reshape(r, 4)
    value = distribute(sstrategy, per_example)
    np.testing.assert_allclose(sstrategy.reduce("sum", value, axis=None),
                               per_example.sum(axis=0))
    np.testing.assert_allclose(sstrategy.reduce("sum", value, axis=0), per_example.sum())
    np.testing.assert_allclose(sstrategy.reduce("mean", value, axis=0), per_example.mean())


def test_reduce_mean_of_integers_is_float(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.arange(r * 3, dtype=np.int32).reshape(r, 3) * 3 + 1
    value = distribute(sstrategy, xs)
    by_replica = sstrategy.reduce("MEAN", value)
    assert np.issubdtype(by_replica.dtype, np.floating)
    np.testing.assert_allclose(by_replica, xs.mean(axis=0), rtol=RTOL)
    overall = sstrategy.reduce("MEAN", value, axis=0)
    assert np.issubdtype(overall.dtype, np.floating)
    np.testing.assert_allclose(overall, xs.mean(), rtol=RTOL)
    total = sstrategy.reduce("SUM", value, axis=0)
    assert np.issubdtype(total.dtype, np.integer)
    assert int(total) == int(xs.sum())


def test_reduce_and_gather_nests(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(5)
    a = rng.normal(size=(r, 3)).astype(np.float32)
    b = rng.normal(size=(r, 2, 2)).astype(np.float32)
    c = rng.integers(0, 10, size=(r, 4)).astype(np.int32)

    def fn(a: jax.Array, b: jax.Array, c: jax.Array) -> dict[str, Any]:
        return {"a": a, "bc": (b, c)}

    out = sstrategy.run(fn, args=tuple(distribute(sstrategy, v) for v in (a, b, c)))
    for op in ("SUM", "MAX"):
        got = sstrategy.reduce(op, out, axis=None)
        want = {"a": np_reduce(op, list(a), None),
                "bc": (np_reduce(op, list(b), None), np_reduce(op, list(c), None))}
        assert_trees_close(got, want)
    got = sstrategy.reduce("MEAN", out, axis=0)
    want = {"a": a.mean(), "bc": (b.mean(axis=(0, 1)), c.mean())}
    assert_trees_close(got, want)
    gathered = sstrategy.gather(out, axis=0)
    assert_trees_close(gathered, {"a": a.reshape(-1), "bc": (b.reshape(2 * r, 2),
                                                            c.reshape(-1))})
    results = local(sstrategy, out)
    for i, got_i in enumerate(results):
        assert_trees_close(got_i, {"a": a[i], "bc": (b[i], c[i])})


# ------------------------------------------------------------------------- gather
def test_gather_tf_docs_example(sstrategy: jaxpod.TPUStrategy) -> None:
    """TF's gather example: every replica holds ``range(6).reshape(1, 2, 3)``."""
    single = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
    value = sstrategy.experimental_distribute_values_from_function(lambda _: single)
    r = sstrategy.num_replicas_in_sync
    for axis in (0, 1, 2, -1):
        got = sstrategy.gather(value, axis=axis)
        want = np.concatenate([single] * r, axis=axis)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_gather_distinct_values_in_replica_order(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.random.default_rng(6).normal(size=(r, 2, 3)).astype(np.float32)
    value = distribute(sstrategy, xs)
    for axis in (0, 1, -2):
        np.testing.assert_allclose(sstrategy.gather(value, axis),
                                   np.concatenate(list(xs), axis=axis))


# ------------------------------------------------------- local results / values
def test_local_results_one_numpy_entry_per_replica(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    xs = np.random.default_rng(7).normal(size=(r, 3)).astype(np.float32)
    results = local(sstrategy, distribute(sstrategy, xs))
    for i, got in enumerate(results):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, xs[i])


@pytest.mark.in_process
def test_values_from_function_tf_examples(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    contexts: list[jaxpod.ValueContext] = []

    def constant(ctx: jaxpod.ValueContext) -> float:
        contexts.append(ctx)
        return 1.0

    assert [float(v) for v in local(
        sstrategy, sstrategy.experimental_distribute_values_from_function(constant))] == [1.0] * r
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in contexts] == [
        (i, r) for i in range(r)]
    assert all(isinstance(c, jaxpod.ValueContext) for c in contexts)

    array_value = np.arange(r, 0, -1).astype(np.float32)
    by_id = sstrategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group])
    np.testing.assert_array_equal(np.array(local(sstrategy, by_id)), array_value)

    count = sstrategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert [int(v) for v in local(sstrategy, count)] == [r] * r

    def nest(ctx: jaxpod.ValueContext) -> dict[str, Any]:
        i = ctx.replica_id_in_sync_group
        return {"x": np.full((2,), i, np.float32), "t": (np.int32(i * 10),)}

    nested = sstrategy.experimental_distribute_values_from_function(nest)
    assert isinstance(nested["x"], jaxpod.PerReplica)
    assert isinstance(nested["t"][0], jaxpod.PerReplica)
    for i, got in enumerate(local(sstrategy, nested)):
        assert_trees_close(got, {"x": np.full((2,), i, np.float32), "t": (np.asarray(i * 10),)})
    doubled = sstrategy.run(lambda v: jax.tree.map(lambda a: a * 2, v), args=(nested,))
    for i, got in enumerate(local(sstrategy, doubled)):
        assert_trees_close(got, {"x": np.full((2,), 2 * i, np.float32),
                                 "t": (np.asarray(i * 20),)})


# ---------------------------------------------------------------- partial batches
def _check_uneven_axis_none(strategy: jaxpod.TPUStrategy, value: jaxpod.PerReplica,
                            real: list[np.ndarray]) -> None:
    """axis=None (and gather/reduce on axis 1) on a padded value: sliced when every
    replica has as many real rows, else a ValueError (TF: a shape mismatch)."""
    counts = {len(x) for x in real}
    if len(counts) == 1:
        for op in OPS:
            np.testing.assert_allclose(strategy.reduce(op, value, axis=None),
                                       np_reduce(op, real, None), rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(strategy.reduce(op, value, axis=1),
                                       np_reduce(op, real, 1), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(strategy.gather(value, axis=1),
                                   np.concatenate(real, axis=1))
        return
    with pytest.raises(ValueError, match="axis"):
        strategy.reduce("SUM", value, axis=None)
    with pytest.raises(ValueError, match="axis"):
        strategy.reduce("MEAN", value, axis=1)
    with pytest.raises(ValueError, match="axis"):
        strategy.gather(value, axis=1)


@pytest.mark.parametrize(("global_batch", "total_rows"), [(4, 10), (10, 23)])
def test_results_of_partial_batches_exclude_padding(
        sstrategy: jaxpod.TPUStrategy, global_batch: int, total_rows: int) -> None:
    """10 rows with G=4 and 23 rows with G=10 (10 over 8 replicas: sizes
    [2, 2, 1, 1, 1, 1, 1, 1]): reductions, gathers and local results of the step
    outputs count real rows only, with the true MEAN denominator."""
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(global_batch)
    data = rng.uniform(1.0, 2.0, size=(total_rows, 3)).astype(np.float32)
    elements = [data[i:i + global_batch] for i in range(0, total_rows, global_batch)]
    expected_steps = tf_rebatch(elements, global_batch, r)
    traces = 0

    def fn(x: jax.Array) -> dict[str, jax.Array]:
        nonlocal traces
        traces += 1
        # Padding rows are zeros on input, so they map to +-10: outside the range of
        # the real outputs, which any MIN, MAX, SUM or MEAN that counted them would show.
        return {"hi": x + 10.0, "lo": -(x + 10.0), "row_sum": jnp.sum(x + 10.0, axis=1)}

    dist = sstrategy.experimental_distribute_dataset(elements)
    steps = 0
    traces_after_first = 0
    for batch, want_step in zip(dist, expected_steps, strict=True):
        steps += 1
        out = sstrategy.run(fn, args=(batch,))
        # The first call may trace fn twice (the engine probes which outputs are rows);
        # after it, no step of the same signature traces again.
        traces_after_first = traces_after_first or traces
        real_hi = [x + 10.0 for x in want_step]
        real_lo = [-(x + 10.0) for x in want_step]
        real_rows = [np.sum(x, axis=1) for x in real_hi]
        for i, got in enumerate(local(sstrategy, out)):
            assert_trees_close(got, {"hi": real_hi[i], "lo": real_lo[i],
                                     "row_sum": real_rows[i]})
        for op in OPS:
            for name, real in (("hi", real_hi), ("lo", real_lo)):
                for axis in (0, -2):
                    np.testing.assert_allclose(
                        sstrategy.reduce(op, out[name], axis=axis), np_reduce(op, real, 0),
                        rtol=RTOL, atol=ATOL, err_msg=f"step {steps} {op} {name} axis {axis}")
            np.testing.assert_allclose(sstrategy.reduce(op, out["row_sum"], axis=0),
                                       np_reduce(op, real_rows, 0), rtol=RTOL, atol=ATOL)
        # MEAN over the batch axis divides by the step's real row count.
        np.testing.assert_allclose(
            sstrategy.reduce("MEAN", out["row_sum"], axis=0),
            np.sum(np.concatenate(real_rows)) / sum(row_counts(want_step)), rtol=RTOL)
        np.testing.assert_allclose(sstrategy.gather(out["hi"], axis=0),
                                   np.concatenate(real_hi))
        np.testing.assert_allclose(sstrategy.gather(out["row_sum"], axis=-1),
                                   np.concatenate(real_rows), rtol=RTOL)
        _check_uneven_axis_none(sstrategy, out["hi"], real_hi)
    assert steps == len(expected_steps)
    assert traces == traces_after_first, "a padded last batch must reuse the compiled step"


def test_partial_batch_value_of_integers_mean_uses_true_count(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """A last batch of 6 rows split [4, 2] over two replicas: MEAN with axis=0 divides
    by 6 (TF's documented example), not by 8 and not by averaging per-replica means."""
    strategy = strategy_of(2)
    data = np.arange(14, dtype=np.int32)  # 8 rows, then 6
    dist = strategy.experimental_distribute_dataset([data[:8], data[8:]])
    batches = list(dist)
    assert len(batches) == 2
    last = batches[1]
    assert last.valid_rows is not None
    np.testing.assert_array_equal(last.valid_rows, [4, 2])
    got = strategy.reduce("MEAN", last, axis=0)
    assert np.issubdtype(got.dtype, np.floating)
    np.testing.assert_allclose(got, data[8:].mean(), rtol=RTOL)
    assert int(strategy.reduce("SUM", last, axis=0)) == int(data[8:].sum())
    per_replica_means = np.mean([data[8:12].mean(), data[12:14].mean()])
    assert not np.isclose(got, per_replica_means)


def test_non_row_outputs_of_a_padded_step_keep_their_shape(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """An output that is not made of batch rows (here the column sums of the batch)
    must come back whole even when its length happens to equal the per-replica batch
    size: it is TF's per-replica value, with no padding to drop."""
    strategy = strategy_of(2)
    data = np.arange(10, dtype=np.float32).reshape(5, 2)
    # G = 3 over 2 replicas: sizes [2, 1]; per-replica batches padded to 2 rows, and
    # the column sums below also have 2 entries.
    dist = strategy.experimental_distribute_dataset([data[:3], data[3:]])
    expected = tf_rebatch([data[:3], data[3:]], 3, 2)
    for batch, want_step in zip(dist, expected, strict=True):
        out = strategy.run(lambda b: jnp.sum(b, axis=0), args=(batch,))
        for got, rows in zip(local(strategy, out), want_step, strict=True):
            np.testing.assert_allclose(got, rows.sum(axis=0))


def test_local_results_of_a_plain_array_is_a_single_value(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """TF: "If value represents a single value, this returns (value,)"."""
    strategy = strategy_of(2)
    value = np.arange(3, dtype=np.float32)
    results = strategy.experimental_local_results(value)
    assert isinstance(results, tuple)
    assert len(results) == 1
    np.testing.assert_array_equal(results[0], value)


def test_padding_rows_of_a_distributed_batch_are_zeros(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(8)
    data = np.arange(1, 24, dtype=np.float32).reshape(23, 1)
    elements = [data[:10], data[10:20], data[20:]]
    for batch, want_step in zip(strategy.experimental_distribute_dataset(elements),
                                tf_rebatch(elements, 10, 8), strict=True):
        padded = np.asarray(batch.array)
        assert padded.shape == (8, 2, 1)
        np.testing.assert_array_equal(padded, np.stack([pad_to(x, 2) for x in want_step]))
