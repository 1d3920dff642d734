"""Distributed input: TF's rebatching rules, host-local feeds and their iterators.

``experimental_distribute_dataset`` takes an iterable of *globally* batched pytrees
of arrays and treats it as one stream of rows. Every step consumes one global batch
(``global_batch_size`` rows of the stream, crossing input-batch boundaries) split
over all replicas of all hosts in replica order, with sizes as even as possible (the
first replicas take the extra row, see :func:`per_replica_sizes`). Each host reads
the whole stream and keeps only its own replicas' rows (a contiguous range of the
replica order, see :class:`HostReplicas`), so the rows, valid counts and number of
steps are the same whatever the number of hosts. JAX needs static shapes: every
minibatch is padded to the largest size and the number of real rows travels with it.

``distribute_datasets_from_function`` instead calls the user's ``dataset_fn`` once per
host; every local replica dequeues one element (already per-replica batched) per step.

When the dataset's iterator says where it is (a job's input,
:class:`jaxpod.job_wrappers.Epochs`), every step carries the input position the next
step starts at, so a checkpoint can save it without the feed reading on; such an
iterator may also ask to start some rows into its first element (a resumed attempt),
which the feeds drop before their first step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from jaxpod.types import AutoShardPolicy, InputOptions


def per_replica_sizes(global_batch_size: int, num_replicas: int) -> list[int]:
    """TF's split of one global batch: ``ceil(G / N)`` rows for the first ``G mod N``
    replicas, ``floor(G / N)`` for the rest."""
    floor, num_ceil = divmod(global_batch_size, num_replicas)
    return [floor + 1] * num_ceil + [floor] * (num_replicas - num_ceil)


@dataclass(frozen=True)
class HostReplicas:
    """Where this host's replicas sit in the global replica order.

    Attributes:
      first: this host's first replica; its replicas are ``first .. first + count - 1``.
      count: replicas on this host.
      num_replicas: replicas on all hosts.
      fewest: the fewest replicas any host has (hosts may differ when a device
        assignment uses only some devices).
    """

    first: int
    count: int
    num_replicas: int
    fewest: int

    @classmethod
    def single(cls, num_replicas: int) -> HostReplicas:
        """One host holding every replica."""
        return cls(0, num_replicas, num_replicas, num_replicas)

    def split(self, global_batch_size: int, policy: AutoShardPolicy) -> BatchSplit:
        """Which rows of each global batch this host's replicas take.

        ``AUTO``/``DATA``: the batch is split over all replicas of all hosts and this
        host takes its replicas' share. ``OFF``: every host reads the same rows and
        its own replicas split the whole batch among themselves.
        """
        if policy is AutoShardPolicy.OFF:
            sizes = per_replica_sizes(global_batch_size, self.count)
            # Padded to the largest share of any host: global arrays need one shape.
            return BatchSplit(0, tuple(sizes), -(-global_batch_size // self.fewest),
                              global_batch_size)
        sizes = per_replica_sizes(global_batch_size, self.num_replicas)
        mine = tuple(sizes[self.first:self.first + self.count])
        return BatchSplit(sum(sizes[:self.first]), mine, sizes[0], global_batch_size)


@dataclass(frozen=True)
class BatchSplit:
    """This host's replicas' rows of one global batch.

    Attributes:
      offset: rows of the batch before this host's first replica's.
      sizes: rows of each local replica, in order, right after ``offset``.
      rows_per_replica: the padded per-replica size, the same on every host.
      global_batch_size: rows the whole batch has.
    """

    offset: int
    sizes: tuple[int, ...]
    rows_per_replica: int
    global_batch_size: int

    @property
    def rows_after(self) -> int:
        """Rows of the batch after this host's replicas' (other hosts' rows)."""
        return self.global_batch_size - self.offset - sum(self.sizes)

    @property
    def full(self) -> bool:
        """Every local replica takes a full (unpadded) minibatch of every full batch."""
        return all(s == self.rows_per_replica for s in self.sizes)


@dataclass(frozen=True)
class ElementSpec:
    """Structure, per-row shape and dtype of every leaf of a dataset element."""

    treedef: Any
    row_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype[Any], ...]

    def empty_rows(self) -> list[np.ndarray]:
        return [np.zeros((0, *s), d) for s, d in zip(self.row_shapes, self.dtypes, strict=True)]


