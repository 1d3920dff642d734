"""Lockstep: an operation takes effect on every host of a slice or on none.

Real host workers on a simulated v4-16 (2 hosts x 4 chips, as plain processes). Each
test makes one kind of operation fail on host 1 only, checks that the caller gets the
user's own exception naming the host, and that the hosts still hold the same objects,
then runs a normal round of operations on the same slice and compares it with numpy.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpod
from jaxpod import operations as ops
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.shipping import ship_object


@pytest.fixture(scope="module")
def group(process_group: GroupEngine) -> GroupEngine:
    """This module's v4-16: hosts as plain processes (what it tests does not depend on
    how they were started, and no Ray cluster need start for it)."""
    return process_group


HOSTS, REPLICAS = 2, 8


class HostOneError(Exception):
    """What the injected failures raise (a user exception type: it must come back)."""


def _fail_on_host_one(what: str) -> None:
    if jax.process_index() == 1:
        raise HostOneError(f"{what} failed on purpose on host 1")


def _rebuilt(value: Any) -> Any:
    _fail_on_host_one("unpickling")
    return value


class FailsToLoadOnHostOne:
    """Pickles anywhere; unpickles everywhere but on host 1."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (self.value,))


def _normal_round(group: GroupEngine) -> None:
    """Values, a dataset, a step with collectives and results: all as numpy says."""
    data = np.arange(REPLICAS * 3, dtype=np.float32).reshape(REPLICAS, 3)
    value = group.experimental_distribute_values_from_function(
        lambda ctx: data[ctx.replica_id_in_sync_group])

    def step(x: jax.Array) -> jax.Array:
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return x * 2 + ctx.all_reduce("SUM", jnp.sum(x))

    out = group.run(step, args=(value,))
    np.testing.assert_allclose(group.gather(out, axis=0).reshape(REPLICAS, 3),
                               data * 2 + data.sum())
    batches = [np.arange(16, dtype=np.float32) + 16 * i for i in range(3)]
    it = iter(group.experimental_distribute_dataset(batches))
    for batch in batches:
        np.testing.assert_allclose(group.reduce("SUM", next(it), axis=0), batch.sum())
    with pytest.raises(jaxpod.EndOfDataError):
        next(it)


def _hosts_agree(group: GroupEngine) -> None:
    stats = group.stats()
    assert len({(s["num_values"], s["num_iterators"]) for s in stats}) == 1, stats


def _failed_on_host_one(info: pytest.ExceptionInfo[BaseException]) -> None:
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "failed on host(s) [1] of 2" in notes, notes
    assert "Remote traceback (host 1)" in notes


def test_a_function_that_loads_on_one_host_only_is_defined_nowhere(
        group: GroupEngine) -> None:
    picky = FailsToLoadOnHostOne(np.float32(3))

    def scale(x: jax.Array) -> jax.Array:
        return x * picky.value

    value = group.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))
    with pytest.raises(HostOneError, match="unpickling failed on purpose") as info:
        group.run(scale, args=(value,))
    _failed_on_host_one(info)
    _hosts_agree(group)
    _normal_round(group)


def test_values_from_a_function_that_fails_on_one_host_exist_nowhere(
        group: GroupEngine) -> None:
    def value_fn(ctx: jaxpod.ValueContext) -> np.ndarray:
        _fail_on_host_one(f"value_fn for replica {ctx.replica_id_in_sync_group}")
        return np.ones((4,), np.float32)

    gc.collect()  # earlier tests' values: dropped now, freed by the next operation
    before = group.stats()
    with pytest.raises(HostOneError, match=r"value_fn for replica [4-7] failed") as info:
        group.experimental_distribute_values_from_function(value_fn)
    _failed_on_host_one(info)
    _hosts_agree(group)
    assert [s["num_values"] for s in group.stats()] == [s["num_values"] for s in before]
    _normal_round(group)


def test_a_dataset_function_that_fails_on_one_host_leaves_no_dataset(
        group: GroupEngine) -> None:
    def dataset_fn(ctx: jaxpod.InputContext) -> list[np.ndarray]:
        if ctx.input_pipeline_id == 1:
            raise HostOneError("dataset_fn failed on purpose on host 1")
        return [np.zeros((4, 2), np.float32)]

    with pytest.raises(HostOneError, match="dataset_fn failed on purpose") as info:
        iter(group.distribute_datasets_from_function(dataset_fn))
    _failed_on_host_one(info)
    _hosts_agree(group)
    _normal_round(group)


def test_a_dataset_that_loads_on_one_host_only_is_distributed_nowhere(
        group: GroupEngine) -> None:
    batches = [np.ones((8, 2), np.float32)]
    shipped = ship_object(FailsToLoadOnHostOne(batches), "the dataset", "")
    with pytest.raises(HostOneError, match="unpickling failed on purpose") as info:
        group.experimental_distribute_dataset(shipped)  # as the coordinator forwards it
    _failed_on_host_one(info)
    _hosts_agree(group)
    _normal_round(group)


class IterFailsOnHostOne:
    def __iter__(self) -> Iterator[np.ndarray]:
        _fail_on_host_one("iter(dataset)")
        return iter([np.ones((8, 2), np.float32)])


