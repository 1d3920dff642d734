"""Distributing values and input over the replicas.

``experimental_distribute_values_from_function`` (every host checks that the replicas'
values agree), ``experimental_distribute_dataset`` and
``distribute_datasets_from_function``; the datasets they make (:class:`LocalDataset`)
and their iterators (:class:`LocalIterator`), which take a step, or a loop's steps
(:class:`StepBatch`), at a time from an infeed and have every host agree on how many
remain.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np

from jaxpod.errors import EndOfDataError, PeerHostError
from jaxpod.types import InputContext, InputOptions, ValueContext
from jaxpod.values import DistributedDataset, DistributedIterator, PerReplica
from jaxpod.worker import input as input_lib
from jaxpod.worker.engine_core import ARRAY_TYPES, EngineCore
from jaxpod.worker.infeed import Chunk, Infeed


@dataclass(frozen=True)
class StepBatch:
    """``num_steps`` steps of input: arrays ``(replicas, steps, rows, ...)`` on device,
    and their real rows ``counts`` ``(replicas, steps)``; without the ``steps`` axis
    when taken ``stepless`` (one step, for ``next``)."""

    treedef: Any
    arrays: list[jax.Array]
    counts: jax.Array
    num_steps: int
    rows: int | None
    valid_rows: np.ndarray | None  # (replicas, steps) real rows; None: not a batch


class InputDistribution(EngineCore):
    """The engine's ways to distribute values and datasets over its replicas (a part
    of :class:`~jaxpod.worker.engine.Engine`)."""

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls ``value_fn(ValueContext)`` for each local replica; returns PerReplica.

        Every replica's value must have one structure, shapes and dtypes. A host sees
        only its own replicas' values, so on several hosts they first compare
        descriptions of them (every host takes part even when ``value_fn`` failed on
        it), and a mismatch raises the same error on every host instead of leaving
        each with a global array of its own idea of the shape.
        """
        try:
            per_replica = [value_fn(ValueContext(r, self.num_replicas_in_sync))
                           for r in self.local_replicas]
            treedef, columns = _value_columns(per_replica, self.local_replicas)
        except Exception:
            if self.num_hosts > 1:
                self._allgather_json(None)  # the others must not wait for this host
            raise
        described = _describe_values(treedef, columns, self.local_replicas)
        if self.num_hosts > 1:
            per_host = self._allgather_json(described)
            failed = [h for h, d in enumerate(per_host) if d is None]
            if failed:
                raise PeerHostError(
                    "experimental_distribute_values_from_function: value_fn failed on "
                    f"host(s) {failed}; see their error. No value was distributed."
                )
            described = [_as_description(d) for host in per_host for d in host]
        _check_same_values(described)
        arrays = [self._to_global(np.stack(col)) for col in columns]
        return jax.tree.unflatten(treedef, [PerReplica(a) for a in arrays])

    def experimental_distribute_dataset(self, dataset: Iterable[Any],
                                        options: InputOptions | None = None) -> LocalDataset:
        """Rebatches a globally batched dataset across replicas (TF's rules).

        Each step takes one global batch split over all replicas of all hosts, so
        the result does not depend on how many hosts the replicas sit on; each host
        reads the whole dataset and keeps its own replicas' rows.
        """
        opts = _check_options(options)
        if not isinstance(dataset, Iterable):
            raise TypeError(
                "experimental_distribute_dataset: dataset must be an iterable of batches "
                f"(pytrees of arrays). Got {type(dataset).__name__}."
            )
        return LocalDataset(self, lambda: input_lib.RebatchFeed(
            dataset, opts, self.host_replicas))

    def distribute_datasets_from_function(
            self, dataset_fn: Callable[[InputContext], Iterable[Any]],
            options: InputOptions | None = None) -> LocalDataset:
        """Calls ``dataset_fn(InputContext)`` once per host; one element per replica/step."""
        _check_options(options)
        if not callable(dataset_fn):
            raise TypeError(
                "distribute_datasets_from_function: dataset_fn must be a callable taking a "
                f"jaxpod.InputContext. Got {type(dataset_fn).__name__}."
            )
        context = InputContext(self.num_hosts, self.host_index, self.num_replicas_in_sync)
        dataset = dataset_fn(context)  # once per host, as TF does; each epoch iterates it
        if not isinstance(dataset, Iterable):
            raise TypeError(
                "distribute_datasets_from_function: dataset_fn must return an iterable of "
                f"per-replica batches. It returned a {type(dataset).__name__}."
            )
        return LocalDataset(self, lambda: input_lib.FunctionFeed(
            dataset, self._num_local_replicas))


