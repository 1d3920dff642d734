"""The engine: ``tf.distribute.TPUStrategy`` semantics on a JAX mesh.

Every replica is one slot of the mesh's ``"replica"`` axis. ``run`` compiles the
user's step function once per input signature as ``jax.jit(shard_map(...))`` over that
axis; per-replica values stay on the devices as :class:`PerReplica` handles whose
global array carries the replica axis first. The same code runs in one process or in
one process per host after ``jax.distributed.initialize``: meshes are built from the
global device list and host-local data is assembled into global arrays.

The engine is assembled from its parts: :mod:`~jaxpod.worker.engine_core` (replicas,
hosts, values between this host and global arrays), :mod:`~jaxpod.worker.engine_programs`
(``run``, ``run_steps``), :mod:`~jaxpod.worker.engine_results` (``reduce``, ``gather``,
local results) and :mod:`~jaxpod.worker.engine_input` (distributing values and
datasets). Here: the logical-device annotations, ``scope``, and
:class:`EngineExtended`, the machinery behind ``strategy.extended``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from jaxpod.scope import strategy_scope
from jaxpod.values import PerReplica
from jaxpod.worker.engine_input import InputDistribution, StepBatch
from jaxpod.worker.engine_programs import StepPrograms
from jaxpod.worker.engine_results import CrossReplicaResults


class Engine(StepPrograms, CrossReplicaResults, InputDistribution):
    """Runs step functions on the replicas of one device assignment.

    Args:
      device_assignment: which devices form each replica; ``None`` uses every device
        this process sees, one device per replica.
      steps_per_run: default number of steps ``run_steps`` runs per call.
    """

    @property
    def extended(self) -> EngineExtended:
        """What the hosts' operations read beyond TF's surface (:class:`EngineExtended`)."""
        return EngineExtended(self)

    # ------------------------------------------------------------ logical devices
    def experimental_split_to_logical_devices(self, tensor: Any,
                                              partition_dimensions: Sequence[int]) -> Any:
        """Annotates ``tensor`` to be split across this replica's logical devices."""
        sharding = self.device_assignment.split_sharding(tuple(jnp.shape(tensor)),
                                                         partition_dimensions)
        return self._constrain(tensor, sharding)

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        """Annotates ``tensor`` to be replicated to all logical devices of the replica."""
        return self._constrain(tensor, self.device_assignment.replicated_sharding())

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        """Annotates ``tensor`` for logical device ``logical_device_id``.

        XLA's SPMD partitioner has no single-device placement inside a partitioned
        program, so the value is kept whole (replicated), which gives identical results.
        """
        self.device_assignment.check_logical_device(logical_device_id)
        return self._constrain(tensor, self.device_assignment.replicated_sharding())

    def _constrain(self, tensor: Any, sharding: NamedSharding) -> Any:
        if self.device_assignment.num_cores_per_replica == 1:
            return tensor
        return lax.with_sharding_constraint(tensor, sharding)

    # ---------------------------------------------------------------------- scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Engine]:
        """Makes this the current strategy and enters the cross-replica context."""
        with strategy_scope(self):
            yield self


class EngineExtended:
    """What the hosts' operations and the coordinator read of an engine beyond TF's
    strategy surface (``strategy.extended`` in-process, as TF keeps such machinery
    behind ``extended``): a gather's parts, padded components, one replica's value, a
    loop's stacked steps, and small all-host gathers.

    Args:
      engine: the engine it reads.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def num_local_replicas(self) -> int:
        """The replicas on this host's devices."""
        return self._engine._num_local_replicas

    def gather_parts(self, value: PerReplica, axis: int, replicas: Sequence[int] | None = None,
                     views: bool = False, padded: bool = False
                     ) -> tuple[int, list[np.ndarray]]:
        """This host's share of ``gather`` (see :meth:`Engine._gather_parts`)."""
        return self._engine._gather_parts(value, axis, replicas, views=views, padded=padded)

    def padded_parts(self, value: PerReplica) -> list[np.ndarray]:
        """This host's replicas' components with their padding rows."""
        return self._engine._padded_parts(value)

    def replica_value(self, value: Any, replica: int) -> Any | None:
        """Replica ``replica``'s component of ``value``'s leaves, or ``None`` when this
        host does not hold that replica."""
        return self._engine._replica_value(value, replica)

    def next_steps(self, iterator: Iterator[Any], k: int) -> StepBatch:
        """The next ``k`` steps of ``iterator`` stacked on the devices (a loop's input)."""
        return self._engine._next_steps(iterator, k)

    def allgather_json(self, value: Any) -> list[Any]:
        """Every host's ``value`` (small, JSON-serializable), in host order."""
        return self._engine._allgather_json(value)

    def allgather_host(self, local: np.ndarray) -> np.ndarray:
        """Concatenates a small host-local array over hosts, in replica order."""
        return self._engine._allgather_host(local)
