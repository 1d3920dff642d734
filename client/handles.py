"""Handles of what a remote slice holds, as ``RemoteStrategy`` hands them out.

:class:`RemotePerReplica` and :class:`RemoteGlobalValue` stand for values kept on the
workers (bytes come back only when asked: ``.array``, ``.numpy()``);
:class:`SpmdFunction` is what ``strategy.spmd`` returns; :class:`RemoteDataset` and
:class:`RemoteIterator` are distributed input. Each handle frees its object on the
slice when garbage-collected (with the strategy's next call).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpod import trees
from jaxpod.client.templates import value_refs
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.values import DistributedDataset, DistributedIterator, PerReplica, padding_of

if TYPE_CHECKING:
    from jaxpod.client.remote import RemoteStrategy
    from jaxpod.client.slice_calls import SliceCalls


class RemotePerReplica:
    """A ``PerReplica`` value held on a remote slice.

    Same attributes as :class:`jaxpod.PerReplica`: ``shape`` and ``dtype`` of one
    replica's (padded) component, ``valid_rows``, ``num_replicas``, ``padding``, and
    ``array`` (every replica's padded component stacked, fetched on first use).
    """

    __slots__ = ("__weakref__", "_array", "_strategy", "dtype", "id", "shape", "valid_rows")

    def __init__(self, strategy: SliceCalls, ref: pb.ValueRef) -> None:
        self._strategy = strategy
        self.id = int(ref.id)
        self.shape = tuple(int(d) for d in ref.shape)
        self.dtype = _dtype(ref.dtype)
        self.valid_rows = (np.asarray(ref.valid_rows, dtype=np.int64) if ref.has_valid_rows
                           else None)
        self._array: np.ndarray | None = None
        weakref.finalize(self, strategy._release, "value_ids", self.id)

    @property
    def num_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def array(self) -> np.ndarray:
        """All replicas' padded components, stacked (shape ``(replicas, *shape)``)."""
        if self._array is None:
            self._array = self._strategy._fetch(self)
        return self._array

    @property
    def padding(self) -> np.ndarray | None:
        return padding_of(self.shape, self.valid_rows)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self!r} lives on the service and cannot be pickled into a step function. "
            "Pass it to strategy.run(fn, args=(value,)) instead of capturing it.")

    def __repr__(self) -> str:
        rows = "" if self.valid_rows is None else f", valid_rows={self.valid_rows.tolist()}"
        return (f"RemotePerReplica(id={self.id}, shape={self.shape}, dtype={self.dtype}"
                f"{rows})")


PerReplica.register(RemotePerReplica)


class RemoteGlobalValue:
    """A global ``jax.Array`` held on a remote slice: what an ``strategy.spmd``
    function returns. ``shape`` and ``dtype`` are the whole array's; ``numpy()`` (or
    ``np.asarray(value)``) fetches it. Pass it to the next spmd function as it is: it
    stays on the devices with its sharding."""

    __slots__ = ("__weakref__", "_strategy", "dtype", "id", "shape")

    def __init__(self, strategy: SliceCalls, ref: pb.ValueRef) -> None:
        self._strategy = strategy
        self.id = int(ref.id)
        self.shape = tuple(int(d) for d in ref.shape)
        self.dtype = _dtype(ref.dtype)
        weakref.finalize(self, strategy._release, "value_ids", self.id)

    def numpy(self) -> np.ndarray:
        """The whole array, fetched from the slice."""
        return self._strategy._fetch(self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self!r} lives on the service and cannot be pickled into a function. Pass "
            "it as an argument of the spmd function instead of capturing it.")

    def __repr__(self) -> str:
        return f"RemoteGlobalValue(id={self.id}, shape={self.shape}, dtype={self.dtype})"


class SpmdFunction:
    """``strategy.spmd(fn, mesh=...)``: calling it runs ``fn(*args, **kwargs)`` as one
    ``jax.jit`` program over the slice's mesh and returns :class:`RemoteGlobalValue`
    handles in ``fn``'s output structure."""

    def __init__(self, strategy: RemoteStrategy, fn: Callable[..., Any],
                 mesh: dict[str, int], batch_sharding: Any) -> None:
        self._strategy = strategy
        self.fn = fn
        self.mesh = mesh
        self.batch_sharding = batch_sharding
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._strategy._run_spmd(self, args, kwargs)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"SpmdFunction({name}, mesh={self.mesh})"


def _dtype(name: str) -> Any:
    """A value's dtype: numpy's, or the name of a JAX-only one (``key<fry>``)."""
    try:
        return tensors.dtype_from_name(name)
    except ValueError:
        return name


def handle_signature(x: RemotePerReplica | RemoteGlobalValue) -> Hashable:
    """What of a handle argument shapes a call's outputs: its kind, shape, dtype and
    valid rows (kept here: the wire carries only its id)."""
    if isinstance(x, RemoteGlobalValue):
        return ("global", x.shape, trees.dtype_name(x.dtype))
    valid = None if x.valid_rows is None else tuple(x.valid_rows.tolist())
    return ("per_replica", x.shape, trees.dtype_name(x.dtype), valid)



class RemoteDataset(DistributedDataset):
    """A dataset distributed over a remote slice's hosts; iterate it once per epoch."""

    def __init__(self, strategy: RemoteStrategy, dataset_id: int) -> None:
        self._strategy = strategy
        self.id = dataset_id
        weakref.finalize(self, strategy._release, "dataset_ids", dataset_id)

    def __iter__(self) -> RemoteIterator:
        s = self._strategy
        reply = s._call(s._stub.CreateIterator, pb.IteratorRequest(
            **s._ids(), id=self.id, steps_per_run=s.steps_per_run), "iter(dataset)")
        return RemoteIterator(s, int(reply.iterator_id))


class RemoteIterator(DistributedIterator):
    """Yields one step of input per ``next``; its infeeds run on the workers.

    ``next`` returns at once while the workers have said that the step is ready in
    full (each answer says how many full steps follow it): such a step cannot end
    the input, and its handles are those of any full step. Past that it waits for
    its answer, so the end of the input raises ``EndOfDataError`` at the ``next``
    that ran past it, as the dataset's own error does.
    """

    def __init__(self, strategy: RemoteStrategy, iterator_id: int) -> None:
        self._strategy = strategy
        self.id = iterator_id
        self._taken = 0  # steps asked for, by next and run_steps
        self._full_until = 0  # steps up to this count are known ready in full
        weakref.finalize(self, strategy._release, "iterator_ids", iterator_id)

    def __iter__(self) -> RemoteIterator:
        return self

    def __next__(self) -> Any:
        s = self._strategy  # at the end, the call raises EndOfDataError (a StopIteration)
        self._taken += 1
        step = self._taken

        def ready(reply: pb.SliceReply) -> None:  # on the stream's reader thread
            self._full_until = max(self._full_until, step + reply.full_steps_ahead)

        return s._dispatch("next", pb.IteratorRequest(**s._ids(), id=self.id),
                           "next(iterator)", ("next", self.id),
                           may_predict=step <= self._full_until, is_template=_is_full,
                           on_success=ready)

    def took(self, steps: int) -> None:
        """Counts steps that ``run_steps`` asked for (up to ``steps`` were taken)."""
        self._taken += steps


def _is_full(outputs: pb.Tree) -> bool:
    """Whether a step's input has every row of every replica (what a step that the
    workers reported ready in full looks like)."""
    return not any(ref.has_valid_rows and any(v != ref.shape[0] for v in ref.valid_rows)
                   for ref in value_refs(outputs))