class LocalDataset(DistributedDataset):
    """A dataset distributed over this process's engine; iterate it once per epoch."""

    def __init__(self, engine: EngineCore, make_feed: Callable[[], input_lib.HostFeed]) -> None:
        self._engine = engine
        self._make_feed = make_feed

    def __iter__(self) -> LocalIterator:
        return self.iterate()

    def iterate(self, steps_per_run: int | None = None) -> LocalIterator:
        """An iterator whose infeed prepares ``steps_per_run`` steps at a time (default:
        the strategy's)."""
        return LocalIterator(self._engine, self._make_feed(), steps_per_run)


class LocalIterator(DistributedIterator):
    """Yields one step of input per ``next``: a nest of ``PerReplica`` batches.

    Input is prepared ahead on an infeed thread (see :mod:`jaxpod.worker.infeed`) in
    chunks of ``steps_per_run`` steps, then of as many as the last request asked for.
    """

    def __init__(self, engine: EngineCore, feed: input_lib.HostFeed,
                 steps_per_run: int | None = None) -> None:
        self._engine = engine
        self._infeed = Infeed(feed, engine._to_global, engine._num_local_replicas,
                              steps_per_run or engine.steps_per_run,
                              waits=engine.input_wait)
        weakref.finalize(self, self._infeed.close)
        self._leftover: Chunk | None = None
        #: Why this iterator cannot go on (its dataset raised here or on another host):
        #: every later ``next`` raises it again, on every host, without a collective.
        self._failure: BaseException | None = None
        self._next_start: Any = None  # where the step after the last one taken starts

    def __iter__(self) -> LocalIterator:
        return self

    @property
    def prefetched(self) -> int:
        """Chunks of steps its infeed has placed on the devices, ready to take (those
        read ahead into host memory only are not counted)."""
        return self._infeed.depth

    @property
    def position(self) -> dict[str, Any] | None:
        """Where this host's input is, for a checkpoint (see
        :attr:`jaxpod.job_wrappers.Epochs.start`): the position the step after the last one
        taken starts at (the infeed reads ahead, so the dataset's own position is further
        on) and the batch size the feed keeps. ``None`` before the first step, or when the dataset
        does not tell (:class:`jaxpod.job_wrappers.Epochs` does)."""
        if self._next_start is None:
            return None
        return {"at": self._next_start, **self._infeed.feed.batch_of_record()}

    def __next__(self) -> Any:
        batch = self.next_steps(1, stepless=True)
        assert batch.valid_rows is not None
        valid = batch.valid_rows[:, 0]  # one array for all: a step's leaves share it
        leaves = [PerReplica(a, valid) for a in batch.arrays]
        return jax.tree.unflatten(batch.treedef, leaves)

    def full_steps_ahead(self) -> int:
        """Steps this host has ready, in order, before the first that is not full (a
        replica short of rows), the input's end or its error: if every host has ``c``,
        the next ``c`` steps are full everywhere, so a client can take them without
        waiting to hear whether the input ended."""
        if self._failure is not None:
            return 0
        ready = self._infeed.ready_chunks()
        count = 0
        for chunk in ([self._leftover] if self._leftover is not None else []) + ready:
            count += chunk.full_steps
            if chunk.full_steps < chunk.num_steps:
                break
        return count

    def next_steps(self, k: int, stepless: bool = False) -> StepBatch:
        """Up to ``k`` steps of input, stacked; hosts agree on how many remain. With
        ``stepless`` (``next``: ``k`` is 1), the arrays and counts have no steps axis,
        and the infeed places later steps that way.

        Raises:
          EndOfDataError: no host has input left.
        """
        eng, infeed = self._engine, self._infeed
        infeed.set_stepless(stepless)
        if self._failure is not None:
            raise self._failure
        try:
            chunk = self._local_chunk(infeed, k)
        except Exception as e:
            self._failure = e
            if eng.num_hosts > 1:  # the others must not wait for this host's counts
                eng._allgather_host(np.full((eng._num_local_replicas, k), -1, np.int32))
            raise
        if chunk is None and eng.num_hosts == 1:
            raise EndOfDataError("The distributed dataset has no more input.")
        # A host whose input ended still takes part: it may be the only one.
        local = (chunk.counts if chunk is not None
                 else np.zeros((eng._num_local_replicas, k), np.int32))
        counts = eng._allgather_host(local)
        if (counts < 0).any():
            self._failure = PeerHostError(
                "The distributed dataset raised on another host of the slice (see that "
                "host's error); this iterator cannot go on. Create a new one.")
            raise self._failure
        n = int(np.count_nonzero(counts.any(axis=0)))
        if n == 0:  # before empty_chunk: an empty dataset has no element spec
            raise EndOfDataError("The distributed dataset has no more input.")
        if chunk is None:
            chunk = infeed.empty_chunk(k)
        if chunk.stepless != stepless:  # placed before next and run_steps took turns
            # Again from the host's copy: a program on the devices would have to run
            # on every host, and another host may have placed its chunk the other way.
            chunk = infeed.place(chunk.host, chunk.counts, chunk.last, chunk.positions)
        placed = chunk.placed
        # Only input already on the devices goes to a step: a step on XLA's CPU devices
        # that read input still being copied there hung in its all-reduce (7 of 8
        # devices arrived). The infeed placed it ahead, so this seldom waits.
        jax.block_until_ready(placed)
        if n < k:  # the input ended inside this chunk
            cut = eng._cached(("first_steps", n), lambda: jax.jit(
                lambda x: x[:, :n], out_shardings=eng._replica_sharding))
            placed = [cut(a) for a in placed]
        taken = chunk.positions[:n]
        if taken and taken[-1] is not None:
            self._next_start = taken[-1]
        return StepBatch(infeed.spec.treedef, placed[:-1], placed[-1], n, infeed.rows,
                         counts[:, :n])

    def _local_chunk(self, infeed: Infeed, k: int) -> Chunk | None:
        """This host's next ``k`` steps (padded with empty steps at the end)."""
        first = self._leftover
        self._leftover = None
        if first is None:
            first = infeed.get()
            if first is None:
                return None
            if first.num_steps == k:
                return first
            infeed.set_steps(k)
        chunk, self._leftover = infeed.rechunk(first, k)
        return chunk


