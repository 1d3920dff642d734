"""Distributed-input cases and what a strategy makes of them, for comparing strategies.

:func:`observe` runs one :class:`Case` through a strategy (in-process or remote) and
returns everything a user can see as plain numpy: per-replica rows and valid counts
of every step, the number of steps before ``EndOfDataError``, ``reduce`` (SUM, MEAN,
``axis=0``), ``gather`` and local results of the batches and of a step function's
outputs, and ``run_steps`` over the dataset. Two strategies with the same number of
replicas must give equal observations, whatever the number of hosts.

Data values are multiples of 1/4 small enough that every sum is exact in float32, so
observations compare exactly even when hosts add in another order. Also imported by
``inprocess_oracle.py`` (a process with 16 simulated devices), so it imports nothing
from the test suite.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxpod

#: Per-row shapes and dtypes a leaf may have.
ROW_SHAPES: tuple[tuple[int, ...], ...] = ((), (2,), (3, 2))
DTYPES = ("float32", "int32", "uint8")
#: How leaves nest in an element: one array, a tuple of two, a dict holding a tuple.
STRUCTURES = {"array": 1, "tuple": 2, "dict": 3}
#: A bound on next()/run_steps calls, so a strategy that never ends fails instead.
MAX_CALLS = 200


@dataclass(frozen=True)
class Case:
    """A globally batched dataset and how it is distributed and run.

    Attributes:
      batch_sizes: rows of each input batch (element) of the dataset.
      global_batch_size: passed as ``InputOptions(global_batch_size=...)``; ``None``
        infers it from the first element.
      structure: a key of ``STRUCTURES``.
      leaves: (row shape, dtype name) of each leaf, in flattening order.
      steps_per_run: steps per ``run_steps`` call.
      seed: of the data values.
    """

    batch_sizes: tuple[int, ...]
    global_batch_size: int | None
    structure: str
    leaves: tuple[tuple[tuple[int, ...], str], ...]
    steps_per_run: int
    seed: int


def make_elements(case: Case) -> list[Any]:
    """The dataset: one pytree per input batch; rows differ from each other."""
    rng = np.random.default_rng(case.seed)
    total = sum(case.batch_sizes)
    columns = [_leaf_rows(rng, total, shape, dtype) for shape, dtype in case.leaves]
    bounds = np.cumsum([0, *case.batch_sizes])
    return [_nest(case.structure, [c[a:b] for c in columns])
            for a, b in itertools.pairwise(bounds)]


def _leaf_rows(rng: np.random.Generator, rows: int, shape: tuple[int, ...], dtype: str
               ) -> np.ndarray:
    size = (rows, *shape)
    if dtype == "float32":  # row index plus quarters: distinct rows, exact sums
        index = np.arange(rows, dtype=np.float32).reshape((rows,) + (1,) * len(shape))
        return (index + rng.integers(-8, 8, size) / 4).astype(np.float32)
    if dtype == "int32":
        return rng.integers(-1000, 1000, size).astype(np.int32)
    return rng.integers(0, 256, size).astype(np.uint8)


def _nest(structure: str, leaves: list[np.ndarray]) -> Any:
    if structure == "array":
        return leaves[0]
    if structure == "tuple":
        return (leaves[0], leaves[1])
    return {"a": leaves[0], "b": (leaves[1], leaves[2])}


def _options(case: Case) -> jaxpod.InputOptions | None:
    if case.global_batch_size is None:
        return None
    return jaxpod.InputOptions(global_batch_size=case.global_batch_size)


def _is_value(x: Any) -> bool:
    return hasattr(x, "valid_rows")  # PerReplica, in-process or remote


# ------------------------------------------------------------------ step functions
def step_fn(batch: Any) -> dict[str, Any]:
    """Rows of the batch (the first leaf, scaled, plus the replica id), the replica's
    real row count, and an all-reduce of the real rows' sum."""
    ctx = jaxpod.get_replica_context()
    x = jax.tree.leaves(batch)[0].astype(jnp.float32)
    mask = ctx.valid_row_mask.reshape((-1,) + (1,) * (x.ndim - 1))
    return {"scaled": x * 2.0 + ctx.replica_id_in_sync_group,
            "count": ctx.num_valid_rows,
            "total": ctx.all_reduce("SUM", jnp.sum(jnp.where(mask, x, 0.0), axis=0))}


