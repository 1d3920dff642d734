"""The replica context: what a step function sees of the other replicas.

Inside ``strategy.run(fn)`` (while ``fn`` is traced), ``jaxpod.get_replica_context()``
returns a :class:`ReplicaContext` bound to the ``"replica"`` mesh axis. Inside
``strategy.scope()`` but outside ``run`` it returns ``None`` (the cross-replica
context, as in ``tf.distribute``); anywhere else it returns a default context for a
single replica, so step functions also run undistributed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpod.scope import get_strategy
from jaxpod.types import ReduceOp

REPLICA_AXIS = "replica"


class ReplicaContext:
    """Collectives and identity of the replica that is running ``fn``.

    Attributes:
      num_replicas_in_sync: replicas taking part in every collective.
      replica_id_in_sync_group: this replica's index (a traced int32 scalar inside
        ``run``, a Python int in the default context).
    """

    def __init__(
        self,
        num_replicas_in_sync: int,
        replica_id_in_sync_group: Any,
        num_valid_rows: Any = None,
        batch_rows: int | None = None,
        axis_name: str | None = REPLICA_AXIS,
    ) -> None:
        self.num_replicas_in_sync = num_replicas_in_sync
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self._num_valid_rows = num_valid_rows
        self._batch_rows = batch_rows
        self._axis_name = axis_name

    @property
    def num_valid_rows(self) -> Any:
        """Real (non-padding) rows of this replica's batch in the current step."""
        self._require_batch()
        return self._num_valid_rows

    @property
    def valid_row_mask(self) -> Any:
        """Bool array of shape ``(per_replica_batch,)``: ``True`` for real rows.

        Short last batches are padded to a static shape; multiply per-row losses by
        this mask (and divide by the global count of real rows) to ignore padding.
        """
        self._require_batch()
        assert self._batch_rows is not None
        return jnp.arange(self._batch_rows) < self._num_valid_rows

    def _require_batch(self) -> None:
        if self._batch_rows is None:
            raise ValueError(
                "This step has no distributed batch input, so it has no row mask. "
                "Pass a batch from strategy.experimental_distribute_dataset(...) or "
                "distribute_datasets_from_function(...) to strategy.run."
            )

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Combines ``value`` (a pytree of arrays) across replicas, elementwise.

        Differentiable: the gradient of an all-reduce SUM is an all-reduce SUM of the
        incoming gradients (MEAN likewise, divided by the replica count); for MIN/MAX
        the gradient flows to the replicas holding the extreme value.
        """
        op = ReduceOp.from_value(reduce_op)
        axis_name = self._axis_name
        if axis_name is None:
            return jax.tree.map(jnp.asarray, value)
        return jax.tree.map(lambda v: _all_reduce_leaf(op, jnp.asarray(v), axis_name), value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates each replica's ``value`` along ``axis`` (pytrees allowed)."""

        def gather_leaf(v: Any) -> Any:
            v = jnp.asarray(v)
            ax = normalize_axis(axis, v.ndim, "all_gather")
            if self._axis_name is None:
                return v
            return lax.all_gather(v, self._axis_name, axis=ax, tiled=True)

        return jax.tree.map(gather_leaf, value)


def normalize_axis(axis: object, rank: int, what: str) -> int:
    """Returns ``axis`` as an index into a value of ``rank``; raises a clear error."""
    if rank == 0:
        raise ValueError(
            f"{what} needs per-replica values of rank >= 1, but got a scalar per replica. "
            "Return x[None] (or reduce the value instead)."
        )
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"{what}: axis must be an int. Got {axis!r}.")
    if not -rank <= axis < rank:
        raise ValueError(
            f"{what}: axis {axis} is out of range for per-replica values of rank {rank}; "
            f"use an axis in [{-rank}, {rank})."
        )
    return axis % rank


def _all_reduce_leaf(op: ReduceOp, v: jax.Array, axis_name: str) -> jax.Array:
    if op is ReduceOp.SUM:
        return lax.psum(v, axis_name)
    if op is ReduceOp.MEAN:
        return lax.psum(v, axis_name) / lax.psum(1, axis_name)
    return _extremum(v, axis_name, op is ReduceOp.MAX)


def _extremum(v: jax.Array, axis_name: str, is_max: bool) -> jax.Array:
    """pmin/pmax with a gradient: shared equally by the replicas at the extremum."""

    def reduce(x: jax.Array) -> jax.Array:
        return lax.pmax(x, axis_name) if is_max else lax.pmin(x, axis_name)

    @jax.custom_vjp
    def extremum(x: jax.Array) -> jax.Array:
        return reduce(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        y = reduce(x)
        return y, (x, y)

    def bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array]:
        x, y = res
        at_extremum = (x == y).astype(g.dtype)
        ties = lax.psum(at_extremum, axis_name)
        return (lax.psum(g, axis_name) * at_extremum / ties,)

    extremum.defvjp(fwd, bwd)
    return extremum(v)


_current: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "jaxpod_replica_context", default=None)
_DEFAULT_CONTEXT = ReplicaContext(1, 0, axis_name=None)


def get_replica_context() -> ReplicaContext | None:
    """The context of the replica running now.

    Returns:
      The replica context inside ``strategy.run``; ``None`` inside
      ``strategy.scope()`` outside ``run`` (cross-replica context); otherwise a
      default single-replica context.
    """
    ctx = _current.get()
    if ctx is not None:
        return ctx
    return None if get_strategy() is not None else _DEFAULT_CONTEXT


@contextlib.contextmanager
def replica_context(ctx: ReplicaContext) -> Iterator[ReplicaContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
