"""``jaxpod.TPUStrategy``: the engine in this process, with TF's constructor."""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxpod.jobs import check_spmd
from jaxpod.tf_compat import TFCompatMixin
from jaxpod.tf_extended import StrategyExtended
from jaxpod.values import PerReplica, is_per_replica
from jaxpod.worker.device_assignment import DeviceAssignment
from jaxpod.worker.engine import Engine, EngineExtended
from jaxpod.worker.global_view import GlobalView, is_global


class TPUStrategy(TFCompatMixin, Engine):
    """Synchronous data-parallel training on the devices this process sees.

    Besides TF2's methods it has TF1's and TF 1.x's (towers, ``run_steps_on_dataset``,
    ``distribute_dataset``, ``extended``...), from :mod:`jaxpod.tf_compat`.

    Args:
      resolver: a cluster resolver, ``'local'`` or ``None``. In one process the
        strategy always uses the devices JAX sees (after ``jax.distributed.initialize``
        that is every host's devices); the resolver is kept as ``cluster_resolver``.
      steps_per_run: steps ``run_steps`` runs per call unless told otherwise.
      device_assignment: a :class:`jaxpod.DeviceAssignment` for model parallelism;
        ``None`` makes every device a replica.
      num_cores: TF1's argument: use only the first ``num_cores`` devices, one replica
        each (``None``: every device). Not with ``device_assignment``.
      tpu_cluster_resolver, experimental_device_assignment: TF2's names for
        ``resolver`` and ``device_assignment``.
      experimental_spmd_xla_partitioning: TF2's switch to XLA's SPMD partitioner.
        jaxpod always compiles that way; as in TF, ``True`` makes
        ``experimental_assign_to_logical_device`` raise ``ValueError``.
    """

    def __init__(self, resolver: Any = None, steps_per_run: int = 1,
                 device_assignment: DeviceAssignment | None = None, *,
                 num_cores: int | None = None, tpu_cluster_resolver: Any = None,
                 experimental_device_assignment: DeviceAssignment | None = None,
                 experimental_spmd_xla_partitioning: bool = False) -> None:
        resolver = _one_of("resolver", resolver, "tpu_cluster_resolver", tpu_cluster_resolver)
        device_assignment = _one_of("device_assignment", device_assignment,
                                    "experimental_device_assignment",
                                    experimental_device_assignment)
        self._spmd_partitioning = bool(experimental_spmd_xla_partitioning)
        if device_assignment is not None and not isinstance(device_assignment, DeviceAssignment):
            raise TypeError(
                "device_assignment must be a jaxpod.DeviceAssignment (from "
                f"DeviceAssignment.build) or None. Got {type(device_assignment).__name__}."
            )
        if num_cores is not None:
            device_assignment = _first_cores(num_cores, device_assignment)
        super().__init__(device_assignment, steps_per_run)
        self.cluster_resolver = resolver

    @property
    def extended(self) -> TPUStrategyExtended:
        """TF2's ``tf.distribute.StrategyExtended`` members, and the engine's machinery
        that TF's surface does not show (:class:`~jaxpod.worker.engine.EngineExtended`)."""
        return TPUStrategyExtended(self)

    def spmd(self, fn: Any, *, mesh: dict[str, int] | None = None,
             batch_sharding: Any = None) -> Any:
        """``fn`` as a global-view program over this strategy's devices (a job's
        ``mesh=`` step, called interactively; see ``RemoteStrategy.spmd``). The
        returned function gives ``jax.Array`` s with the shardings ``fn`` chose."""
        axes, spec = check_spmd(fn, mesh, batch_sharding)
        view = GlobalView(self, axes, spec)

        def call(*args: Any, **kwargs: Any) -> Any:
            return jax.tree.map(lambda v: v.array, view.call(fn, args, kwargs),
                                is_leaf=is_global)

        return functools.wraps(fn)(call)

    def reduce(self, reduce_op: Any, value: Any, axis: Any = None, *,
               destinations: Any = None) -> Any:
        """Reduces across replicas (and along ``axis`` if given); numpy results.

        TF1's ``reduce(aggregation, value, destinations)`` works too: destinations (a
        device name, names or a value) in place of ``axis``, or as ``destinations=``,
        reduce over replicas only; ``"ONLY_FIRST_TOWER"`` gives replica 0's value.
        """
        return self._reduce_tf1(super().reduce, reduce_op, value, axis, destinations)

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        """Annotates ``tensor`` for logical device ``logical_device_id`` (kept whole:
        XLA's SPMD partitioner has no single-device placement; results are identical).

        Raises:
          ValueError: the strategy was made with ``experimental_spmd_xla_partitioning``
            (as TF raises), or the id is not a logical device of a replica.
        """
        if self._spmd_partitioning:
            raise ValueError(
                "experimental_assign_to_logical_device is not allowed on a TPUStrategy made "
                "with experimental_spmd_xla_partitioning=True (as in TF); use "
                "experimental_split_to_logical_devices or "
                "experimental_replicate_to_logical_devices.")
        return super().experimental_assign_to_logical_device(tensor, logical_device_id)

    def _wait_for(self, value: Any) -> None:
        # The arrays are here: wait on them directly (the mixin's way runs a program).
        jax.block_until_ready([v.array if isinstance(v, PerReplica) else v
                               for v in jax.tree.leaves(value, is_leaf=is_per_replica)])

    def __repr__(self) -> str:
        da = self.device_assignment
        return (f"TPUStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"logical_devices_per_replica={da.num_cores_per_replica}, "
                f"hosts={self.num_hosts}, steps_per_run={self.steps_per_run})")


class TPUStrategyExtended(StrategyExtended, EngineExtended):
    """``strategy.extended`` of the in-process strategy: TF's members over the strategy,
    and the engine's machinery (gather parts, padded parts, all-host gathers...)."""

    def __init__(self, strategy: TPUStrategy) -> None:
        StrategyExtended.__init__(self, strategy)
        EngineExtended.__init__(self, strategy)


def _first_cores(num_cores: object, device_assignment: DeviceAssignment | None
                 ) -> DeviceAssignment:
    devices = jax.devices()
    if device_assignment is not None:
        raise ValueError("Pass num_cores or device_assignment, not both: a device "
                         "assignment already says which devices the replicas use.")
    if not isinstance(num_cores, int) or isinstance(num_cores, bool) or \
            not 1 <= num_cores <= len(devices):
        raise ValueError(f"num_cores must be an int in [1, {len(devices)}] (the devices JAX "
                         f"sees). Got {num_cores!r}.")
    return DeviceAssignment.build(devices[:num_cores])


def _one_of(name: str, value: Any, tf2_name: str, tf2_value: Any) -> Any:
    if value is not None and tf2_value is not None:
        raise ValueError(f"Pass {name} or {tf2_name} (TF2's name for it), not both. Got "
                         f"{value!r} and {tf2_value!r}.")
    return tf2_value if value is None else value