def accumulate_fn(state: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, Any]]:
    """A ``run_steps`` step: adds the real rows of the first leaf to the state."""
    ctx = jaxpod.get_replica_context()
    x = jax.tree.leaves(batch)[0].astype(jnp.float32)
    mask = ctx.valid_row_mask.reshape((-1,) + (1,) * (x.ndim - 1))
    new = state + jnp.sum(jnp.where(mask, x, 0.0), axis=0)
    return new, {"rows": x * 3.0, "count": ctx.num_valid_rows}


# ------------------------------------------------------------------- observation
def observe(strategy: Any, case: Case) -> dict[str, Any]:
    """Everything ``strategy`` shows of ``case``, as numpy (see the module doc)."""
    dataset = strategy.experimental_distribute_dataset(make_elements(case), _options(case))
    return {"steps": _observe_steps(strategy, dataset),
            "run_steps": _observe_run_steps(strategy, dataset, case)}


def _observe_steps(strategy: Any, dataset: Any) -> list[dict[str, Any]]:
    it = iter(dataset)
    steps = []
    for _ in range(MAX_CALLS):
        try:
            batch = next(it)
        except jaxpod.EndOfDataError:
            break
        steps.append(_observe_batch(strategy, batch))
    else:
        raise AssertionError(f"no EndOfDataError after {MAX_CALLS} steps")
    return steps


def _observe_batch(strategy: Any, batch: Any) -> dict[str, Any]:
    values = jax.tree.leaves(batch, is_leaf=_is_value)
    out = strategy.run(step_fn, args=(batch,))
    return {
        "padded_shape": [np.asarray(v.shape) for v in values],
        "valid_rows": [np.asarray(v.valid_rows, np.int64) for v in values],
        "local": _local(strategy, batch),
        "sum0": [strategy.reduce("SUM", v, axis=0) for v in values],
        "mean0": [strategy.reduce(jaxpod.ReduceOp.MEAN, v, axis=0) for v in values],
        "gather0": [strategy.gather(v, axis=0) for v in values],
        "out_local": _local(strategy, out),
        "out_sum0": strategy.reduce("SUM", out["scaled"], axis=0),
        "out_mean0": strategy.reduce("MEAN", out["scaled"], axis=0),
        "out_gather0": strategy.gather(out["scaled"], axis=0),
        "count_sum": strategy.reduce("SUM", out["count"], axis=None),
        "total_mean": strategy.reduce("MEAN", out["total"], axis=None),
    }


def _observe_run_steps(strategy: Any, dataset: Any, case: Case) -> list[dict[str, Any]]:
    """``run_steps`` over a fresh iterator until ``EndOfDataError``, carrying the state."""
    it = iter(dataset)
    shape = case.leaves[0][0]
    state: Any = np.zeros(shape, np.float32)
    calls = []
    for _ in range(MAX_CALLS):
        try:
            state, out = strategy.run_steps(accumulate_fn, it, steps=case.steps_per_run,
                                            initial_state=state)
        except jaxpod.EndOfDataError:
            break
        calls.append({"state": _local(strategy, state), "out": _local(strategy, out),
                      "rows_sum0": strategy.reduce("SUM", out["rows"], axis=0),
                      "rows_gather0": strategy.gather(out["rows"], axis=0)})
    else:
        raise AssertionError(f"no EndOfDataError after {MAX_CALLS} run_steps calls")
    return calls


def _local(strategy: Any, value: Any) -> list[list[np.ndarray]]:
    """``experimental_local_results``, each replica's result flattened to its leaves."""
    return [[np.asarray(leaf) for leaf in jax.tree.leaves(r)]
            for r in strategy.experimental_local_results(value)]


# -------------------------------------------------------------------- comparison
def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal structure, and every array equal in shape, dtype and every element."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (
            f"{path}: keys {sorted(got)} != {sorted(want)}")
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), (
            f"{path}: {len(got)} entries, expected {len(want)}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        g, w = np.asarray(got), np.asarray(want)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (
            f"{path}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
        np.testing.assert_array_equal(g, w, err_msg=path)
