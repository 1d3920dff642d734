"""What the coordinator holds of the objects on a group's workers.

A value stays on the workers as a :class:`GroupValue` (its handle's info), a function
as a :class:`DefinedFunction` (its content id), a distributed dataset and its
iterators as :class:`GroupDataset` and :class:`GroupIterator`. Dropping one here queues
it in the engine's :class:`DropQueue`, freed on the workers with the next operation.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpod import operations as ops
from jaxpod.errors import EndOfDataError
from jaxpod.operations import Dropped, HandleInfo

if TYPE_CHECKING:
    from jaxpod.service.slices.group_engine import GroupEngine


@dataclass(frozen=True, eq=False)
class GroupValue:
    """A ``PerReplica`` value held by every worker of a group (by handle id)."""

    info: HandleInfo
    group: GroupEngine

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.info.dtype)

    def __repr__(self) -> str:
        rows = "" if self.info.valid_rows is None else f", valid_rows={list(self.info.valid_rows)}"
        return f"GroupValue(id={self.info.id}, shape={self.shape}, dtype={self.dtype}{rows})"


@dataclass(frozen=True)
class DefinedFunction:
    """A function already defined on the group's workers (by content id).

    The coordinator receives functions as pickled bytes and never unpickles user code;
    it defines them once and passes this wherever a method takes a function.
    """

    id: str


def is_group_value(x: object) -> bool:
    return isinstance(x, GroupValue)


class GroupDataset:
    """A dataset distributed over a group's hosts."""

    def __init__(self, engine: GroupEngine, dataset_id: int) -> None:
        self._engine = engine
        self.id = dataset_id

    def __iter__(self) -> GroupIterator:
        return self.iterate()

    def iterate(self, steps_per_run: int | None = None) -> GroupIterator:
        """An iterator whose infeeds prepare ``steps_per_run`` steps at a time."""
        return GroupIterator(self._engine, self._engine._call(
            ops.CreateIterator(self.id, steps_per_run))[0])

    def free(self) -> None:
        """Drops the dataset on the workers with the next operation (its iterators
        keep running)."""
        self._engine.dropped.datasets.append(self.id)


class GroupIterator(Iterator[Any]):
    """An iterator whose infeed threads run on the workers."""

    def __init__(self, engine: GroupEngine, iterator_id: int) -> None:
        self._engine = engine
        self.id = iterator_id
        #: After a ``next``: the steps after it that every host has ready in full.
        self.full_steps_ahead = 0
        # Dropping the iterator stops its infeed threads on the workers.
        weakref.finalize(self, engine.dropped.iterators.append, iterator_id)

    def __next__(self) -> Any:
        try:
            replies = self._engine._call(ops.NextInput(self.id))
            self.full_steps_ahead = min(ahead for _, ahead in replies)
            return self._engine._wrap(replies[0][0])
        except EndOfDataError:
            raise
        except StopIteration as e:
            raise EndOfDataError(str(e)) from None


class DropQueue:
    """Values, iterators and datasets dropped here, freed on the workers with the next
    operation (a finalizer must not call into the group: it may run inside a call)."""

    def __init__(self) -> None:
        self.values: collections.deque[int] = collections.deque()
        self.iterators: collections.deque[int] = collections.deque()
        self.datasets: collections.deque[int] = collections.deque()

    def take(self) -> Dropped | None:
        """Empties the queue (finalizers may append meanwhile: deques are thread-safe)."""
        if not (self.values or self.iterators or self.datasets):
            return None
        return Dropped(_drain(self.values), _drain(self.iterators), _drain(self.datasets))

    def restore(self, dropped: Dropped) -> None:
        """Puts back what :meth:`take` gave, for an operation that was not sent."""
        self.values.extend(dropped.values)
        self.iterators.extend(dropped.iterators)
        self.datasets.extend(dropped.datasets)


def _drain(queue: collections.deque[int]) -> tuple[int, ...]:
    items = []
    while queue:
        items.append(queue.popleft())
    return tuple(items)
