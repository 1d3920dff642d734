"""Distributed input: TF's rebatching (``experimental_distribute_dataset``),
``distribute_datasets_from_function``, the input/value contexts and the padding that
keeps shapes static."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import (
    RTOL,
    assert_trees_close,
    concat_stream,
    from_function_steps,
    pad_to,
    row_counts,
    take_rows,
    tf_per_replica_sizes,
    tf_rebatch,
)

import jaxpod
from jaxpod.worker.input import HostReplicas, RebatchFeed, per_replica_sizes

Tree = Any


def leaves_equal(got: Tree, want: Tree) -> None:
    assert_trees_close(got, want, rtol=0, atol=0)


def check_distributed_steps(strategy: jaxpod.TPUStrategy, dist: Any,
                            expected: list[list[Tree]], padded_rows: int) -> None:
    """Every step of ``dist`` holds exactly ``expected``'s rows per replica, padded with
    zeros to ``padded_rows``, with matching ``valid_rows``."""
    steps = list(dist)
    assert len(steps) == len(expected)
    for s, (batch, want) in enumerate(zip(steps, expected, strict=True)):
        per_replica = jax.tree.leaves(batch, is_leaf=lambda v: isinstance(v, jaxpod.PerReplica))
        assert all(isinstance(v, jaxpod.PerReplica) for v in per_replica)
        counts = row_counts(want)
        for v in per_replica:
            assert v.valid_rows is not None
            np.testing.assert_array_equal(v.valid_rows, counts, err_msg=f"step {s}")
            assert v.shape[0] == padded_rows
        results = strategy.experimental_local_results(batch)
        assert len(results) == strategy.num_replicas_in_sync
        for got, rows in zip(results, want, strict=True):
            leaves_equal(got, rows)
        # gather along the batch axis puts the step's real rows back in order
        leaves_equal(strategy.gather(batch, axis=0), concat_stream(want))
        padded = jax.tree.map(lambda v: np.asarray(v.array), batch,
                              is_leaf=lambda v: isinstance(v, jaxpod.PerReplica))
        stacked = jax.tree.map(lambda *xs: np.stack(xs),
                               *[pad_to(rows, padded_rows) for rows in want])
        leaves_equal(padded, stacked)


# --------------------------------------------- splitting global batches over hosts
@pytest.mark.parametrize(("g", "r"), [(10, 8), (4, 8), (7, 2), (5, 5), (16, 8), (3, 8)])
def test_per_replica_sizes_of_one_global_batch(g: int, r: int) -> None:
    want = [-(-g // r)] * (g % r) + [g // r] * (r - g % r)
    assert per_replica_sizes(g, r) == want == tf_per_replica_sizes(g, r)


def _layouts(per_host: list[int]) -> list[HostReplicas]:
    """Each host's place in the replica order, for hosts holding ``per_host`` replicas."""
    firsts = np.cumsum([0, *per_host])
    n = sum(per_host)
    return [HostReplicas(int(firsts[h]), c, n, min(per_host)) for h, c in enumerate(per_host)]


@pytest.mark.parametrize("per_host", [[1], [3], [2, 2], [4, 4], [3, 3, 3], [4, 4, 4, 4],
                                      [4, 2], [1, 3]])
