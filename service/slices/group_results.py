"""The result methods of a :class:`~jaxpod.service.slices.group_engine.GroupEngine`:
its values brought back as numpy.

A small result comes from one operation (a :class:`ResultCall`: reductions from host 0
only, gathers and local results as each host's own replicas' parts, joined here in
replica order). A large one travels in blocks of at most ``JAXPOD_RESULT_BLOCK_BYTES``
of its rows (:meth:`GroupResults.gather_parts`, ``fetch_parts``,
``local_results_parts``), one operation each, the next fetched while the caller reads
the current one.
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

from jaxpod import operations as ops
from jaxpod import settings
from jaxpod.pieces import PieceLayout, Pieces
from jaxpod.service.slices.group_handles import GroupValue, is_group_value
from jaxpod.types import ReduceOp

_R = TypeVar("_R")
#: The most bytes of a large result fetched from the workers in one operation: a
#: caller that streams it holds the block it sends and the one fetched ahead.
RESULT_BLOCK = settings.RESULT_BLOCK_BYTES


@dataclass(frozen=True)
class GatherParts:
    """One gathered leaf: the replicas' parts in replica order, the axis to join them
    on, and the joined result's shape and dtype.

    ``parts`` may be fetched lazily, one replica ahead of its reader, and come as
    ``Pieces`` (see :meth:`GroupEngine.gather_parts`): iterate it once.
    """

    axis: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    parts: Iterable[np.ndarray | Pieces]

    def join(self) -> np.ndarray:
        return np.concatenate(list(self.parts), axis=self.axis)


@dataclass(frozen=True)
class ResultCall:
    """A result that one operation computes: the operation, and the result from
    every host's answer."""

    operation: ops.Operation[Any]
    answer: Callable[[list[Any]], Any]


def first_host(per_host: list[Any]) -> Any:
    """The answer of host 0 (where every host answers the same)."""
    return per_host[0]


