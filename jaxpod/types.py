"""Plain types shared by every part of jaxpod: reduce ops and input contexts.

These mirror ``tf.distribute.ReduceOp``, ``tf.distribute.InputContext``,
``tf.distribute.ValueContext`` and ``tf.data.experimental.AutoShardPolicy``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReduceOp(enum.Enum):
    """How values from different replicas are combined."""

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @classmethod
    def from_value(cls, op: ReduceOp | str) -> ReduceOp:
        """Accepts a ``ReduceOp`` or its name in any case (``"sum"``, ``"MEAN"``)."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        known = ", ".join(repr(m) for m in cls.__members__)
        raise ValueError(
            f"reduce_op must be a jaxpod.ReduceOp or one of {known}. Got {op!r}."
        )


class AutoShardPolicy(enum.Enum):
    """How ``experimental_distribute_dataset`` splits input between hosts.

    Every host reads the whole dataset. ``AUTO`` and ``DATA`` split each global batch
    over all replicas of all hosts in replica order and each host keeps its own
    replicas' rows, so every step consumes one global batch whatever the number of
    hosts; ``OFF`` has every host's replicas split the whole batch among themselves,
    so each host's replicas see the same rows.
    """

    AUTO = "AUTO"
    DATA = "DATA"
    OFF = "OFF"


@dataclass(frozen=True)
class InputOptions:
    """Options for distributing a dataset (``tf.distribute.InputOptions``).

    Attributes:
      auto_shard_policy: how hosts split the dataset when there is more than one.
      global_batch_size: rows per step across all replicas. ``None`` infers it from
        the leading dimension of the dataset's first element, as TF infers it from
        the dataset's ``batch``.
    """

    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.auto_shard_policy, AutoShardPolicy):
            raise TypeError(
                "auto_shard_policy must be a jaxpod.AutoShardPolicy. "
                f"Got {self.auto_shard_policy!r}."
            )
        gbs = self.global_batch_size
        if gbs is not None and (not isinstance(gbs, int) or gbs < 1):
            raise ValueError(f"global_batch_size must be a positive int or None. Got {gbs!r}.")


@dataclass(frozen=True)
class InputContext:
    """What a per-host input function needs to know to shard and batch its input."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        _check_index("input_pipeline_id", self.input_pipeline_id,
                     "num_input_pipelines", self.num_input_pipelines)
        _check_positive("num_replicas_in_sync", self.num_replicas_in_sync)

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size each replica gets for ``global_batch_size``.

        Raises:
          ValueError: ``global_batch_size`` is not divisible by the number of replicas.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self.num_replicas_in_sync}. Use a global batch "
                "size that is a multiple of the number of replicas."
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True)
class ValueContext:
    """Which replica a ``value_fn`` is producing a value for."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        _check_index("replica_id_in_sync_group", self.replica_id_in_sync_group,
                     "num_replicas_in_sync", self.num_replicas_in_sync)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int. Got {value!r}.")


def _check_index(name: str, value: object, count_name: str, count: object) -> None:
    _check_positive(count_name, count)
    assert isinstance(count, int)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise ValueError(
            f"{name} must be an int in [0, {count_name}={count}). Got {value!r}."
        )