def flatten_element(element: Any, where: str, spec: ElementSpec | None) -> tuple[
        list[np.ndarray], ElementSpec]:
    """Flattens one dataset element into leaves with a shared leading (row) dimension.

    Raises:
      TypeError: a leaf is not an array or the structure changed between elements.
      ValueError: a leaf is a scalar, or leaves disagree on the row count, or the
        per-row shape or dtype changed between elements.
    """
    leaves, treedef = jax.tree.flatten(element)
    arrays = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, np.ndarray | np.generic | jax.Array | int | float | bool):
            path = _leaf_paths(element)[i]
            raise TypeError(
                f"{where}: leaf {path} is a {type(leaf).__name__}; dataset elements must be "
                "pytrees (tuples, lists, dicts) of numpy or jax arrays."
            )
        arr = np.asarray(leaf)
        if arr.ndim == 0:
            path = _leaf_paths(element)[i]
            raise ValueError(
                f"{where}: leaf {path} is a scalar, but elements must be batches with a "
                "leading batch dimension. Batch the dataset first (yield arrays of shape "
                "(batch, ...), e.g. x.reshape(-1, *row_shape)) before distributing it."
            )
        arrays.append(arr)
    if not arrays:
        raise TypeError(f"{where}: the element {element!r} holds no arrays.")
    rows = {a.shape[0] for a in arrays}
    if len(rows) > 1:
        shapes = {p: a.shape for p, a in zip(_leaf_paths(element), arrays, strict=True)}
        raise ValueError(
            f"{where}: leaves disagree on the batch (leading) dimension: {shapes}. Every "
            "leaf of an element must hold the same number of rows."
        )
    this = ElementSpec(treedef, tuple(a.shape[1:] for a in arrays),
                       tuple(a.dtype for a in arrays))
    if spec is not None and this != spec:
        raise ValueError(
            f"{where}: the element's structure, per-row shapes or dtypes changed. Expected "
            f"{_describe(spec)}, got {_describe(this)}. Every element must match the first."
        )
    return arrays, this


def _leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) or "<root>"
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _describe(spec: ElementSpec) -> str:
    leaves = ", ".join(f"{d}{list(s)}" for s, d in zip(spec.row_shapes, spec.dtypes, strict=True))
    return f"{spec.treedef} with rows [{leaves}]"


@dataclass(frozen=True)
class Step:
    """One step of this host's input, padded.

    Attributes:
      leaves: per leaf, ``(local_replicas, rows, *row_shape)``; rows past ``counts``
        are zeros.
      counts: real rows of each local replica, shape ``(local_replicas,)``.
      position: the input position the next step starts at (JSON), when the
        dataset's iterator tells it.
    """

    leaves: list[np.ndarray]
    counts: np.ndarray
    position: Any = None


def empty_step(spec: ElementSpec, rows: int, num_replicas: int) -> Step:
    """A step of zeros with no real rows, to fill in."""
    leaves = [np.zeros((num_replicas, rows, *s), d) for s, d in zip(spec.row_shapes,
                                                                    spec.dtypes, strict=True)]
    return Step(leaves, np.zeros(num_replicas, np.int32))


class HostFeed(Protocol):
    """Host-local input, one step at a time, for this host's replicas."""

    @property
    def rows_per_replica(self) -> int:
        """The padded per-replica batch size (static for the whole dataset)."""

    @property
    def spec(self) -> ElementSpec: ...

    def next_step(self) -> Step | None:
        """The local replicas' padded rows for the next step, or ``None`` at the end."""

    def batch_of_record(self) -> dict[str, int]:
        """The batch size a feed resumed from a step's position must keep (the rows
        left in its first element are not that size), as the position's keys."""


def position_of(elements: Iterator[Any]) -> Any:
    """Where ``elements`` will read next, if its iterator says (else ``None``)."""
    position = getattr(elements, "position", None)
    return position() if callable(position) else None