class GroupResults(abc.ABC):
    """``reduce``, ``gather``, ``fetch`` and local results over a group's workers, as
    one operation each or in blocks; the engine gives them its calls."""

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """The replicas of the group's values."""

    @abc.abstractmethod
    def _call(self, op: ops.Operation[_R], layout: PieceLayout | None = None,
              timeout: float | None = None) -> list[_R]:
        """Runs ``op`` on every host: each one's result, in host order."""

    @abc.abstractmethod
    def handles(self, tree: Any) -> Any:
        """``tree`` with each of this group's values as its handle."""

    # ------------------------------------------------------------------- results
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        return self.answer(self.reduce_call(reduce_op, value, axis))

    def reduce_call(self, reduce_op: ReduceOp | str, value: Any, axis: int | None
                    ) -> ResultCall:
        """:meth:`reduce` as one operation: its result is host 0's."""
        return ResultCall(ops.Reduce(reduce_op, self.handles(value), axis), first_host)

    def answer(self, call: ResultCall) -> Any:
        """Runs ``call``: its result."""
        return call.answer(self._call(call.operation))

    def gather(self, value: Any, axis: int) -> Any:
        return jax.tree.map(lambda v: self.answer(self._gather_leaf(v, axis)), value,
                            is_leaf=is_group_value)

    def gather_call(self, value: Any, axis: int) -> ResultCall | None:
        """:meth:`gather` as one operation, for a value of one leaf (``None``: it has
        more, one operation each)."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_group_value)
        if len(leaves) != 1 or not is_group_value(leaves[0]):
            return None
        call = self._gather_leaf(leaves[0], axis)
        return ResultCall(call.operation, lambda per_host: jax.tree.unflatten(
            treedef, [call.answer(per_host)]))

    def _gather_leaf(self, v: Any, axis: int) -> ResultCall:
        def joined(per_host: list[Any]) -> np.ndarray:  # every part in one operation
            return np.concatenate([p for _, parts in per_host for p in parts],
                                  axis=per_host[0][0])

        return ResultCall(ops.GatherParts(self.handles(v), axis, None, streamed=False),
                          joined)

    def _gather_call(self, v: Any, axis: int, replicas: tuple[int, ...] | None = None,
                     layout: PieceLayout | None = None, rows: tuple[int, int] | None = None,
                     padded: bool = False) -> tuple[int, list[Any]]:
        """One ``gather_parts`` operation: the normalized axis, every host's parts."""
        op = ops.GatherParts(self.handles(v), axis, replicas,
                             streamed=layout is not None, rows=rows, padded=padded)
        per_host = self._call(op, layout)
        return per_host[0][0], [p for _, parts in per_host for p in parts]

    def gather_parts(self, value: Any, axis: int, layout: PieceLayout | None = None) -> Any:
        """``gather``'s result per leaf as blocks of its rows, not yet joined: a caller
        that streams them never holds the joined copy, nor more than two blocks of
        ``JAXPOD_RESULT_BLOCK_BYTES`` (one operation each, the next fetched while the
        caller reads the current one). With a ``layout``, blocks of rows a replica holds come as
        ``Pieces`` cut that way (views of the workers' device memory, copied once,
        into the pieces), ready to forward. Small leaves come in one operation.
        """
        def leaf(v: Any) -> GatherParts:
            n = self.num_replicas_in_sync
            big = isinstance(v, GroupValue) and n * _nbytes(v) > RESULT_BLOCK.value()
            if isinstance(v, GroupValue) and not v.info.global_view and v.shape \
                    and -len(v.shape) <= axis < len(v.shape) and (n > 1 or big):
                ax = axis % len(v.shape)
                rows = v.info.valid_rows or (v.shape[0],) * n
                if ax == 0:  # each replica's rows in turn, streamed as they come
                    spans = [(r, a, b) for r in range(n) for a, b in _spans(rows[r], v)]
                    return GatherParts(0, (sum(rows), *v.shape[1:]), v.dtype, _fetched_ahead(
                        lambda s: self._gather_call(v, 0, (s[0],), layout, s[1:])[1][0],
                        spans or [(0, 0, 0)]))
                if big and len(set(rows)) == 1:  # each row of the result spans replicas
                    shape = (rows[0], *v.shape[1:ax], v.shape[ax] * n, *v.shape[ax + 1:])
                    return GatherParts(0, shape, v.dtype, _fetched_ahead(
                        lambda span: np.concatenate(
                            self._gather_call(v, ax, rows=span)[1], axis=ax),
                        _spans(rows[0], v, n) or [(0, 0)]))
            ax, parts = self._gather_call(v, axis)
            joined = list(parts[0].shape)
            joined[ax] = sum(p.shape[ax] for p in parts)
            return GatherParts(ax, tuple(joined), parts[0].dtype, parts)

        return jax.tree.map(leaf, value, is_leaf=is_group_value)

    def fetch(self, value: GroupValue) -> np.ndarray:
        """Every replica's padded component, stacked: ``PerReplica.array`` as numpy (a
        global value: the whole array, put together from each host's shards)."""
        return self.answer(self.fetch_call(value))

    def fetch_call(self, value: GroupValue) -> ResultCall:
        """:meth:`fetch` as one operation."""
        if not value.info.global_view:
            return ResultCall(ops.FetchParts(self.handles(value)), lambda per_host: np.stack(
                [p for parts in per_host for p in parts]))
        return ResultCall(ops.FetchShards(self.handles(value)),
                          lambda per_host: _assembled(value, per_host, None))

    def fetch_parts(self, value: GroupValue, layout: PieceLayout | None = None
                    ) -> GatherParts:
        """:meth:`fetch`'s result as blocks of its rows (see :meth:`gather_parts`): a
        per-replica value's padded components one after another, a global value's
        rows assembled block by block from the shards holding them."""
        if _nbytes(value) * (1 if value.info.global_view else self.num_replicas_in_sync) \
                <= RESULT_BLOCK.value() or not value.shape:
            whole = self.fetch(value)
            return GatherParts(0, whole.shape, whole.dtype, (whole,))
        if value.info.global_view:
            return GatherParts(0, value.shape, value.dtype, _fetched_ahead(
                lambda span: _assembled(value, self._call(
                    ops.FetchShards(self.handles(value), span)), span),
                _spans(value.shape[0], value)))
        n = self.num_replicas_in_sync
        spans = [(r, a, b) for r in range(n) for a, b in _spans(value.shape[0], value)]
        return GatherParts(0, (n, *value.shape), value.dtype, _fetched_ahead(
            lambda s: self._gather_call(value, 0, (s[0],), layout, s[1:], padded=True)[1][0],
            spans))

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """Each replica's value, padding dropped (the strategy's local results)."""
        results: tuple[Any, ...] = self.answer(self.local_results_call(value))
        return results

    def local_results_call(self, value: Any) -> ResultCall:
        """:meth:`local_results` as one operation."""
        op = ops.LocalResults(self.handles(value))
        return ResultCall(op, op.combine)

    def _replica_rows(self, v: GroupValue, replica: int, layout: PieceLayout | None,
                      rows: tuple[int, int]) -> Any:
        """Rows ``rows`` of replica ``replica``'s component of ``v`` (padding dropped)."""
        return self._gather_call(v, 0, (replica,), layout, rows)[1][0]

    def local_results_parts(self, value: Any, layout: PieceLayout | None = None
                            ) -> tuple[Any, ...]:
        """:meth:`local_results` with each large leaf's components as
        blocks of rows (``GatherParts``, see :meth:`gather_parts`); the small leaves
        come in one operation."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_group_value)
        big = [i for i, v in enumerate(leaves) if isinstance(v, GroupValue)
               and not v.info.global_view and v.shape
               and _nbytes(v) * self.num_replicas_in_sync > RESULT_BLOCK.value()]
        if not big:
            return self.local_results(value)
        n = self.num_replicas_in_sync
        small = [v for i, v in enumerate(leaves) if i not in big]
        per_replica = ([list(r) for r in self.local_results(small)] if small
                       else [[] for _ in range(n)])
        out = []
        for r in range(n):
            rest = iter(per_replica[r])
            row = []
            for i, v in enumerate(leaves):
                if i not in big:
                    row.append(next(rest))
                    continue
                rows = (v.info.valid_rows or (v.shape[0],) * n)[r]
                block = functools.partial(self._replica_rows, v, r, layout)
                row.append(GatherParts(0, (rows, *v.shape[1:]), v.dtype,
                                       _fetched_ahead(block, _spans(rows, v) or [(0, 0)])))
            out.append(jax.tree.unflatten(treedef, row))
        return tuple(out)

    def replica_value(self, value: Any, replica: int = 0) -> Any:
        """Replica ``replica``'s component of ``value``'s leaves as numpy, sent by the
        one host holding it (a mirrored state's single copy, not one per replica)."""
        if not 0 <= replica < self.num_replicas_in_sync:
            raise ValueError(f"replica_value: replica must be in [0, "
                             f"{self.num_replicas_in_sync}); got {replica}.")
        answers = self._call(ops.ReplicaValue(self.handles(value), replica))
        return next(a for a in answers if a is not None)


_Part = TypeVar("_Part")
_Span = TypeVar("_Span")


def _nbytes(v: GroupValue) -> int:
    """Bytes of one component of ``v`` (of the whole array, for a global value)."""
    return math.prod(v.shape) * v.dtype.itemsize


def _spans(rows: int, v: GroupValue, copies: int = 1) -> list[tuple[int, int]]:
    """``[0, rows)`` cut into spans of at most ``JAXPOD_RESULT_BLOCK_BYTES`` of ``v``'s
    rows (times ``copies``), at least one row each."""
    row_bytes = max(1, math.prod(v.shape[1:]) * v.dtype.itemsize * copies)
    step = max(1, RESULT_BLOCK.value() // row_bytes)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _assembled(value: GroupValue, per_host: list[Any], rows: tuple[int, int] | None
               ) -> np.ndarray:
    """A global value (rows ``rows`` only, if given) put together from each host's
    shards of it (``FetchShards``' answers)."""
    start, stop = rows if rows is not None else (0, value.shape[0] if value.shape else 0)
    shape = value.shape if not value.shape else (stop - start, *value.shape[1:])
    out = np.empty(shape, value.dtype)
    for shards in per_host:
        for index, data in shards:
            at = [slice(a, b) for a, b in index]
            if at:
                at[0] = slice(at[0].start - start, at[0].stop - start)
            out[tuple(at)] = data
    return out


def _fetched_ahead(fetch: Callable[[_Span], _Part], spans: Sequence[_Span]) -> Iterator[_Part]:
    """``fetch(s)`` for each of ``spans`` (at least one), as an iterator: the first
    fetched now (so its errors reach the caller before anything is sent), each
    following one on a helper thread while its predecessor is being read."""
    first = fetch(spans[0])
    return _ahead(first, fetch, spans[1:])


def _ahead(first: _Part, fetch: Callable[[_Span], _Part], rest: Sequence[_Span]
           ) -> Iterator[_Part]:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpod-gather")
    try:
        ahead = [pool.submit(fetch, r) for r in rest[:1]]
        yield first
        for r in rest[1:]:
            # bounded: a fetch from the hosts, under the operation time-out
            current = ahead.pop().result()
            ahead.append(pool.submit(fetch, r))
            yield current
        if ahead:
            yield ahead.pop().result()  # bounded: as above
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a cancelled reader need not wait
