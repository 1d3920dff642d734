"""Distributed values and inputs as every part sees them: what ``run`` returns, and
the dataset and iterator types of ``experimental_distribute_dataset``.

The in-process engine (``jaxpod.worker``) and the remote client (``jaxpod.client``)
each implement these; user code checks against them.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np


class PerReplica(metaclass=abc.ABCMeta):  # noqa: B024 (remote values register)
    """One value per replica, kept on the devices.

    The components of all replicas live in one global ``jax.Array`` whose leading axis
    is the replica axis (shape ``(num_replicas, *per_replica_shape)``, sharded over the
    mesh's ``"replica"`` axis), so passing a ``PerReplica`` to the next ``run`` moves
    no data.

    Attributes:
      array: the stacked components.
      valid_rows: for values that hold rows of a batch (from a distributed dataset, or
        outputs of a step on a padded batch), the number of real rows along axis 0 of
        each replica's component (shape ``(num_replicas,)``); ``None`` for other values.
        Reductions, gathers and local results drop the rows past it.

    The remote strategy's values (``jaxpod.client``) register as virtual subclasses:
    they have the same attributes, with ``array`` fetched on use.
    """

    __slots__ = ("array", "valid_rows")

    def __init__(self, array: jax.Array, valid_rows: np.ndarray | None = None) -> None:
        self.array = array
        self.valid_rows = valid_rows

    @property
    def num_replicas(self) -> int:
        return int(self.array.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The (padded) shape of one replica's component."""
        return tuple(self.array.shape[1:])

    @property
    def dtype(self) -> Any:
        """numpy's dtype of the components; a JAX dtype for typed PRNG keys."""
        return component_dtype(self.array.dtype)

    @property
    def padding(self) -> np.ndarray | None:
        """``valid_rows`` if some replica has padding rows, else ``None``."""
        return padding_of(self.shape, self.valid_rows)

    def __repr__(self) -> str:
        rows = "" if self.valid_rows is None else f", valid_rows={self.valid_rows.tolist()}"
        return (f"PerReplica(num_replicas={self.num_replicas}, shape={self.shape}, "
                f"dtype={self.dtype}{rows})")


@functools.cache
def component_dtype(dtype: Any) -> Any:
    """numpy's dtype for an array's; the JAX dtype itself for typed PRNG keys (cached:
    values are asked for it on every operation)."""
    from jaxpod.trees import is_key_dtype

    return dtype if is_key_dtype(dtype) else np.dtype(dtype)


def padding_of(shape: tuple[int, ...], valid_rows: np.ndarray | None) -> np.ndarray | None:
    """``valid_rows`` if some replica's component of ``shape`` has padding rows."""
    if valid_rows is None or not shape or np.all(valid_rows == shape[0]):
        return None
    return valid_rows


def is_per_replica(x: object) -> bool:
    """``is_leaf`` predicate that keeps ``PerReplica`` values whole in tree operations."""
    return isinstance(x, PerReplica)


class DistributedDataset(abc.ABC):
    """A dataset distributed over the replicas; iterate it once per epoch."""

    @abc.abstractmethod
    def __iter__(self) -> DistributedIterator:
        """A new iterator over the dataset (one epoch)."""


class DistributedIterator(Iterator[Any], abc.ABC):
    """Yields one step of input per ``next``: a nest of ``PerReplica`` batches."""

    def get_next(self) -> Any:
        """The next step's input (``tf.distribute.DistributedIterator.get_next``)."""
        return next(self)