class RowStream:
    """The rows of a stream of batched elements, taken ``n`` at a time."""

    def __init__(self, elements: Iterator[Any], where: str) -> None:
        self._elements = elements
        self._where = where
        self._current: list[np.ndarray] | None = None
        self._offset = 0
        self._current_at: Any = None  # where the current element was read from
        self.spec: ElementSpec | None = None
        self.exhausted = False

    def position_after(self, n: int) -> Any:
        """Where the row ``n`` rows past the next one is, without reading on: an
        element's position with the rows of it to skip (``None`` when the elements'
        iterator does not say)."""
        if self._current is not None:
            left = self._current[0].shape[0] - self._offset
            if n < left:
                return None if self._current_at is None else {**self._current_at,
                                                              "rows": self._offset + n}
            n -= left
        at = position_of(self._elements)
        return None if at is None else {**at, "rows": n}

    def peek_rows(self) -> int | None:
        """Rows in the first element (its batch size), or ``None`` if there is none."""
        if self._current is None and not self._advance():
            return None
        assert self._current is not None
        return int(self._current[0].shape[0])

    def has_rows(self) -> bool:
        """Whether any row is left (reads the next element if the current one is done)."""
        return self._current is not None or self._advance()

    def skip(self, n: int) -> int:
        """Drops up to ``n`` rows without copying them; returns how many."""
        done = 0
        while done < n and self.has_rows():
            assert self._current is not None
            k = min(n - done, self._current[0].shape[0] - self._offset)
            self._offset += k
            done += k
            if self._offset == self._current[0].shape[0]:
                self._current = None
        return done

    def _advance(self) -> bool:
        while True:
            self._current_at = position_of(self._elements)
            element = next(self._elements, _END)
            if element is _END:
                break
            arrays, self.spec = flatten_element(element, self._where, self.spec)
            if arrays[0].shape[0]:
                self._current, self._offset = arrays, 0
                return True
        self.exhausted = True
        self._current = None
        return False

    def take_aligned(self, replicas: int, rows: int) -> list[np.ndarray] | None:
        """``replicas * rows`` rows as ``(replicas, rows, ...)`` views, if the current
        element holds them all; ``None`` otherwise (then use :meth:`take_into`).

        The views alias the dataset's arrays: copy them before taking more rows.
        """
        if self._current is None and not self._advance():
            return None
        assert self._current is not None
        n = replicas * rows
        if self._current[0].shape[0] - self._offset < n:
            return None
        block = [a[self._offset:self._offset + n].reshape(replicas, rows, *a.shape[1:])
                 for a in self._current]
        self._offset += n
        if self._offset == self._current[0].shape[0]:
            self._current = None
        return block

    def take_into(self, out: list[np.ndarray], replica: int, n: int) -> int:
        """Copies up to ``n`` rows into ``out[leaf][replica]``; returns how many.

        Rows are copied before the stream advances, so a dataset that refills and
        re-yields one buffer is read correctly. Fewer than ``n`` only at the end.
        """
        done = 0
        while done < n and not self.exhausted:
            if self._current is None and not self._advance():
                break
            assert self._current is not None
            k = min(n - done, self._current[0].shape[0] - self._offset)
            for buf, a in zip(out, self._current, strict=True):
                buf[replica, done:done + k] = a[self._offset:self._offset + k]
            self._offset += k
            done += k
            if self._offset == self._current[0].shape[0]:
                self._current = None
        return done


class RebatchFeed:
    """``experimental_distribute_dataset``: this host's replicas' rows of each global batch.

    Every host reads the whole dataset (the same rows in the same order) and keeps only
    its replicas' share of each global batch (see :meth:`HostReplicas.split`), so all
    hosts see the same number of steps: a step exists while the stream has a row left
    at its start, whether or not this host's replicas get any of them.
    """

    _WHERE = "experimental_distribute_dataset"

    def __init__(self, dataset: Iterable[Any], options: InputOptions,
                 replicas: HostReplicas) -> None:
        elements = iter(dataset)
        self._stream = RowStream(elements, self._WHERE)
        resumed = getattr(elements, "global_batch", None)  # the original run's
        first = self._stream.peek_rows()
        global_batch = options.global_batch_size or resumed or first
        if global_batch is None:
            raise ValueError(
                f"{self._WHERE}: the dataset is empty, so its global batch size cannot be "
                "inferred. Pass options=jaxpod.InputOptions(global_batch_size=...) or a "
                "non-empty dataset."
            )
        self._split = replicas.split(global_batch, options.auto_shard_policy)
        self._count = replicas.count
        # Other hosts' rows after ours, dropped only when the next step starts: the
        # previous step may still alias the current element (see next_step). A resumed
        # input first drops the rows of its first element the checkpointed steps took.
        self._rows_to_skip = int(getattr(elements, "skip_rows", 0))
        self.global_batch_size = global_batch

    @property
    def rows_per_replica(self) -> int:
        return self._split.rows_per_replica

    def batch_of_record(self) -> dict[str, int]:
        return {"batch": self.global_batch_size}

    @property
    def spec(self) -> ElementSpec:
        if self._stream.spec is None:
            raise ValueError(f"{self._WHERE}: the dataset is empty.")
        return self._stream.spec

    def next_step(self) -> Step | None:
        self._stream.skip(self._rows_to_skip)
        if not self._stream.has_rows():
            return None
        split = self._split
        self._stream.skip(split.offset)
        self._rows_to_skip = split.rows_after
        if split.full:  # every minibatch is full-size: try a zero-copy view of the rows
            # The views stay valid until the stream moves on, which is after the
            # infeed copied this step (a dataset may refill one buffer in place).
            block = self._stream.take_aligned(self._count, split.rows_per_replica)
            if block is not None:
                return Step(block, np.full(self._count, split.rows_per_replica, np.int32),
                            self._stream.position_after(self._rows_to_skip))
        step = empty_step(self.spec, split.rows_per_replica, self._count)
        for r, size in enumerate(split.sizes):
            step.counts[r] = self._stream.take_into(step.leaves, r, size)
        return Step(step.leaves, step.counts, self._stream.position_after(self._rows_to_skip))