def test_an_iterator_that_fails_to_start_on_one_host_exists_nowhere(
        group: GroupEngine) -> None:
    dataset = group.experimental_distribute_dataset(
        ship_object(IterFailsOnHostOne(), "the dataset", ""))
    with pytest.raises(HostOneError, match=r"iter\(dataset\) failed on purpose") as info:
        iter(dataset)
    _failed_on_host_one(info)
    _hosts_agree(group)
    _normal_round(group)


#: The operation time-out for the calls where a host gets stuck (the default is 600 s);
#: host 0's part of the call takes milliseconds.
STUCK_TIMEOUT_S = "10"


def _stuck_on_host_one(ctx: jaxpod.ValueContext) -> np.ndarray:
    if jax.process_index() == 1:
        import threading

        threading.Event().wait()  # never returns: its process is restarted
    return np.ones((2,), np.float32)


def test_a_host_stuck_past_the_time_out_gets_the_slice_reset(
        group: GroupEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    old = group.experimental_distribute_values_from_function(
        lambda ctx: np.ones((2,), np.float32))
    resets = group.group.resets
    with monkeypatch.context() as env, pytest.raises(jaxpod.SliceResetError,
                                                      match="workers were restarted"):
        env.setenv("JAXPOD_OPERATION_TIMEOUT_S", STUCK_TIMEOUT_S)
        group.experimental_distribute_values_from_function(_stuck_on_host_one)
    assert group.group.resets == resets + 1
    assert [s["num_values"] for s in group.stats()] == [0, 0]  # everything went
    # Values made after the reset never take the ids of values from before it: the
    # old handle names nothing, and dropping it frees nothing new.
    new = [group.experimental_distribute_values_from_function(
        lambda ctx, i=i: np.full((2,), i, np.float32)) for i in range(4)]
    with pytest.raises(jaxpod.HandleError, match="lost when its slice was reset"):
        group.run(lambda x: x, args=(old,))
    del old
    gc.collect()
    _normal_round(group)  # functions are defined again on the new workers
    for i, value in enumerate(new):
        np.testing.assert_array_equal(group.reduce("MAX", value, axis=None),
                                      np.full((2,), i, np.float32))
    _hosts_agree(group)


@pytest.mark.parametrize("method", ["run", "run_steps"])
def test_a_step_traced_differently_on_one_host_fails_and_the_slice_goes_on(
        group: GroupEngine, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    value = group.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))

    def step(x: jax.Array) -> jax.Array:
        _fail_on_host_one("tracing the step")  # host 0 traces a collective alone
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", x)

    def call() -> Any:
        if method == "run":
            return group.run(step, args=(value,))
        rows = [np.arange(8, dtype=np.float32)] * 2
        it = iter(group.experimental_distribute_dataset(ship_object(rows, "rows", "")))
        return group.make_values(step, lambda f: ops.RunSteps(f, it.id, 2, None))

    resets = group.group.resets
    # The hosts agree that they have the program before any dispatches it: an ordinary
    # failure, the user's own, with the slice and its values kept (the time-out and a
    # reset are only the safety net).
    with monkeypatch.context() as env, pytest.raises(
            HostOneError, match="tracing the step failed on purpose") as info:
        env.setenv("JAXPOD_OPERATION_TIMEOUT_S", STUCK_TIMEOUT_S)
        call()
    _failed_on_host_one(info)
    assert group.group.resets == resets
    np.testing.assert_allclose(group.gather(value, axis=0), np.repeat(np.arange(8), 2))
    _normal_round(group)
    _hosts_agree(group)


class RaisesMidStreamOnHostOne:
    """Two global batches of 8 rows; host 1's copy raises before the second."""

    def __iter__(self) -> Iterator[np.ndarray]:
        yield np.arange(8, dtype=np.float32)
        _fail_on_host_one("the dataset's second batch")
        yield np.arange(8, dtype=np.float32) + 8


@pytest.mark.parametrize("consumer", ["next", "run_steps"])
def test_a_dataset_that_raises_mid_stream_on_one_host_stops_its_iterator_everywhere(
        group: GroupEngine, consumer: str) -> None:
    shipped = ship_object(RaisesMidStreamOnHostOne(), "the dataset", "")
    it = iter(group.experimental_distribute_dataset(shipped))  # as the coordinator does
    np.testing.assert_allclose(group.reduce("SUM", next(it), axis=0), np.arange(8).sum())

    def consume() -> Any:
        if consumer == "next":
            return next(it)
        return group.make_values(lambda x: x * 2, lambda f: ops.RunSteps(f, it.id, 1, None))

    with pytest.raises(HostOneError, match="second batch failed on purpose") as info:
        consume()
    _failed_on_host_one(info)
    with pytest.raises(HostOneError, match="second batch failed on purpose"):
        consume()  # it stays failed, on every host alike, and nothing waits
    _hosts_agree(group)
    _normal_round(group)


def test_a_step_whose_outputs_differ_between_hosts_gets_the_slice_reset(
        group: GroupEngine) -> None:
    # Hosts other than host 0 answer a run with a digest of its outputs' infos; one
    # that does not match host 0's is a host out of lockstep, never a silent mix.
    value = group.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))

    def step(x: jax.Array) -> Any:
        return {"host1": x} if jax.process_index() == 1 else {"host0": x}

    resets = group.group.resets
    with pytest.raises(jaxpod.SliceResetError, match="workers were restarted") as info:
        group.run(step, args=(value,))
    assert "Host 1's result of operation Run differs from host 0's" in str(info.value)
    assert group.group.resets == resets + 1
    _normal_round(group)
    _hosts_agree(group)
