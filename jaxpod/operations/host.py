"""The :class:`Host` protocol: what runs host operations.

``op.apply(host)`` runs an operation on a host. An operation that is one call of the
host's engine (a strategy method: ``run``, its loop of steps, ``next``, local results,
values from a function) writes that call in its own ``apply``, over the host's
services: its functions, iterators and values, and its engine. Every other operation
needs the host's own state (meshes, datasets, checkpoints, output capture, profiles)
and has a method here, named after it. The worker's
``jaxpod.worker.host_operations.HostOperations`` is the one implementation; mypy
checks the two agree. Each operation is named by the module declaring it:
:mod:`~jaxpod.operations.strategy`, :mod:`~jaxpod.operations.jobs` or
:mod:`~jaxpod.operations.admin`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from jaxpod.operations import admin, jobs, strategy
    from jaxpod.operations.handles import ValueArgs, ValueInfos


class Host(Protocol):
    """What runs host operations: the services the strategy methods' operations use,
    and a method for each other operation, named after it."""

    #: This host's index in its group.
    process_id: int
    #: The per-replica engine: the strategy's methods (``jaxpod.worker.engine.Engine``).
    engine: Any
    #: A global-view job's mesh and programs (its ``init`` and loop of global steps,
    #: ``jaxpod.worker.global_view.GlobalView``); ``None``: values are per replica.
    global_view: Any

    # ------------------------------------------------------------------ services

    def function(self, function_id: str) -> Callable[..., Any]:
        """The function defined under ``function_id``."""

    def iterator(self, iterator_id: int) -> Any:
        """The iterator with that id (a clear error if it was freed)."""

    def resolve(self, tree: ValueArgs) -> Any:
        """The user's tree an argument stands for: the values for their handles."""

    def keep(self, tree: Any, wait: bool = False, donated: ValueArgs = ()) -> ValueInfos:
        """Keeps the tree's new values and describes them; ``wait``: once computed.
        Handles in ``donated`` whose arrays the program took are freed."""

    # --------------------------------------------- operations on the host's state
    def configure(self, op: strategy.Configure) -> int: ...

    def set_global_view(self, op: strategy.SetGlobalView) -> None: ...

    def define(self, op: strategy.Define) -> str: ...

    def run_spmd(self, op: strategy.RunSpmd) -> ValueInfos: ...

    def distribute_dataset(self, op: strategy.DistributeDataset) -> int: ...

    def distribute_datasets_from_function(
            self, op: strategy.DistributeDatasetsFromFunction) -> int: ...

    def create_iterator(self, op: strategy.CreateIterator) -> int: ...

    def reduce(self, op: strategy.Reduce) -> Any: ...

    def gather_parts(self, op: strategy.GatherParts) -> tuple[int, list[Any]]: ...

    def fetch_parts(self, op: strategy.FetchParts) -> list[np.ndarray]: ...

    def fetch_shards(self, op: strategy.FetchShards
                     ) -> list[tuple[strategy.ShardIndex, np.ndarray]]: ...

    def stats(self, op: admin.Stats) -> admin.HostStats: ...

    def reset_host(self, op: admin.ResetHost) -> admin.HostReset: ...

    def capture_output(self, op: admin.CaptureOutput) -> None: ...

    def take_output(self, op: admin.TakeOutput) -> list[str]: ...

    def preemption_notices(self, op: admin.PreemptionNotices) -> admin.Notice | None: ...

    def host_report(self, op: jobs.HostReport) -> jobs.HostNews: ...

    def save_checkpoint(self, op: jobs.SaveCheckpoint) -> None: ...

    def wait_checkpoints(self, op: jobs.WaitCheckpoints) -> int | None: ...

    def restore_checkpoint(self, op: jobs.RestoreCheckpoint) -> tuple[ValueInfos, Any]: ...

    def save_memory_checkpoint(self, op: jobs.SaveMemoryCheckpoint) -> None: ...

    def memory_holdings(self, op: jobs.MemoryHoldings) -> dict[int, dict[int, Any]]: ...

    def restore_memory_checkpoint(self, op: jobs.RestoreMemoryCheckpoint) -> ValueInfos: ...

    def drop_memory_checkpoints(self, op: jobs.DropMemoryCheckpoints) -> None: ...

    def replica_value(self, op: strategy.ReplicaValue) -> Any: ...

    def start_profile(self, op: admin.StartProfile) -> None: ...

    def stop_profile(self, op: admin.StopProfile) -> list[str]: ...