#: A replica's value as hosts compare it: replica, structure, (dtype, shape) per leaf.
_Description = tuple[int, str, list[tuple[str, tuple[int, ...]]]]


def _value_columns(per_replica: list[Any], replicas: Sequence[int]
                   ) -> tuple[Any, list[list[np.ndarray]]]:
    """The values' common structure and, per leaf, every replica's array.

    Raises:
      ValueError: replicas returned different structures.
      TypeError: a leaf is not an array or a number.
    """
    leaves0, treedef = jax.tree.flatten(per_replica[0])
    columns: list[list[np.ndarray]] = [[] for _ in leaves0]
    for r, v in zip(replicas, per_replica, strict=True):
        leaves, td = jax.tree.flatten(v)
        if td != cast(Any, treedef):
            _raise_different_structures(replicas[0], str(treedef), r, str(td))
        for col, leaf in zip(columns, leaves, strict=True):
            if not isinstance(leaf, ARRAY_TYPES):
                raise TypeError(
                    "experimental_distribute_values_from_function: value_fn must return "
                    f"arrays or numbers; replica {r} returned a {type(leaf).__name__}."
                )
            col.append(np.asarray(leaf))
    return treedef, columns


def _describe_values(treedef: Any, columns: list[list[np.ndarray]], replicas: Sequence[int]
                     ) -> list[_Description]:
    return [(r, str(treedef), [(str(col[i].dtype), col[i].shape) for col in columns])
            for i, r in enumerate(replicas)]


def _as_description(raw: list[Any]) -> _Description:
    """A description back from JSON (which made its tuples lists)."""
    r, treedef, leaves = raw
    return int(r), str(treedef), [(str(d), tuple(int(n) for n in s)) for d, s in leaves]


def _check_same_values(described: list[_Description]) -> None:
    """Raises if the replicas' values differ in structure, shape or dtype."""
    first, treedef, leaves0 = described[0]
    for r, td, _ in described[1:]:
        if td != treedef:
            _raise_different_structures(first, treedef, r, td)
    for i in range(len(leaves0)):
        if len({leaves[i] for _, _, leaves in described}) > 1:
            got = ", ".join(f"replica {r}: {leaves[i][0]}{list(leaves[i][1])}"
                            for r, _, leaves in described)
            raise ValueError(
                "Per-replica values must have the same shape and dtype on every replica; "
                f"got {got}. Pad them to a common shape."
            )


def _raise_different_structures(first: int, treedef: str, r: int, td: str) -> None:
    raise ValueError(
        "experimental_distribute_values_from_function: replicas returned different "
        f"structures: replica {first} gave {treedef}, replica {r} gave {td}."
    )


def _check_options(options: InputOptions | None) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be a jaxpod.InputOptions or None. Got {options!r}.")
    return options
