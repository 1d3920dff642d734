"""``run_steps``: K steps in one on-device loop must equal K separate ``run`` calls."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import ATOL, RTOL, concat_stream, row_counts, tf_rebatch

import jaxpod

Tree = Any
FEATURES = 4  # never equal to a padded per-replica batch size used below (3)


def is_pr(v: object) -> bool:
    return isinstance(v, jaxpod.PerReplica)


def local_tree(strategy: jaxpod.TPUStrategy, value: Tree) -> list[Tree]:
    return list(strategy.experimental_local_results(value))


def assert_same_per_replica(strategy: jaxpod.TPUStrategy, got: Tree, want: Tree) -> None:
    """Same structure of PerReplica values, same valid rows and same local results."""
    got_leaves, got_def = jax.tree.flatten(got, is_leaf=is_pr)
    want_leaves, want_def = jax.tree.flatten(want, is_leaf=is_pr)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert isinstance(g, jaxpod.PerReplica)
        assert g.shape == w.shape
        assert (g.valid_rows is None) == (w.valid_rows is None)
        if w.valid_rows is not None:
            np.testing.assert_array_equal(g.valid_rows, w.valid_rows)
        for a, b in zip(local_tree(strategy, g), local_tree(strategy, w), strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def make_elements(num_replicas: int, seed: int) -> tuple[list[np.ndarray], int]:
    """Input batches of G = 2R+1 rows (uneven per-replica sizes) for 6 full steps and a
    short 7th, delivered in input batches that do not line up with the steps."""
    g = 2 * num_replicas + 1
    total = 6 * g + 2
    data = np.random.default_rng(seed).uniform(-1, 1, size=(total, FEATURES))
    data = data.astype(np.float32)
    cuts = [0, g, 2 * g + 1, 4 * g - 1, total]
    return [data[a:b] for a, b in itertools.pairwise(cuts)], g


def options(g: int) -> jaxpod.InputOptions:
    return jaxpod.InputOptions(global_batch_size=g)


def chunk_ends(num_steps: int, k: int) -> list[int]:
    """Index of the last step of each ``run_steps(k)`` call."""
    return [min(start + k, num_steps) - 1 for start in range(0, num_steps, k)]


def test_chunk_ends_reference() -> None:
    assert chunk_ends(7, 3) == [2, 5, 6]
    assert chunk_ends(6, 3) == [2, 5]


# -------------------------------------------------------------------- no state
@pytest.mark.parametrize("steps_per_run", [1, 3])
def test_run_steps_equals_separate_runs(sstrategy: jaxpod.TPUStrategy,
                                        strategy_of: Callable[..., jaxpod.TPUStrategy],
                                        steps_per_run: int) -> None:
    """3 steps per call, whether or not that is the strategy's steps_per_run."""
    r = sstrategy.num_replicas_in_sync
    strategy = strategy_of(r, steps_per_run)
    elements, g = make_elements(r, seed=0)
    expected = tf_rebatch(elements, g, r)
    assert len(expected) == 7

    def fn(batch: jax.Array) -> dict[str, jax.Array]:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        masked = jnp.where(ctx.valid_row_mask[:, None], batch, 0.0)
        return {"y": batch * 2.0 + 1.0, "col_sum": jnp.sum(masked, axis=0),
                "total": ctx.all_reduce("SUM", jnp.sum(masked)), "n": ctx.num_valid_rows}

    dist = strategy.experimental_distribute_dataset(elements, options(g))
    by_run = [strategy.run(fn, args=(b,)) for b in dist]
    assert len(by_run) == len(expected)

    it = iter(dist)
    for end in chunk_ends(len(expected), 3):
        out = strategy.run_steps(fn, it, steps=3)
        assert_same_per_replica(strategy, out, by_run[end])
        want = expected[end]
        for i, got in enumerate(local_tree(strategy, out)):
            np.testing.assert_allclose(got["y"], want[i] * 2.0 + 1.0, rtol=RTOL)
            np.testing.assert_allclose(got["col_sum"], want[i].sum(axis=0), rtol=RTOL,
                                       atol=ATOL)
            np.testing.assert_allclose(got["total"], concat_stream(want).sum(), rtol=RTOL,
                                       atol=ATOL)
            assert int(got["n"]) == row_counts(want)[i]
    with pytest.raises(jaxpod.EndOfDataError):
        strategy.run_steps(fn, it, steps=3)