class FunctionFeed:
    """``distribute_datasets_from_function``: one element per local replica per step."""

    _WHERE = "distribute_datasets_from_function"

    def __init__(self, dataset: Iterable[Any], replicas_per_host: int) -> None:
        self._elements = iter(dataset)
        self._replicas = replicas_per_host
        self._spec: ElementSpec | None = None
        self._rows: int | None = None
        self._pending: list[np.ndarray] | None = None
        self._pending_at: Any = None  # where the pending element was read from
        self._exhausted = False
        # A resumed input keeps the original run's per-replica batch.
        self._rows = getattr(self._elements, "replica_batch", None)
        self._pending = self._pull()

    def _pull(self) -> list[np.ndarray] | None:
        self._pending_at = position_of(self._elements)
        element = next(self._elements, _END)
        if element is _END:
            self._exhausted = True
            return None
        arrays, self._spec = flatten_element(element, self._WHERE, self._spec)
        rows = int(arrays[0].shape[0])
        if self._rows is None:
            self._rows = rows
        elif rows > self._rows:
            raise ValueError(
                f"{self._WHERE}: an element has {rows} rows but the first had {self._rows}; "
                "the first element fixes the per-replica batch size and later ones may "
                "only be shorter (a partial last batch)."
            )
        return arrays

    @property
    def rows_per_replica(self) -> int:
        if self._rows is None:
            raise ValueError(f"{self._WHERE}: dataset_fn returned an empty dataset on this host.")
        return self._rows

    def batch_of_record(self) -> dict[str, int]:
        return {"replica_batch": self.rows_per_replica}

    @property
    def spec(self) -> ElementSpec:
        if self._spec is None:
            raise ValueError(f"{self._WHERE}: dataset_fn returned an empty dataset on this host.")
        return self._spec

    def next_step(self) -> Step | None:
        if self._pending is None:
            return None
        step = empty_step(self.spec, self.rows_per_replica, self._replicas)
        for r in range(self._replicas):
            if self._pending is None:
                break
            k = step.counts[r] = self._pending[0].shape[0]
            for buf, leaf in zip(step.leaves, self._pending, strict=True):
                buf[r, :k] = leaf
            self._pending = self._pull()  # only after copying: the buffer may be reused
        return Step(step.leaves, step.counts, self._pending_at)  # the next step: pending


_END = object()


class ChunkBuilder:
    """Copies steps, as they arrive, into ``(replicas, num_steps, rows, ...)`` arrays.

    Copying each step at once (rather than stacking at the end) reads datasets that
    refill one buffer correctly and copies every row exactly once.
    """

    def __init__(self, spec: ElementSpec, rows: int, num_replicas: int, num_steps: int) -> None:
        self.leaves = [np.zeros((num_replicas, num_steps, rows, *s), d)
                       for s, d in zip(spec.row_shapes, spec.dtypes, strict=True)]
        self.counts = np.zeros((num_replicas, num_steps), np.int32)
        self.positions: list[Any] = []
        self.num_added = 0

    def add(self, step: Step) -> None:
        i = self.num_added
        for buf, leaf in zip(self.leaves, step.leaves, strict=True):
            buf[:, i] = leaf
        self.counts[:, i] = step.counts
        self.positions.append(step.position)
        self.num_added += 1
