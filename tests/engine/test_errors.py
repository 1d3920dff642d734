"""Bad input gets a clear error naming what was received; user exceptions pass through."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpod

StrategyOf = Callable[..., jaxpod.TPUStrategy]


@pytest.fixture(scope="module")
def two(strategy_of: StrategyOf) -> jaxpod.TPUStrategy:
    return strategy_of(2)


@pytest.fixture(scope="module")
def vector(two: jaxpod.TPUStrategy) -> jaxpod.PerReplica:
    return two.experimental_distribute_values_from_function(
        lambda ctx: np.full((3,), ctx.replica_id_in_sync_group, np.float32))


@pytest.fixture(scope="module")
def scalar(two: jaxpod.TPUStrategy) -> jaxpod.PerReplica:
    return two.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))


def identity(x: Any) -> Any:
    return x


# -------------------------------------------------------------------------- run
@pytest.mark.parametrize("args", [np.ones(3), 5, "x", {"a": 1}, None])
def test_run_args_must_be_a_tuple_or_list(two: jaxpod.TPUStrategy, args: Any) -> None:
    with pytest.raises(TypeError, match=f"args.*{type(args).__name__}"):
        two.run(identity, args=args)


def test_run_accepts_a_list_of_args(two: jaxpod.TPUStrategy, vector: jaxpod.PerReplica) -> None:
    out = two.run(identity, args=[vector])
    np.testing.assert_array_equal(two.gather(out, 0), [0, 0, 0, 1, 1, 1])


@pytest.mark.parametrize("kwargs", [[("a", 1)], (1,), "a=1"])
def test_run_kwargs_must_be_a_dict(two: jaxpod.TPUStrategy, kwargs: Any) -> None:
    with pytest.raises(TypeError, match=f"kwargs.*{type(kwargs).__name__}"):
        two.run(identity, args=(1.0,), kwargs=kwargs)


@pytest.mark.parametrize(("args", "kwargs", "path", "kind"), [
    (("x",), None, r"args\[0\]", "str"),
    ((np.ones(2), {"lr": "fast"}), None, r"args\[1\]\['lr'\]", "str"),
    ((np.ones(2),), {"opt": {"name": object()}}, r"kwargs\['opt'\]\['name'\]", "object"),
    (([1.0, (2.0, "three")],), None, r"args\[0\]\[1\]\[1\]", "str"),
])
def test_run_non_array_leaves_name_their_path(two: jaxpod.TPUStrategy, args: tuple[Any, ...],
                                              kwargs: dict[str, Any] | None, path: str,
                                              kind: str) -> None:
    def fn(*a: Any, **k: Any) -> jax.Array:
        return jnp.zeros(())

    with pytest.raises(TypeError, match=f"{path}.*{kind}"):
        two.run(fn, args=args, kwargs=kwargs)


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [KeyError("boom"), ValueError("boom"), Boom("boom")])
def test_exceptions_from_the_step_reach_the_caller(two: jaxpod.TPUStrategy,
                                                   vector: jaxpod.PerReplica,
                                                   error: Exception) -> None:
    def fn(x: jax.Array) -> jax.Array:
        raise error

    with pytest.raises(type(error), match="boom"):
        two.run(fn, args=(vector,))


def test_exceptions_from_a_run_steps_step_reach_the_caller(two: jaxpod.TPUStrategy) -> None:
    def fn(batch: jax.Array) -> jax.Array:
        raise KeyError("boom")

    it = iter(two.experimental_distribute_dataset([np.ones((4, 2), np.float32)]))
    with pytest.raises(KeyError, match="boom"):
        two.run_steps(fn, it, steps=1)


def test_step_outputs_must_be_arrays(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(TypeError, match="str"):
        two.run(lambda: {"a": jnp.zeros(()), "b": "text"})


def test_per_replica_values_from_another_strategy(strategy_of: StrategyOf,
                                                  vector: jaxpod.PerReplica) -> None:
    with pytest.raises(ValueError, match="2 replicas"):
        strategy_of(8).run(identity, args=(vector,))


def test_strategy_constructor_validation() -> None:
    with pytest.raises(TypeError, match="device_assignment"):
        jaxpod.TPUStrategy(device_assignment=jax.devices())  # type: ignore[arg-type]
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="steps_per_run"):
            jaxpod.TPUStrategy(steps_per_run=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- reduce / gather
@pytest.mark.parametrize("op", ["PROD", "sum ", "", 3, None])
def test_reduce_unknown_op(two: jaxpod.TPUStrategy, vector: jaxpod.PerReplica, op: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(op))):
        two.reduce(op, vector)


@pytest.mark.parametrize("axis", [1, -2, 5])
def test_reduce_axis_out_of_range(two: jaxpod.TPUStrategy, vector: jaxpod.PerReplica,
                                  axis: int) -> None:
    with pytest.raises(ValueError, match=f"axis {axis}"):
        two.reduce("SUM", vector, axis=axis)


@pytest.mark.parametrize("axis", [1.0, "0", True])
def test_reduce_axis_must_be_an_int(two: jaxpod.TPUStrategy, vector: jaxpod.PerReplica,
                                    axis: Any) -> None:
    with pytest.raises(ValueError, match="axis"):
        two.reduce("SUM", vector, axis=axis)


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_reduce_min_max_with_an_axis(two: jaxpod.TPUStrategy, vector: jaxpod.PerReplica,
                                     op: str) -> None:
    got = two.reduce(op, vector, axis=0)
    assert float(got) == (0.0 if op == "MIN" else 1.0)


def test_reduce_of_a_scalar_with_an_axis(two: jaxpod.TPUStrategy,
                                         scalar: jaxpod.PerReplica) -> None:
    with pytest.raises(ValueError, match="rank"):
        two.reduce("SUM", scalar, axis=0)
    assert float(two.reduce("SUM", scalar)) == 1.0


def test_reduce_of_something_that_is_not_a_value(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(TypeError, match="str"):
        two.reduce("SUM", "loss")


def test_gather_of_scalars(two: jaxpod.TPUStrategy, scalar: jaxpod.PerReplica) -> None:
    with pytest.raises(ValueError, match="rank"):
        two.gather(scalar, axis=0)


@pytest.mark.parametrize("axis", [1, -2])
def test_gather_axis_out_of_range(two: jaxpod.TPUStrategy, vector: jaxpod.PerReplica,
                                  axis: int) -> None:
    with pytest.raises(ValueError, match=f"axis {axis}"):
        two.gather(vector, axis=axis)


# --------------------------------------------------------------- replica context
def test_all_reduce_and_all_gather_validation(two: jaxpod.TPUStrategy,
                                              vector: jaxpod.PerReplica,
                                              scalar: jaxpod.PerReplica) -> None:
    def ctx() -> jaxpod.ReplicaContext:
        c = jaxpod.get_replica_context()
        assert c is not None
        return c

    with pytest.raises(ValueError, match="PROD"):
        two.run(lambda v: ctx().all_reduce("PROD", v), args=(vector,))
    with pytest.raises(ValueError, match="axis 1"):
        two.run(lambda v: ctx().all_gather(v, 1), args=(vector,))
    with pytest.raises(ValueError, match="rank"):
        two.run(lambda v: ctx().all_gather(v, 0), args=(scalar,))


# --------------------------------------------------------------------------- input
@pytest.mark.parametrize("element", [np.float32(1.0), 3, np.array(2.0),
                                     {"x": np.ones((2, 2)), "y": np.int32(1)}])
def test_dataset_elements_must_be_batched(two: jaxpod.TPUStrategy, element: Any) -> None:
    with pytest.raises(ValueError, match=r"[Bb]atch"):
        next(iter(two.experimental_distribute_dataset([element, element])))


def test_dataset_from_function_elements_must_be_batched(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(ValueError, match=r"[Bb]atch"):
        next(iter(two.distribute_datasets_from_function(lambda _: [np.float32(1.0)] * 4)))


def test_dataset_element_leaves_must_agree_on_rows(two: jaxpod.TPUStrategy) -> None:
    element = (np.ones((4, 2)), np.ones((3,)))
    with pytest.raises(ValueError, match=r"rows|leading"):
        next(iter(two.experimental_distribute_dataset([element])))


def test_dataset_elements_must_keep_their_structure(two: jaxpod.TPUStrategy) -> None:
    elements = [np.ones((2, 3), np.float32), np.ones((2, 4), np.float32)]
    with pytest.raises(ValueError, match="changed"):
        list(two.experimental_distribute_dataset(elements))


def test_dataset_leaves_must_be_arrays(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(TypeError, match="str"):
        next(iter(two.experimental_distribute_dataset([{"x": np.ones((2,)), "y": "abc"}])))


def test_from_function_elements_may_only_shrink(two: jaxpod.TPUStrategy) -> None:
    elements = [np.ones((2,)), np.ones((2,)), np.ones((3,)), np.ones((3,))]
    with pytest.raises(ValueError, match="3 rows"):
        list(two.distribute_datasets_from_function(lambda _: elements))


def test_empty_dataset_needs_a_global_batch_size(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(ValueError, match="global_batch_size"):
        next(iter(two.experimental_distribute_dataset([])))


def test_distribute_dataset_argument_types(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(TypeError, match="int"):
        two.experimental_distribute_dataset(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options"):
        two.experimental_distribute_dataset([np.ones((2,))], options={"global_batch_size": 2})
    with pytest.raises(TypeError, match="list"):
        two.distribute_datasets_from_function([np.ones((2,))])  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -3, 2.5])
def test_input_options_global_batch_size(size: Any) -> None:
    with pytest.raises(ValueError, match="global_batch_size"):
        jaxpod.InputOptions(global_batch_size=size)


@pytest.mark.in_process
def test_exceptions_from_the_dataset_reach_the_caller(two: jaxpod.TPUStrategy) -> None:
    def batches() -> Iterator[np.ndarray]:
        yield np.ones((2, 2), np.float32)
        yield np.ones((2, 2), np.float32)
        raise KeyError("dataset boom")

    it = iter(two.experimental_distribute_dataset(batches()))
    with pytest.raises(KeyError, match="dataset boom"):
        for _ in range(5):
            next(it)

    def dataset_fn(ctx: jaxpod.InputContext) -> list[np.ndarray]:
        raise RuntimeError(f"dataset_fn boom {ctx.num_replicas_in_sync}")

    with pytest.raises(RuntimeError, match="dataset_fn boom 2"):
        next(iter(two.distribute_datasets_from_function(dataset_fn)))


def test_values_from_function_shapes_must_agree(two: jaxpod.TPUStrategy) -> None:
    with pytest.raises(ValueError, match=r"replica 0.*\[1\].*replica 1.*\[2\]"):
        two.experimental_distribute_values_from_function(
            lambda ctx: np.ones((ctx.replica_id_in_sync_group + 1,), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        two.experimental_distribute_values_from_function(
            lambda ctx: np.ones((2,), np.float32 if ctx.replica_id_in_sync_group else np.int32))
    with pytest.raises(ValueError, match="structure"):
        two.experimental_distribute_values_from_function(
            lambda ctx: (1.0,) if ctx.replica_id_in_sync_group else (1.0, 2.0))
    with pytest.raises(TypeError, match="str"):
        two.experimental_distribute_values_from_function(lambda ctx: "value")


# ------------------------------------------------------------------------ run_steps
@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_run_steps_steps_must_be_positive(two: jaxpod.TPUStrategy, steps: Any) -> None:
    it = iter(two.experimental_distribute_dataset([np.ones((4, 2), np.float32)]))
    with pytest.raises(ValueError, match="steps"):
        two.run_steps(identity, it, steps=steps)


def test_run_steps_state_contract(two: jaxpod.TPUStrategy) -> None:
    data = [np.ones((4, 2), np.float32)]
    with pytest.raises(TypeError, match="pair"):
        two.run_steps(lambda state, batch: state,
                      iter(two.experimental_distribute_dataset(data)), initial_state=0.0)
    with pytest.raises(TypeError, match="shape"):
        two.run_steps(lambda state, batch: (jnp.sum(batch, axis=0), batch),
                      iter(two.experimental_distribute_dataset(data)), initial_state=0.0)


def test_run_steps_on_an_exhausted_iterator(two: jaxpod.TPUStrategy,
                                            vector: jaxpod.PerReplica) -> None:
    with pytest.raises(jaxpod.EndOfDataError):
        two.run_steps(identity, iter([]))
    with pytest.raises(TypeError, match="PerReplica"):
        two.run_steps(identity, iter([(vector, np.ones(3))]))
    assert issubclass(jaxpod.EndOfDataError, StopIteration)
    assert issubclass(jaxpod.EndOfDataError, jaxpod.JaxpodError)


def test_run_rejects_batches_of_different_steps(two: jaxpod.TPUStrategy) -> None:
    data = np.arange(6, dtype=np.float32)
    first, last = list(two.experimental_distribute_dataset([data[:4], data[4:]]))
    # Named by where the second batch's value sits, not just refused.
    with pytest.raises(ValueError, match=r"args\[1\] comes from a different partial batch"):
        two.run(lambda a, b: a + b, args=(first, last))


def test_input_options_shard_policy_type() -> None:
    with pytest.raises(TypeError, match="auto_shard_policy"):
        jaxpod.InputOptions(auto_shard_policy="OFF")  # type: ignore[arg-type]
    assert jaxpod.InputOptions().auto_shard_policy is jaxpod.AutoShardPolicy.AUTO