def test_run_steps_more_steps_than_data_runs_the_rest(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2)
    elements, g = make_elements(2, seed=1)
    expected = tf_rebatch(elements, g, 2)

    def fn(batch: jax.Array) -> jax.Array:
        return batch - 1.0

    it = iter(strategy.experimental_distribute_dataset(elements, options(g)))
    out = strategy.run_steps(fn, it, steps=100)
    for got, want in zip(local_tree(strategy, out), expected[-1], strict=True):
        np.testing.assert_allclose(got, want - 1.0)
    with pytest.raises(StopIteration):  # EndOfDataError is a StopIteration
        strategy.run_steps(fn, it, steps=100)


def test_run_steps_default_is_steps_per_run(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2, steps_per_run=3)
    assert strategy.steps_per_run == 3
    data = np.arange(20, dtype=np.float32).reshape(10, 2)
    expected = tf_rebatch([data], 2, 2)  # 5 steps of one row per replica
    it = iter(strategy.experimental_distribute_dataset([data], options(2)))
    out = strategy.run_steps(lambda b: b * 1.0, it)
    for got, want in zip(local_tree(strategy, out), expected[2], strict=True):
        np.testing.assert_array_equal(got, want)
    out = strategy.run_steps(lambda b: b * 1.0, it)  # the remaining 2 steps
    for got, want in zip(local_tree(strategy, out), expected[4], strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(jaxpod.EndOfDataError):
        strategy.run_steps(lambda b: b * 1.0, it)


@pytest.mark.parametrize("steps", [1, 2])
def test_run_steps_continues_after_next(sstrategy: jaxpod.TPUStrategy, steps: int) -> None:
    """``next`` and ``run_steps`` take turns on one iterator: one step at a time, the
    input prepared ahead for the one is taken by the other (its steps axis added back
    or dropped)."""
    r = sstrategy.num_replicas_in_sync
    elements, g = make_elements(r, seed=2)
    expected = tf_rebatch(elements, g, r)
    it = iter(sstrategy.experimental_distribute_dataset(elements, options(g)))
    next(it)
    next(it)

    def fn(batch: jax.Array) -> jax.Array:
        return batch + 0.5

    out = sstrategy.run_steps(fn, it, steps=steps)  # steps 2 (and 3)
    for got, want in zip(local_tree(sstrategy, out), expected[1 + steps], strict=True):
        np.testing.assert_allclose(got, want + 0.5)
    after = next(it)  # the step after those
    for got, want in zip(local_tree(sstrategy, after), expected[2 + steps], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.in_process
def test_run_steps_compiles_once_per_step_count(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(8, steps_per_run=2)
    data = np.arange(8 * 9, dtype=np.float32).reshape(8 * 9 // 3, 3)
    traces = 0

    def fn(batch: jax.Array) -> jax.Array:
        nonlocal traces
        traces += 1
        return batch * 3.0

    it = iter(strategy.experimental_distribute_dataset([data], options(4)))  # 6 steps
    strategy.run_steps(fn, it, steps=2)
    first = traces
    # Once for the program, once (abstractly, one more row) to tell row outputs apart:
    # what the README says. The scan's carry takes its shapes from that same trace.
    assert first == 2
    strategy.run_steps(fn, it, steps=2)
    out = strategy.run_steps(fn, it, steps=2)
    assert traces == first, "same step count and shapes must not retrace"
    want = tf_rebatch([data], 4, 8)[5]
    for got, rows in zip(local_tree(strategy, out), want, strict=True):
        np.testing.assert_allclose(got, rows * 3.0)


# ----------------------------------------------------------------------- state
def _stateful_fn(state: dict[str, Any], batch: jax.Array) -> tuple[dict[str, Any], Any]:
    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    masked = jnp.where(ctx.valid_row_mask[:, None], batch, 0.0)
    total = ctx.all_reduce("SUM", jnp.sum(masked, axis=0))
    new_state = {
        "w": state["w"] + 0.1 * total,
        "steps": state["steps"] + 1,
        "mine": state["mine"] + ctx.num_valid_rows.astype(jnp.float32),
    }
    return new_state, {"total": total, "rows": batch * 1.0}


def _initial_state(strategy: jaxpod.TPUStrategy) -> dict[str, Any]:
    return {
        "w": np.zeros(FEATURES, np.float32),  # mirrored
        "steps": 0,  # a Python number
        "mine": strategy.experimental_distribute_values_from_function(
            lambda ctx: np.float32(ctx.replica_id_in_sync_group * 100)),  # per replica
    }


@pytest.mark.parametrize("steps_per_run", [1, 3])
def test_run_steps_with_state_equals_threaded_runs(
        sstrategy: jaxpod.TPUStrategy, strategy_of: Callable[..., jaxpod.TPUStrategy],
        steps_per_run: int) -> None:
    r = sstrategy.num_replicas_in_sync
    strategy = strategy_of(r, steps_per_run)
    elements, g = make_elements(r, seed=3)
    expected = tf_rebatch(elements, g, r)
    dist = strategy.experimental_distribute_dataset(elements, options(g))

    state: Any = _initial_state(strategy)
    threaded = []
    for batch in dist:
        state, out = strategy.run(_stateful_fn, args=(state, batch))
        threaded.append((state, out))
    assert len(threaded) == len(expected)

    it = iter(dist)
    state = _initial_state(strategy)
    for end in chunk_ends(len(expected), 3):
        result = strategy.run_steps(_stateful_fn, it, steps=3, initial_state=state)
        assert isinstance(result, tuple)
        assert len(result) == 2
        state, out = result
        assert isinstance(state["w"], jaxpod.PerReplica)
        assert isinstance(state["mine"], jaxpod.PerReplica)
        assert_same_per_replica(strategy, state, threaded[end][0])
        assert_same_per_replica(strategy, out, threaded[end][1])
    with pytest.raises(jaxpod.EndOfDataError):
        strategy.run_steps(_stateful_fn, it, steps=3, initial_state=state)

    # and both against numpy
    totals = [concat_stream(step).sum(axis=0) for step in expected]
    counts = np.array([row_counts(step) for step in expected])  # (steps, replicas)
    for i, final in enumerate(local_tree(strategy, state)):
        np.testing.assert_allclose(final["w"], 0.1 * np.sum(totals, axis=0), rtol=1e-4,
                                   atol=1e-5)
        assert int(final["steps"]) == len(expected)
        np.testing.assert_allclose(final["mine"], i * 100 + counts[:, i].sum())


def test_run_steps_on_a_plain_iterator_of_per_replica_values(
        sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(4)
    inputs = rng.normal(size=(5, r, 2, 3)).astype(np.float32)  # 5 steps
    items = [{"x": sstrategy.experimental_distribute_values_from_function(
        lambda ctx, s=s: inputs[s, ctx.replica_id_in_sync_group])} for s in range(5)]

    def fn(state: jax.Array, item: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        new = state * 0.5 + ctx.all_reduce("MEAN", item["x"])
        return new, new - item["x"]

    state: Any = np.ones((2, 3), np.float32)
    threaded = []
    for item in items:
        state, out = sstrategy.run(fn, args=(state, item))
        threaded.append((state, out))
    it = iter(items)
    state = np.ones((2, 3), np.float32)
    for end in chunk_ends(5, 2):
        state, out = sstrategy.run_steps(fn, it, steps=2, initial_state=state)
        assert_same_per_replica(sstrategy, state, threaded[end][0])
        assert_same_per_replica(sstrategy, out, threaded[end][1])
    with pytest.raises(jaxpod.EndOfDataError):
        sstrategy.run_steps(fn, it, steps=2, initial_state=state)
    # numpy: the state is mirrored in effect (same on all replicas)
    want = np.ones((2, 3))
    for s in range(5):
        want = want * 0.5 + inputs[s].mean(axis=0)
    for got in local_tree(sstrategy, state):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_run_steps_on_a_list_of_dataset_batches_matches_the_distributed_iterator(
        sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    elements, g = make_elements(r, seed=5)
    dist = sstrategy.experimental_distribute_dataset(elements, options(g))

    def fn(batch: jax.Array) -> dict[str, jax.Array]:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return {"y": batch + 1.0, "n": ctx.num_valid_rows}

    batches = list(dist)
    plain = iter(batches)
    distributed = iter(dist)
    for _ in chunk_ends(len(batches), 4):
        a = sstrategy.run_steps(fn, plain, steps=4)
        b = sstrategy.run_steps(fn, distributed, steps=4)
        assert_same_per_replica(sstrategy, a, b)
    with pytest.raises(jaxpod.EndOfDataError):
        sstrategy.run_steps(fn, plain, steps=4)


def test_sgd_loop_in_run_steps_matches_numpy(
        sstrategy: jaxpod.TPUStrategy, strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """Linear regression, loss = sum of squared errors of the step's real rows / their
    global count, gradients all-reduced: run_steps (steps_per_run=4) over the whole
    dataset (with a short last step) equals plain gradient descent on the global
    batches in numpy."""
    r = sstrategy.num_replicas_in_sync
    strategy = strategy_of(r, steps_per_run=4)
    rng = np.random.default_rng(6)
    g = 3 * r + 1
    total = 5 * g + 2
    x = rng.normal(size=(total, 3)).astype(np.float32)
    true_w = np.array([1.0, -2.0, 0.5], np.float32)
    y = x @ true_w + 0.1 * rng.normal(size=(total,)).astype(np.float32)
    elements = [{"x": x[i:i + g], "y": y[i:i + g]} for i in range(0, total, g)]
    lr = 0.1

    def step(w: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        n_global = ctx.all_reduce("SUM", ctx.num_valid_rows).astype(jnp.float32)

        def loss(w: jax.Array) -> jax.Array:
            err = jnp.where(ctx.valid_row_mask, batch["x"] @ w - batch["y"], 0.0)
            return jnp.sum(err**2) / n_global

        value, grad = jax.value_and_grad(loss)(w)
        grad = ctx.all_reduce("SUM", grad)
        return w - lr * grad, ctx.all_reduce("SUM", value)

    dist = strategy.experimental_distribute_dataset(elements)
    it = iter(dist)
    w: Any = np.zeros(3, np.float32)
    losses = []
    while True:
        try:
            w, loss = strategy.run_steps(step, it, initial_state=w)
        except jaxpod.EndOfDataError:
            break
        losses.append(loss)
    assert len(losses) == 2  # 6 steps: 4 + 2

    want = np.zeros(3)
    want_losses = []
    for s in range(0, total, g):
        xs, ys = x[s:s + g].astype(np.float64), y[s:s + g].astype(np.float64)
        err = xs @ want - ys
        want_losses.append(np.sum(err**2) / len(xs))
        want = want - lr * 2 * xs.T @ err / len(xs)
    for got in local_tree(strategy, w):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for got in local_tree(strategy, losses[-1]):
        np.testing.assert_allclose(got, want_losses[-1], rtol=1e-4)


class ReusedBufferDataset:
    """A generator-style dataset that refills and re-yields one buffer."""

    def __init__(self, data: np.ndarray, batch: int) -> None:
        self.data = data
        self.batch = batch

    def __iter__(self) -> Any:
        buffer = np.empty((self.batch, *self.data.shape[1:]), self.data.dtype)
        for start in range(0, len(self.data), self.batch):
            buffer[:] = self.data[start:start + self.batch]
            yield buffer


def test_run_steps_takes_elements_as_yielded(
        sstrategy: jaxpod.TPUStrategy, strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """Several steps per call must not see a reused input buffer after it was refilled."""
    r = sstrategy.num_replicas_in_sync
    strategy = strategy_of(r, steps_per_run=3)
    g = 2 * r
    data = np.random.default_rng(7).normal(size=(7 * g, 2)).astype(np.float32)
    expected = tf_rebatch([data[i:i + g] for i in range(0, len(data), g)], g, r)

    def fn(state: jax.Array, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return state + ctx.all_reduce("SUM", jnp.sum(batch, axis=0)), batch * 1.0

    it = iter(strategy.experimental_distribute_dataset(ReusedBufferDataset(data, g)))
    state: Any = np.zeros(2, np.float32)
    for end in chunk_ends(len(expected), 3):
        state, out = strategy.run_steps(fn, it, steps=3, initial_state=state)
        for got, want in zip(local_tree(strategy, out), expected[end], strict=True):
            np.testing.assert_array_equal(got, want)
    for got in local_tree(strategy, state):
        np.testing.assert_allclose(got, data.sum(axis=0), rtol=1e-4, atol=1e-4)
