"""TF1 and TF 1.x input objects over a jaxpod strategy's distributed datasets.

``tf.distribute.InputReplicationMode``; TF1's ``distribute_dataset`` input (a no-argument
``dataset_fn``, each host keeping its replicas' share of the stream); the
``InputIterator`` of ``make_dataset_iterator`` and ``make_input_fn_iterator``; and the
dataset ``distribute_dataset`` returns. The strategy members that make them are in
:mod:`jaxpod.tf_compat`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jaxpod.types import InputContext
from jaxpod.values import DistributedDataset, DistributedIterator


class InputReplicationMode(enum.Enum):
    """``tf.distribute.InputReplicationMode``: how ``make_input_fn_iterator`` replicates
    input. As in TF, ``PER_WORKER`` (one input pipeline per host) is the only mode."""

    PER_WORKER = "PER_WORKER"


class _HostShare:
    """Host ``h``'s share of a stream where each replica takes one element per step:
    the elements of replicas ``h*k .. h*k+k-1`` of every ``R`` (``k`` replicas per
    host). Re-iterable (each epoch iterates the dataset again)."""

    def __init__(self, dataset: Iterable[Any], ctx: InputContext) -> None:
        r, hosts = ctx.num_replicas_in_sync, ctx.num_input_pipelines
        if r % hosts:
            raise ValueError(
                f"distribute_dataset: {r} replicas do not split evenly over {hosts} hosts; "
                "use distribute_datasets_from_function and shard the input yourself.")
        self._dataset, self._r, self._k = dataset, r, r // hosts
        self._host = ctx.input_pipeline_id

    def __iter__(self) -> Iterator[Any]:
        for i, element in enumerate(self._dataset):
            if (i % self._r) // self._k == self._host:
                yield element


class NoArgDatasetFn:
    """TF1's ``dataset_fn()`` as a ``distribute_datasets_from_function`` input function."""

    def __init__(self, dataset_fn: Callable[[], Iterable[Any]]) -> None:
        self.dataset_fn = dataset_fn

    def __call__(self, ctx: InputContext) -> Iterable[Any]:
        dataset = self.dataset_fn()
        if ctx.num_input_pipelines == 1:
            return dataset
        return _HostShare(dataset, ctx)


class InputIterator(DistributedIterator):
    """TF 1.x's ``InputIterator`` over a distributed dataset.

    ``next``/``get_next`` give one step of input; :meth:`initialize` starts the
    dataset over (an iterator is also started by its first ``next``).
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset = dataset
        self._iterator: Iterator[Any] | None = None

    def initialize(self) -> list[Any]:
        """Starts (or restarts) iterating the dataset from its beginning.

        Returns:
          ``[]``: TF returned the initializer ops to run; here nothing is left to run.
        """
        self._iterator = iter(self._dataset)
        return []

    @property
    def iterator(self) -> Iterator[Any]:
        """The strategy's own iterator underneath (what ``run_steps`` feeds fastest)."""
        if self._iterator is None:
            self.initialize()
        assert self._iterator is not None
        return self._iterator

    def __next__(self) -> Any:
        return next(self.iterator)


class TF1Dataset(DistributedDataset):
    """What TF1's ``distribute_dataset`` returns: iterate it, or make an iterator."""

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset = dataset

    def __iter__(self) -> DistributedIterator:
        return iter(self._dataset)

    def make_one_shot_iterator(self) -> InputIterator:
        """An iterator over one pass of the dataset."""
        return InputIterator(self._dataset)

    def make_initializable_iterator(self) -> InputIterator:
        """An iterator to :meth:`InputIterator.initialize` (it also starts on first use)."""
        return InputIterator(self._dataset)