def test_hosts_split_each_global_batch_in_replica_order(per_host: list[int]) -> None:
    """AUTO/DATA: the hosts' shares, in host order, are the one-host split over all
    replicas: contiguous, covering the batch, padded to one size on every host."""
    n = sum(per_host)
    for g in range(1, 3 * n + 2):
        splits = [h.split(g, jaxpod.AutoShardPolicy.AUTO) for h in _layouts(per_host)]
        assert [s for split in splits for s in split.sizes] == tf_per_replica_sizes(g, n)
        for before, split in zip([0, *itertools.accumulate(sum(s.sizes) for s in splits)],
                                 splits, strict=False):
            assert split.offset == before
            assert split.offset + sum(split.sizes) + split.rows_after == g
            assert split.rows_per_replica == -(-g // n)
        assert splits == [h.split(g, jaxpod.AutoShardPolicy.DATA) for h in _layouts(per_host)]


@pytest.mark.parametrize("per_host", [[2, 2], [4, 2], [3, 3, 3]])
def test_off_policy_splits_the_whole_batch_on_every_host(per_host: list[int]) -> None:
    """OFF: each host's replicas split the whole batch among themselves; the padding
    fits the host with the fewest replicas, so every host's arrays have one shape."""
    for g in range(1, 20):
        for h in _layouts(per_host):
            split = h.split(g, jaxpod.AutoShardPolicy.OFF)
            assert list(split.sizes) == tf_per_replica_sizes(g, h.count)
            assert (split.offset, split.rows_after) == (0, 0)
            assert split.rows_per_replica == -(-g // min(per_host))


def _feed_steps(feed: Any) -> list[tuple[list[np.ndarray], np.ndarray]]:
    """Every step of a host feed, copied (a step may alias the dataset's buffers)."""
    steps = []
    while (step := feed.next_step()) is not None:
        steps.append(([np.array(leaf) for leaf in step.leaves], step.counts.copy()))
    return steps


@pytest.mark.parametrize("per_host", [[2, 2], [4, 4], [4, 4, 4, 4], [4, 2], [1, 3]])
@pytest.mark.parametrize(("batch_sizes", "option"), [
    ([8, 8, 8], None), ([5, 3, 7], None), ([10, 10, 3], None), ([6, 6, 1], 5), ([3], None),
    ([3], 7), ([16, 16], 16), ([1, 1, 1], None)])
def test_host_feeds_together_equal_one_host(per_host: list[int], batch_sizes: list[int],
                                            option: int | None) -> None:
    """Each host's feed, put side by side in host order, gives exactly the steps (rows,
    padding, counts) a single host feeding every replica gives; also for a dataset that
    refills one buffer."""
    n = sum(per_host)
    total = sum(batch_sizes)
    data = np.arange(total * 2, dtype=np.float32).reshape(total, 2)
    bounds = np.cumsum([0, *batch_sizes])
    elements = [data[a:b] for a, b in itertools.pairwise(bounds)]
    options = jaxpod.InputOptions(global_batch_size=option)
    want = _feed_steps(RebatchFeed(elements, options, HostReplicas.single(n)))
    assert len(want) == -(-total // (option or batch_sizes[0]))
    datasets: list[Any] = [elements]
    if len(set(batch_sizes)) == 1:
        datasets.append(ReusedBufferDataset(data, batch_sizes[0]))
    for dataset in datasets:
        per_host_steps = [_feed_steps(RebatchFeed(dataset, options, h))
                          for h in _layouts(per_host)]
        assert all(len(steps) == len(want) for steps in per_host_steps)
        for s, (leaves, counts) in enumerate(want):
            joined = [np.concatenate([host[s][0][0] for host in per_host_steps])]
            np.testing.assert_array_equal(joined[0], leaves[0], err_msg=f"step {s}")
            np.testing.assert_array_equal(
                np.concatenate([host[s][1] for host in per_host_steps]), counts)


# ------------------------------------------------------ experimental_distribute_dataset
REBATCH_CASES: list[tuple[list[int], int | None]] = [
    ([8, 8, 8], None),  # even
    ([5, 3, 7], None),  # crosses input-batch boundaries, G inferred = 5
    ([4, 4, 2], None),  # 10 rows, G = 4: partial last batch
    ([10, 10, 3], None),  # G = 10 (over 8: [2, 2, 1, 1, 1, 1, 1, 1]), short tail
    ([6, 6, 1], 5),  # explicit global batch size, unrelated to the input batches
    ([3], 7),  # one short input batch: a single partial step
]


@pytest.mark.parametrize(("batch_sizes", "option"), REBATCH_CASES,
                         ids=[f"{b}-G{o}" for b, o in REBATCH_CASES])
def test_distribute_dataset_rebatches_like_tf(sstrategy: jaxpod.TPUStrategy,
                                              batch_sizes: list[int],
                                              option: int | None) -> None:
    r = sstrategy.num_replicas_in_sync
    total = sum(batch_sizes)
    data = np.arange(total * 2, dtype=np.float32).reshape(total, 2)
    bounds = np.cumsum([0, *batch_sizes])
    elements = [data[a:b] for a, b in itertools.pairwise(bounds)]
    g = option if option is not None else batch_sizes[0]
    options = None if option is None else jaxpod.InputOptions(global_batch_size=option)
    dist = sstrategy.experimental_distribute_dataset(elements, options)
    assert isinstance(dist, jaxpod.DistributedDataset)
    expected = tf_rebatch(elements, g, r)
    assert len(expected) == -(-total // g)
    check_distributed_steps(sstrategy, dist, expected, padded_rows=-(-g // r))


def test_distribute_dataset_of_nested_elements(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    elements = [
        {"image": rng.normal(size=(n, 2, 2)).astype(np.float32),
         "meta": (rng.integers(0, 9, size=(n,)).astype(np.int32),
                  rng.normal(size=(n, 1)).astype(np.float32))}
        for n in (6, 6, 5)
    ]
    dist = sstrategy.experimental_distribute_dataset(elements)
    expected = tf_rebatch(elements, 6, r)
    check_distributed_steps(sstrategy, dist, expected, padded_rows=-(-6 // r))
    batch = next(iter(dist))
    assert isinstance(batch, dict)
    assert isinstance(batch["meta"], tuple)
    assert batch["meta"][0].dtype == np.int32


@pytest.mark.in_process
def test_distribute_dataset_accepts_a_generator_and_jax_arrays(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2)
    data = np.arange(12, dtype=np.float32).reshape(6, 2)

    def batches() -> Iterator[jax.Array]:
        for i in range(0, 6, 4):
            yield jnp.asarray(data[i:i + 4])

    dist = strategy.experimental_distribute_dataset(batches())
    expected = tf_rebatch([data[:4], data[4:]], 4, 2)
    check_distributed_steps(strategy, dist, expected, padded_rows=2)


def test_iterating_again_starts_a_new_epoch(sstrategy: jaxpod.TPUStrategy) -> None:
    r = sstrategy.num_replicas_in_sync
    data = np.arange(9, dtype=np.int32)
    elements = [data[:4], data[4:8], data[8:]]
    dist = sstrategy.experimental_distribute_dataset(elements)
    expected = tf_rebatch(elements, 4, r)
    epochs = [[sstrategy.experimental_local_results(b) for b in dist] for _ in range(2)]
    for epoch in epochs:
        assert len(epoch) == len(expected)
        for got, want in zip(epoch, expected, strict=True):
            leaves_equal(list(got), want)


def test_iterator_get_next_and_end_of_data(strategy_of: Callable[..., jaxpod.TPUStrategy]
                                           ) -> None:
    strategy = strategy_of(2)
    data = np.arange(6, dtype=np.float32)
    dist = strategy.experimental_distribute_dataset([data[:4], data[4:]])
    it = iter(dist)
    assert isinstance(it, jaxpod.DistributedIterator)
    assert iter(it) is it
    first = it.get_next()
    leaves_equal(list(strategy.experimental_local_results(first)), [data[:2], data[2:4]])
    second = next(it)
    leaves_equal(list(strategy.experimental_local_results(second)), [data[4:], data[:0]])
    with pytest.raises(jaxpod.EndOfDataError):
        next(it)
    with pytest.raises(StopIteration):  # EndOfDataError is a StopIteration, and stays ended
        it.get_next()
    assert next(it, "done") == "done"


def test_row_mask_and_count_inside_the_step(sstrategy: jaxpod.TPUStrategy) -> None:
    """``ctx.num_valid_rows`` / ``ctx.valid_row_mask`` match TF's real per-replica rows,
    and a masked all-reduce sees exactly the step's real rows."""
    r = sstrategy.num_replicas_in_sync
    # 3 features: no output below has a length equal to the padded batch (10, 5, 2).
    data = np.random.default_rng(1).uniform(1, 2, size=(23, 3)).astype(np.float32)
    elements = [data[:10], data[10:20], data[20:]]
    expected = tf_rebatch(elements, 10, r)
    rows = -(-10 // r)
    traces = 0

    def fn(batch: jax.Array) -> dict[str, jax.Array]:
        nonlocal traces
        traces += 1
        ctx = jaxpod.get_replica_context()
        assert ctx is not None
        mask = ctx.valid_row_mask
        masked = jnp.where(mask[:, None], batch, 0.0)
        return {
            "count": ctx.num_valid_rows,
            "mask": mask,
            "global_count": ctx.all_reduce("SUM", ctx.num_valid_rows),
            "global_sum": ctx.all_reduce("SUM", jnp.sum(masked, axis=0)),
        }

    traces_after_first = 0
    for batch, want in zip(sstrategy.experimental_distribute_dataset(elements), expected,
                           strict=True):
        out = sstrategy.run(fn, args=(batch,))
        traces_after_first = traces_after_first or traces  # the first call may probe once
        counts = row_counts(want)
        got = sstrategy.experimental_local_results(out)
        for i, res in enumerate(got):
            assert int(res["count"]) == counts[i]
            np.testing.assert_array_equal(res["mask"][:counts[i]], np.ones(counts[i], bool))
            np.testing.assert_array_equal(np.asarray(out["mask"].array)[i],
                                          np.arange(rows) < counts[i])
            assert int(res["global_count"]) == sum(counts)
            np.testing.assert_allclose(res["global_sum"],
                                       concat_stream(want).sum(axis=0), rtol=RTOL)
    assert traces == traces_after_first, "padded steps must reuse the compiled step"


# ------------------------------------------------ distribute_datasets_from_function
def this_hosts_elements(ctx: jaxpod.InputContext, elements: list[Any]) -> list[Any]:
    """What a ``dataset_fn`` returns on the host ``ctx`` names so that replica ``r`` of
    step ``s`` dequeues element ``s * R + r`` whatever the number of hosts (each host
    holds an equal, contiguous range of the replicas): a dataset_fn shards its input
    by ``ctx`` on several hosts, as in TF; on one host this is every element."""
    r = ctx.num_replicas_in_sync
    per_host = r // ctx.num_input_pipelines
    first = ctx.input_pipeline_id * per_host
    return [e for i, e in enumerate(elements) if first <= i % r < first + per_host]


def _per_replica_elements(sizes: list[int], seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n, 3)).astype(np.float32),
             "y": rng.integers(0, 5, size=(n,)).astype(np.int32)} for n in sizes]


FROM_FUNCTION_CASES = [
    [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4],  # 16 full elements
    [3, 3, 3, 3, 3, 1],  # short last element; some replicas end with 0 rows
    [4, 2, 2, 2, 2, 2, 2, 2, 2, 2],  # later elements shorter than the first
]


@pytest.mark.in_process
@pytest.mark.parametrize("sizes", FROM_FUNCTION_CASES, ids=["even", "tail", "shorter"])
def test_datasets_from_function_one_element_per_replica_per_step(
        sstrategy: jaxpod.TPUStrategy, sizes: list[int]) -> None:
    r = sstrategy.num_replicas_in_sync
    elements = _per_replica_elements(sizes, seed=len(sizes))
    contexts: list[jaxpod.InputContext] = []

    def dataset_fn(ctx: jaxpod.InputContext) -> list[dict[str, np.ndarray]]:
        contexts.append(ctx)
        return elements

    dist = sstrategy.distribute_datasets_from_function(dataset_fn)
    expected = from_function_steps(elements, r, empty_like=elements[0])
    check_distributed_steps(sstrategy, dist, expected, padded_rows=sizes[0])
    assert len(contexts) == 1
    ctx = contexts[0]
    assert isinstance(ctx, jaxpod.InputContext)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (
        1, 0, r)


def test_datasets_from_function_with_a_generator_and_run(
        sstrategy: jaxpod.TPUStrategy) -> None:
    """A typical dataset_fn: per-replica batch size from the context, a generator of
    batches; the step sees the right rows and the reductions count real rows only."""
    r = sstrategy.num_replicas_in_sync
    global_batch = 4 * r
    data = np.random.default_rng(2).normal(size=(3 * global_batch - 3, 2)).astype(np.float32)

    def dataset_fn(ctx: jaxpod.InputContext) -> Iterator[np.ndarray]:
        b = ctx.get_per_replica_batch_size(global_batch)
        yield from this_hosts_elements(ctx, [data[i:i + b] for i in range(0, len(data), b)])

    per_replica = [data[i:i + 4] for i in range(0, len(data), 4)]
    expected = from_function_steps(per_replica, r, empty_like=data)

    def fn(x: jax.Array) -> jax.Array:
        return x * 2.0

    dist = sstrategy.distribute_datasets_from_function(dataset_fn)
    batches = list(dist)
    assert len(batches) == len(expected)
    for batch, want in zip(batches, expected, strict=True):
        out = sstrategy.run(fn, args=(batch,))
        real = [w * 2.0 for w in want]
        np.testing.assert_allclose(sstrategy.reduce("MEAN", out, axis=0),
                                   np.concatenate(real).mean(axis=0), rtol=RTOL)
        np.testing.assert_allclose(sstrategy.reduce("SUM", out, axis=0),
                                   np.concatenate(real).sum(axis=0), rtol=RTOL, atol=1e-5)
        np.testing.assert_allclose(sstrategy.gather(out, 0), np.concatenate(real))


def test_datasets_from_function_equal_short_rows_reduce_elementwise(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """When every replica holds the same number of real rows of a padded batch,
    axis=None reductions and gathers along other axes use those rows."""
    strategy = strategy_of(2)
    first = [np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * i for i in range(2)]
    short = [np.arange(4, dtype=np.float32).reshape(2, 2) + 100 * i for i in range(2)]
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: this_hosts_elements(ctx, first + short))
    batches = list(dist)
    assert len(batches) == 2
    last = batches[1]
    assert last.shape == (4, 2)
    np.testing.assert_array_equal(last.valid_rows, [2, 2])
    for op, fn in (("SUM", np.sum), ("MAX", np.max), ("MEAN", np.mean)):
        np.testing.assert_allclose(strategy.reduce(op, last, axis=None),
                                   fn(np.stack(short), axis=0))
        np.testing.assert_allclose(strategy.reduce(op, last, axis=1),
                                   fn(np.concatenate(short, axis=1), axis=1))
    np.testing.assert_array_equal(strategy.gather(last, axis=1), np.concatenate(short, axis=1))
    np.testing.assert_array_equal(strategy.gather(last, axis=0), np.concatenate(short))


@pytest.mark.in_process
def test_datasets_from_function_restarts_each_epoch(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    """As in TF, dataset_fn runs once per host; each epoch iterates what it returned."""
    strategy = strategy_of(2)
    elements = [np.full((2,), i, np.int32) for i in range(5)]
    calls = []

    def dataset_fn(ctx: jaxpod.InputContext) -> list[np.ndarray]:
        calls.append(ctx)
        return elements

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert calls == [jaxpod.InputContext(1, 0, 2)]
    expected = from_function_steps(elements, 2, empty_like=elements[0])
    for _ in range(2):
        got = [list(strategy.experimental_local_results(b)) for b in dist]
        assert len(got) == len(expected)
        for g, w in zip(got, expected, strict=True):
            leaves_equal(g, w)
    assert len(calls) == 1


# --------------------------------------------------------------- input contexts
def test_input_context_defaults_and_per_replica_batch_size() -> None:
    ctx = jaxpod.InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (
        1, 0, 1)
    ctx = jaxpod.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                              num_replicas_in_sync=8)
    for g in (8, 16, 64, 800):
        assert ctx.get_per_replica_batch_size(g) == g // 8
    for g in (1, 7, 10, 801):
        with pytest.raises(ValueError, match=f"{g}"):
            ctx.get_per_replica_batch_size(g)


@pytest.mark.parametrize("kwargs", [
    {"num_input_pipelines": 0},
    {"num_input_pipelines": 2, "input_pipeline_id": 2},
    {"input_pipeline_id": -1},
    {"num_replicas_in_sync": 0},
    {"num_replicas_in_sync": 2.0},
    {"num_input_pipelines": True},
])
def test_input_context_rejects_bad_fields(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        jaxpod.InputContext(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"replica_id_in_sync_group": 2, "num_replicas_in_sync": 2},
    {"replica_id_in_sync_group": -1, "num_replicas_in_sync": 2},
    {"replica_id_in_sync_group": 0, "num_replicas_in_sync": 0},
    {"replica_id_in_sync_group": 1.0, "num_replicas_in_sync": 2},
])
def test_value_context_rejects_bad_fields(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        jaxpod.ValueContext(**kwargs)


def test_value_context_fields() -> None:
    ctx = jaxpod.ValueContext(replica_id_in_sync_group=3, num_replicas_in_sync=4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (3, 4)
    assert jaxpod.ValueContext() == jaxpod.ValueContext(0, 1)


def test_stream_rows_cross_element_boundaries_example() -> None:
    """The numpy reference itself: input batches 5, 3, 7 with G=5 over 2 replicas take
    rows [0:3], [3:5] | [5:8], [8:10] | [10:13], [13:15]."""
    data = np.arange(15)
    steps = tf_rebatch([data[:5], data[5:8], data[8:]], 5, 2)
    assert [[take_rows(s, 0, 99).tolist() for s in step] for step in steps] == [
        [[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]], [[10, 11, 12], [13, 14]]]


class ReusedBufferDataset:
    """Yields the same numpy buffer every time, refilled with the next batch (a common
    pattern for generators that avoid allocations). Each element must be taken as it
    was when yielded, as TF's ``from_generator`` copies it."""

    def __init__(self, data: np.ndarray, batch: int) -> None:
        self.data = data
        self.batch = batch

    def __iter__(self) -> Iterator[np.ndarray]:
        buffer = np.empty((self.batch, *self.data.shape[1:]), self.data.dtype)
        for start in range(0, len(self.data), self.batch):
            buffer[:] = self.data[start:start + self.batch]
            yield buffer


@pytest.mark.parametrize("steps_per_run", [1, 3])
def test_elements_are_taken_as_yielded(strategy_of: Callable[..., jaxpod.TPUStrategy],
                                       steps_per_run: int) -> None:
    """Also with steps_per_run > 1, where input is prepared several steps at a time."""
    for r in (2, 8):
        strategy = strategy_of(r, steps_per_run)
        g = 2 * r
        data = np.arange(5 * g * 2, dtype=np.float32).reshape(5 * g, 2)
        dist = strategy.experimental_distribute_dataset(ReusedBufferDataset(data, g))
        expected = tf_rebatch([data[i:i + g] for i in range(0, len(data), g)], g, r)
        check_distributed_steps(strategy, dist, expected, padded_rows=2)


def test_two_iterators_of_one_dataset_are_independent(
        strategy_of: Callable[..., jaxpod.TPUStrategy]) -> None:
    strategy = strategy_of(2)
    data = np.arange(12, dtype=np.int32)
    dist = strategy.experimental_distribute_dataset([data[:4], data[4:8], data[8:]])
    expected = tf_rebatch([data[:4], data[4:8], data[8:]], 4, 2)
    a, b = iter(dist), iter(dist)
    for want in expected:
        leaves_equal(list(strategy.experimental_local_results(next(a))), want)
        leaves_equal(list(strategy.experimental_local_results(next(b))), want)


@pytest.mark.parametrize("steps_per_run", [2, 3])
def test_iteration_with_several_steps_per_run(strategy_of: Callable[..., jaxpod.TPUStrategy],
                                              steps_per_run: int) -> None:
    """Input prepared several steps ahead still comes out one step per ``next``."""
    for r in (2, 8):
        strategy = strategy_of(r, steps_per_run)
        data = np.arange(46, dtype=np.float32).reshape(23, 2)
        elements = [data[:10], data[10:13], data[13:]]
        dist = strategy.experimental_distribute_dataset(elements)
        check_distributed_steps(strategy, dist, tf_rebatch(elements, 10, r),
                                padded_rows=-(-10 // r))


_EXIT_SCRIPT = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
import numpy as np
import jaxpod
strategy = jaxpod.TPUStrategy()
data = np.ones((64, 64, 64), np.float32)
iterators = []
for _ in range(16):
    it = iter(strategy.experimental_distribute_dataset([data] * 1000))
    next(it)
    iterators.append(it)  # still referenced, mid-epoch, when the interpreter exits
print("ok")
"""


def _spawn_exit_script() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_interpreter_exits_cleanly_with_iterators_mid_epoch() -> None:
    """A program that stops iterating before the end of its data (the usual case for
    infinite datasets) must still exit with status 0: input preparation must not
    abort the process during interpreter shutdown. Several runs, since it is a race."""
    results: list[tuple[int, str, str]] = []
    for _ in range(3):
        for proc in [_spawn_exit_script() for _ in range(2)]:
            out, err = proc.communicate(timeout=120)
            results.append((proc.returncode, out.strip(), err.strip()[-300:]))
    assert all(out == "ok" for _, out, _ in results), results
    assert [rc for rc, _, _ in results] == [0] * len(results), results
