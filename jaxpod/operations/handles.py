"""The names both ends give the workers' objects.

Values on the workers are named by :class:`Handle`; what the coordinator dropped rides
along with the next operation as :class:`Dropped`; a new value is described by
:class:`HandleInfo`; a stream operation's outputs have ids derived from its number
(:func:`output_id`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: A pytree whose leaves are :class:`HandleInfo` (new values) or plain data.
ValueInfos = Any
#: A pytree whose leaves are :class:`Handle` (values on the workers) or plain data.
ValueArgs = Any


@dataclass(frozen=True)
class Handle:
    """A reference to a ``PerReplica`` value held by every worker of a group."""

    id: int


@dataclass(frozen=True)
class Dropped:
    """Objects the coordinator dropped since its previous operation: freed before the
    next one runs, in the same round trip (a free costs no call of its own)."""

    values: tuple[int, ...] = ()
    iterators: tuple[int, ...] = ()
    datasets: tuple[int, ...] = ()
    functions: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.values or self.iterators or self.datasets or self.functions)

    @property
    def ids(self) -> tuple[int, ...]:
        """The numeric ids (values, iterators, datasets): they come from one sequence."""
        return self.values + self.iterators + self.datasets


@dataclass(frozen=True)
class HandleInfo:
    """What the coordinator learns about a new value: enough to describe it."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    valid_rows: tuple[int, ...] | None
    #: A global array (global-view job, ``strategy.spmd``): ``shape`` is the whole
    #: array's, with no replica axis.
    global_view: bool = False



def values_in(infos: ValueInfos) -> Dropped:
    """The values a tree of :class:`HandleInfo` describes."""
    import jax

    leaves = jax.tree.leaves(infos, is_leaf=lambda x: isinstance(x, HandleInfo))
    return Dropped(values=tuple(x.id for x in leaves if isinstance(x, HandleInfo)))


# ------------------------------------------------------------------ value ids
#: A stream operation's n-th output value has the id ``op << OUTPUT_BITS | n``.
OUTPUT_BITS = 20
_OUTPUT_MASK = (1 << OUTPUT_BITS) - 1


def output_id(op: int, index: int) -> int:
    """The id of stream operation ``op``'s ``index``-th output value (``SliceOp``).

    Raises:
      ValueError: an operation that makes more values than an id leaves room for.
    """
    if index > _OUTPUT_MASK:
        raise ValueError(f"An operation may make at most {_OUTPUT_MASK + 1} values; "
                         "return fewer leaves.")
    return op << OUTPUT_BITS | index


def op_of(value_id: int) -> int:
    """The stream operation that made value ``value_id``."""
    return value_id >> OUTPUT_BITS


def output_index(value_id: int) -> int:
    """Value ``value_id``'s place among its operation's outputs."""
    return value_id & _OUTPUT_MASK
