"""A held slice: its replica group's engine and the objects a session made on it.

An acquired slice is what a session (or a job) holds: the strategy methods over its
replica group (:class:`~jaxpod.service.slices.group_engine.GroupEngine`), how to give it
back, and the values, datasets and iterators made on it, by the ids the client gave
them. It also keeps the client's operation stream's progress on it, so a call that
must follow a stream operation waits until that operation was applied.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from jaxpod import settings
from jaxpod.errors import DeadlineExceededError, DependencyFailedError, HandleError
from jaxpod.operations import Dropped, op_of
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.group_handles import GroupDataset, GroupIterator, GroupValue
from jaxpod.service.slices.profiles import SliceProfiler

#: How long a call that follows a stream operation waits for a stream to bring it.
STREAM_JOIN_GRACE = settings.STREAM_JOIN_GRACE
#: Failed operations a slice remembers, to say why a later one using their outputs
#: was not run.
MAX_FAILED_OPS = 4096


@dataclass(eq=False)
class HeldSlice:
    """One acquired slice: its allocation, replica group and the objects on it.

    Attributes:
      id: the slice's id within the service.
      engine: the strategy methods over the slice's replica group.
      release: stops the workers and gives the slice back (idempotent).
      description: accelerator type, hosts and slice names, for status replies.
    """

    id: str
    engine: GroupEngine
    release: Callable[[], None]
    description: dict[str, Any]
    values: dict[int, GroupValue] = field(default_factory=dict)
    datasets: dict[int, GroupDataset] = field(default_factory=dict)
    iterators: dict[int, GroupIterator] = field(default_factory=dict)
    #: Numbers of the stream's operations that failed (their outputs never existed),
    #: the most recent ``MAX_FAILED_OPS``.
    failed_ops: collections.OrderedDict[int, None] = field(
        default_factory=collections.OrderedDict)
    #: The stream's progress: the last operation received and applied, and the
    #: streams open; ``progress`` is notified as they change.
    received_op: int = 0
    applied_op: int = 0
    open_streams: int = 0
    progress: threading.Condition = field(default_factory=threading.Condition)
    #: Its ``strategy.profile`` traces (made on the first).
    profiler: SliceProfiler | None = None

    def wait_applied(self, op: int, timeout_s: float) -> None:
        """Waits until the stream has applied operation ``op``.

        Raises:
          HandleError: ``op`` never reached the service and no stream is open to bring it.
          DeadlineExceededError: it did not apply within ``timeout_s``.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        with self.progress:
            while self.applied_op < op:
                # A stream's first message may arrive after the call that follows it.
                if self.received_op < op and self.open_streams == 0 and \
                        time.monotonic() - start > STREAM_JOIN_GRACE.seconds():
                    raise HandleError(
                        f"Operation #{op} on slice {self.id} never reached the service "
                        "(its stream ended first), so this call cannot follow it. Call "
                        "again.")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(
                        f"Operation #{op} on slice {self.id} was not applied within "
                        f"{timeout_s:g}s; this call waits for it.")
                self.progress.wait(min(left, 0.5) if self.open_streams == 0 else left)

    def advanced(self, *, received: int = 0, applied: int = 0, streams: int = 0) -> None:
        with self.progress:
            self.received_op = max(self.received_op, received)
            self.applied_op = max(self.applied_op, applied)
            self.open_streams += streams
            self.progress.notify_all()

    def value(self, value_id: int) -> GroupValue:
        try:
            return self.values[value_id]
        except KeyError:
            op = op_of(value_id)
            if op in self.failed_ops:
                raise DependencyFailedError(
                    f"Not run: it uses value #{value_id}, an output of operation #{op} "
                    "on this slice, which failed.", op) from None
        return _lookup(self.values, value_id, "Value", self.id,
                       " Use values returned by this strategy while it is open.")

    def failed(self, op: int) -> None:
        self.failed_ops[op] = None
        if len(self.failed_ops) > MAX_FAILED_OPS:
            self.failed_ops.popitem(last=False)

    def dataset(self, dataset_id: int) -> GroupDataset:
        return _lookup(self.datasets, dataset_id, "Dataset", self.id)

    def iterator(self, iterator_id: int) -> GroupIterator:
        return _lookup(self.iterators, iterator_id, "Iterator", self.id)

    def keep_values(self, values: dict[int, GroupValue]) -> None:
        """Keeps new values by the ids the client gave them; an id in use is refused
        before any is kept."""
        self.check_new_ids(values.keys())
        self.values.update(values)

    def check_new_ids(self, ids: Iterable[int]) -> None:
        """Refuses ids for new values that name values already held."""
        taken = self.values.keys() & set(ids)
        if taken:
            raise HandleError(f"Value ids {sorted(taken)[:5]} are already in use on slice "
                              f"{self.id}: each operation number may be used once.")

    def drop(self, dropped: Dropped) -> None:
        """Forgets what the client dropped; the workers free it with the slice's next
        operation. Unknown ids are ignored: dropping is idempotent."""
        for value_id in dropped.values:
            self.values.pop(value_id, None)
        for iterator_id in dropped.iterators:
            self.iterators.pop(iterator_id, None)
        for dataset_id in dropped.datasets:
            dataset = self.datasets.pop(dataset_id, None)
            if dataset is not None:
                dataset.free()


def _lookup(table: dict[int, Any], key: int, what: str, slice_id: str,
            advice: str = "") -> Any:
    try:
        return table[key]
    except KeyError:
        raise HandleError(f"{what} #{key} is not held on slice {slice_id}: it was freed, or "
                          f"it belongs to another strategy.{advice}") from None
