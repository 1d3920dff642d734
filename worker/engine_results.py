"""Cross-replica results: ``reduce``, ``gather`` and ``experimental_local_results``.

Per-replica values leave the devices here: reduced across replicas (padding rows of
a partial batch never count), concatenated along an axis, or as this host's replicas'
components; and, for the hosts' operations, a gather's parts one host holds, padded
components and one replica's value (``strategy.extended``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxpod.types import ReduceOp
from jaxpod.values import PerReplica, is_per_replica
from jaxpod.worker.engine_core import ARRAY_TYPES, EngineCore, host_readable
from jaxpod.worker.replica_context import normalize_axis

_NP_REDUCERS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.sum, ReduceOp.MEAN: np.mean, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max}


def fetch_global(array: jax.Array) -> np.ndarray:
    """A global array as numpy on this host (small values: outputs). Every host of a
    multi-host array takes part."""
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


class CrossReplicaResults(EngineCore):
    """The engine's ``reduce``, ``gather`` and ``experimental_local_results``, and the
    parts of them the hosts' operations read (a part of
    :class:`~jaxpod.worker.engine.Engine`)."""

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces across replicas (and along ``axis`` if given); numpy results.

        With ``axis`` the reduction also runs along that axis of each replica's value;
        ``MEAN`` then divides by the true number of elements, so padding rows of a
        partial last batch never count.
        """
        op = ReduceOp.from_value(reduce_op)
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise ValueError(f"reduce: axis must be an int or None. Got {axis!r}.")

        def leaf(v: Any) -> np.ndarray:
            if self._is_global_array(v):  # one value, no replicas: see ops.Reduce
                data = fetch_global(v)
                return data if axis is None else np.asarray(_NP_REDUCERS[op](data, axis=axis))
            return self._reduce_leaf(op, self._as_per_replica("reduce", v), axis)

        return jax.tree.map(leaf, value, is_leaf=is_per_replica)

    def _is_global_array(self, value: Any) -> bool:
        """Whether ``value`` is a global ``jax.Array`` (what ``strategy.spmd`` and a
        global-view job give): laid over a mesh of its own, not this strategy's
        replicas' (whose arrays are per-replica or mirrored values)."""
        return (isinstance(value, jax.Array)
                and isinstance(value.sharding, NamedSharding)
                and value.sharding.mesh != self.mesh)

    def _reduce_leaf(self, op: ReduceOp, value: PerReplica, axis: int | None) -> np.ndarray:
        array, valid = value.array, value.padding
        if axis is None:
            array = self._drop_equal_padding("reduce with axis=None", value)
            reducer = self._cached(("reduce", op, None), lambda: self._reducer(op, None))
            return self._fetch_replicated(reducer(array))
        ax = normalize_axis(axis, array.ndim - 1, "reduce")
        if valid is not None and ax == 0:
            reducer = self._cached(("reduce_rows", op), lambda: self._row_reducer(op))
            counts = jax.device_put(valid.astype(np.int32), self._replicated)
            return self._fetch_replicated(reducer(array, counts))
        array = self._drop_equal_padding(f"reduce with axis={axis}", value)
        reducer = self._cached(("reduce", op, ax), lambda: self._reducer(op, ax))
        return self._fetch_replicated(reducer(array))

    def _reducer(self, op: ReduceOp, axis: int | None) -> Callable[..., Any]:
        axes = (0,) if axis is None else (0, axis + 1)
        fns: dict[ReduceOp, Callable[..., Any]] = {
            ReduceOp.SUM: jnp.sum, ReduceOp.MEAN: jnp.mean, ReduceOp.MIN: jnp.min,
            ReduceOp.MAX: jnp.max}
        return jax.jit(functools.partial(fns[op], axis=axes), out_shardings=self._replicated)

    def _row_reducer(self, op: ReduceOp) -> Callable[..., Any]:
        def reduce_rows(x: jax.Array, counts: jax.Array) -> jax.Array:
            mask = jnp.arange(x.shape[1])[None, :] < counts[:, None]
            mask = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
            if op in (ReduceOp.SUM, ReduceOp.MEAN):
                total = jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), axis=(0, 1))
                if op is ReduceOp.SUM:
                    return total
                return total / jnp.sum(counts)
            identity = _extreme_identity(x.dtype, op is ReduceOp.MAX)
            masked = jnp.where(mask, x, identity)
            return jnp.max(masked, axis=(0, 1)) if op is ReduceOp.MAX else jnp.min(
                masked, axis=(0, 1))

        return jax.jit(reduce_rows, out_shardings=self._replicated)

    def _drop_equal_padding(self, what: str, value: PerReplica) -> jax.Array:
        """Per-replica values without padding rows, if every replica has as many."""
        valid = value.padding
        if valid is None:
            return value.array
        if np.all(valid == valid[0]):
            n = int(valid[0])
            return self._cached(("rows", n), lambda: jax.jit(
                lambda x: x[:, :n], out_shardings=self._replica_sharding))(value.array)
        raise ValueError(
            f"{what}: the value holds rows of a partial batch and its replicas have "
            f"different numbers of real rows ({valid.tolist()}), so they cannot be combined "
            "elementwise. Reduce along the batch axis instead (axis=0)."
        )

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along ``axis``; padding rows are dropped."""
        def leaf(v: Any) -> np.ndarray:
            if self._is_global_array(v):
                raise TypeError(
                    f"gather: got a global array of shape {tuple(v.shape)} (a result of "
                    "strategy.spmd or a global-view job): it has no replicas to gather. "
                    "np.asarray(value) gives it whole.")
            return self._gather_leaf(self._as_per_replica("gather", v), axis)

        return jax.tree.map(leaf, value, is_leaf=is_per_replica)

    def _gather_parts(self, value: PerReplica, axis: int, replicas: Sequence[int] | None = None,
                     views: bool = False, padded: bool = False
                     ) -> tuple[int, list[np.ndarray]]:
        """This host's share of ``gather``: the normalized axis and its replicas' parts.

        A multi-host caller concatenates every host's parts in replica order, so no
        single host holds the whole result.

        Args:
          replicas: only these replicas' parts (those held here), so a caller can
            fetch a large result one part at a time.
          views: a part held whole by one device may be a read-only view of its
            memory (no copy; valid while ``value`` lives), for a caller that copies
            the parts at once.
          padded: each replica's whole component, padding rows included (``axis`` 0:
            the parts of ``value.array``).
        """
        value = self._as_per_replica("gather", value)
        ax = normalize_axis(axis, len(value.shape), "gather")
        if padded:
            return ax, self._local_leaf(value, padded=True, replicas=replicas, views=views)
        valid = value.padding
        if valid is not None and ax != 0 and not np.all(valid == valid[0]):
            self._drop_equal_padding(f"gather with axis={axis}", value)  # raises
        return ax, self._local_leaf(value, replicas=replicas, views=views)

    def _gather_leaf(self, value: PerReplica, axis: int) -> np.ndarray:
        ax = normalize_axis(axis, len(value.shape), "gather")
        valid = value.padding
        if valid is not None and ax != 0:
            array = self._drop_equal_padding(f"gather with axis={axis}", value)
            valid = None
        else:
            array = value.array
        array, readable = host_readable(array)
        host = self._fetch_all(array)
        parts = [host[r] if valid is None else host[r, :valid[r]] for r in range(len(host))]
        return readable(np.concatenate(parts, axis=ax))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This host's replicas' values as a tuple (numpy), padding rows dropped."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        if not any(isinstance(v, PerReplica) for v in leaves):
            return (value,)  # a single value (TF: "this returns (value,)")
        per_leaf = [self._local_leaf(self._as_per_replica("experimental_local_results", v))
                    for v in leaves]
        return tuple(jax.tree.unflatten(treedef, [p[i] for p in per_leaf])
                     for i in range(self._num_local_replicas))

    def _replica_value(self, value: Any, replica: int) -> Any | None:
        """Replica ``replica``'s component of every ``PerReplica`` leaf of ``value``
        (numpy, padding dropped; other leaves as they are), or ``None`` when this host
        does not hold that replica: one copy of mirrored state, not one per replica."""
        if replica not in self.local_replicas:
            return None
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        return jax.tree.unflatten(treedef, [
            self._local_leaf(self._as_per_replica("replica_value", v), replicas=(replica,))[0]
            if isinstance(v, PerReplica) else v for v in leaves])

    def _local_leaf(self, value: PerReplica, padded: bool = False,
                    replicas: Sequence[int] | None = None, views: bool = False
                    ) -> list[np.ndarray]:
        """This host's replicas' components (of ``replicas`` only, if given), assembled
        from their devices' shards (with ``views``, a component one shard holds whole
        is that shard's host view, not a copy)."""
        wanted = [r for r in self.local_replicas if replicas is None or r in replicas]
        array, readable = host_readable(value.array)
        shape = tuple(array.shape[1:])  # a key's data has one more axis than the key
        local: dict[int, np.ndarray] = {}
        for shard in array.addressable_shards:
            replica = shard.index[0].start or 0
            if replica not in wanted:
                continue
            data = np.asarray(shard.data)[0]
            if views and data.shape == shape:
                local[replica] = data  # one device holds the whole component
            else:  # a replica split over logical devices has several shards
                local.setdefault(replica, np.empty(shape, array.dtype))[
                    shard.index[1:]] = data
        valid = None if padded else value.padding
        return [readable(local[r] if valid is None else local[r][:valid[r]]) for r in wanted]

    def _padded_parts(self, value: PerReplica) -> list[np.ndarray]:
        """This host's replicas' components with their padding rows (``value.array``'s
        share of this host), for a caller that stacks every host's parts."""
        return self._local_leaf(self._as_per_replica("fetch", value), padded=True)

    def _as_per_replica(self, what: str, value: Any) -> PerReplica:
        if isinstance(value, PerReplica):
            self._check_own(what, "value", value)
            return value
        if isinstance(value, ARRAY_TYPES):  # a mirrored value: every replica holds it
            return PerReplica(self._broadcast(value))
        raise TypeError(
            f"{what}: expected a PerReplica value (an output of strategy.run) or an array, "
            f"got {type(value).__name__}."
        )

    def _fetch_all(self, array: jax.Array) -> np.ndarray:
        """Every replica's component on this host, as numpy."""
        if array.is_fully_addressable:
            return np.asarray(array)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def _fetch_replicated(self, array: jax.Array) -> np.ndarray:
        return np.asarray(array.addressable_data(0))


def _extreme_identity(dtype: Any, is_max: bool) -> Any:
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf if is_max else jnp.inf, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.array(info.min if is_max else info.max, dtype)
    return jnp.array(not is_max, dtype)
