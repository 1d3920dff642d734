"""``HostWorker``: one JAX process of a multi-host replica group (a Ray actor).

Every host of an allocated slice runs one ``HostWorker``. Host 0 picks the
coordinator port, all hosts join one ``jax.distributed`` group, and each then runs the
same :class:`~jaxpod.worker.engine.Engine` over the global mesh. The coordinator talks
to the workers only through :class:`~jaxpod.service.replica_group.ReplicaGroup`, which
numbers every operation so that a skipped or reordered call is detected here instead
of deadlocking a collective.

Values live in the worker's :class:`ValueStore`; operations name them by handle id.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from typing import TYPE_CHECKING, Any

from jaxpod.operations import Dropped, Handle, HandleInfo, OperationOrderError, RemoteError
from jaxpod.worker.busy_clock import BusyClock

if TYPE_CHECKING:
    from jaxpod.framing import Framing
    from jaxpod.worker.channel import ChannelAddress

SIMULATED_PLATFORM = "cpu"


class HostWorker:
    """Runs engine operations for one host. Construct through ``ray.remote``.

    Args:
      process_id: this host's index in the group (its TPU worker id).
      num_processes: hosts in the group.
      devices_per_host: JAX devices each host has (simulated hosts: one CPU device
        per chip).
      platform: ``"cpu"`` for simulated hosts; ``"tpu"`` on real TPU hosts.
      env: variables to set before JAX starts (the host's ``TPU_*``/``MEGASCALE_*``).
      unset_env: variables to remove first (stale ones a ``runtime_env`` cannot drop).
    """

    def __init__(self, process_id: int, num_processes: int, devices_per_host: int,
                 platform: str = SIMULATED_PLATFORM, env: dict[str, str] | None = None,
                 unset_env: tuple[str, ...] = ()) -> None:
        for name in unset_env:
            os.environ.pop(name, None)
        os.environ.update(env or {})
        import jax

        if platform == SIMULATED_PLATFORM:
            # Must happen before JAX starts its backend: one virtual device per chip,
            # and gloo for cross-process collectives on CPU (only across processes: in
            # one process XLA's own collectives are an order of magnitude faster).
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", devices_per_host)
            if num_processes > 1:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        self.process_id = process_id
        self.num_processes = num_processes
        self._expected_seq = 0
        self._engine: Any = None
        self._store: Any = None
        self._functions: Any = None
        self._iterators: dict[int, Any] = {}
        self._datasets: dict[int, Any] = {}
        self._next_id = 1
        self._channel: Any = None
        self._busy = BusyClock()
        self._operations = 0
        self._op_start = 0.0

    # ------------------------------------------------------------------ start/stop
    def node_address(self) -> str:
        """The address other hosts reach this one at."""
        import ray

        return str(ray.util.get_node_ip_address())

    def reserve_port(self) -> int:
        """A free TCP port on this host for the jax.distributed coordinator."""
        with socket.socket() as s:
            s.bind((self.node_address(), 0))
            return int(s.getsockname()[1])

    def initialize(self, coordinator_address: str, timeout_s: float) -> dict[str, int]:
        """Joins the group; raises if the other hosts do not join within ``timeout_s``."""
        import jax

        if self.num_processes > 1:  # a single-host slice needs no distributed runtime
            jax.distributed.initialize(coordinator_address=coordinator_address,
                                       num_processes=self.num_processes,
                                       process_id=self.process_id,
                                       initialization_timeout=max(1, int(timeout_s)))
        from jaxpod.worker.engine import Engine
        from jaxpod.worker.functions import FunctionRegistry
        from jaxpod.worker.value_store import ValueStore

        self._engine = Engine()
        self._store = ValueStore()
        self._functions = FunctionRegistry()
        return {"process_index": jax.process_index(), "process_count": jax.process_count(),
                "global_devices": jax.device_count(),
                "local_devices": jax.local_device_count(),
                "num_replicas": self._engine.num_replicas_in_sync}

    def open_channel(self, key: bytes) -> ChannelAddress:
        """Starts serving operations over a direct socket (see
        :mod:`jaxpod.worker.channel`); returns its address."""
        from jaxpod.worker.channel import ChannelServer

        self._channel = ChannelServer(self.node_address(), key,
                                      lambda message: self.execute(*message[0], **message[1]),
                                      lambda e: RemoteError.of(e, traceback.format_exc()))
        return self._channel.address

    def shutdown(self) -> None:
        """Leaves the group (called with a time limit by the coordinator)."""
        import jax

        if self._channel is not None:
            self._channel.close()
        self._iterators.clear()
        self._datasets.clear()
        if self.num_processes > 1:
            jax.distributed.shutdown()

    # ------------------------------------------------------------------ operations
    def execute(self, seq: int, op: str, *args: Any, dropped: Dropped | None = None) -> Any:
        """Runs operation ``op`` if ``seq`` is the next in this group's sequence.

        ``dropped``: values, iterators and datasets to free before it.

        Returns:
          The operation's result, or a :class:`RemoteError` carrying the exception.
        """
        if seq != self._expected_seq:
            expected = self._expected_seq
            return RemoteError.of(OperationOrderError(
                f"Host {self.process_id} expected operation #{expected} but received "
                f"#{seq} ({op}); an operation was skipped or reordered. The replica group "
                "must be restarted."), "")
        self._expected_seq += 1
        start = self._op_start = time.perf_counter()
        try:
            if dropped:
                self._drop(dropped)
            return getattr(self, f"_op_{op}")(*args)
        except BaseException as e:
            return RemoteError.of(e, traceback.format_exc())
        finally:
            if op != "stats":  # reading the figures must not move them
                self._busy.add(start, time.perf_counter())
                self._operations += 1

    def _drop(self, dropped: Dropped) -> None:
        self._store.free(list(dropped.values))
        for iterator_id in dropped.iterators:
            self._iterators.pop(iterator_id, None)  # stops its infeed threads
        for dataset_id in dropped.datasets:
            self._datasets.pop(dataset_id, None)  # its iterators keep running

    def _resolve(self, tree: Any) -> Any:
        import jax

        return jax.tree.map(lambda x: self._store.get(x.id) if isinstance(x, Handle) else x,
                            tree, is_leaf=lambda x: isinstance(x, Handle))

    def _store_tree(self, tree: Any, watch: bool = False) -> Any:
        """Keeps the tree's values; with ``watch``, the busy clock runs until they are
        computed (they may still be being computed when the operation returns)."""
        import jax

        from jaxpod.values import PerReplica, is_per_replica

        arrays = []

        def keep(v: PerReplica) -> HandleInfo:
            arrays.append(v.array)
            valid = None if v.valid_rows is None else tuple(int(c) for c in v.valid_rows)
            return HandleInfo(self._store.put(v), v.shape, str(v.dtype), valid)

        infos = jax.tree.map(keep, tree, is_leaf=is_per_replica)
        if watch:
            self._busy.watch(self._op_start, arrays)
        return infos

    def _op_configure(self, steps_per_run: int, computation_shape: list[int] | None,
                      num_replicas: int | None) -> int:
        """Replaces the engine with one for this device assignment; returns its
        replica count. Only before any value exists: values belong to one mesh."""
        from jaxpod.worker.device_assignment import DeviceAssignment
        from jaxpod.worker.engine import Engine

        if self._store.stats().num_values or self._iterators:
            raise RuntimeError("configure must come before any value or iterator exists.")
        assignment = DeviceAssignment.build(None, computation_shape, num_replicas)
        self._engine = Engine(assignment, steps_per_run)
        self._datasets.clear()
        return int(self._engine.num_replicas_in_sync)

    def _op_define(self, shipped: Any) -> str:
        return str(self._functions.define(shipped))

    def _op_run(self, function_id: str, args: Any, kwargs: Any) -> Any:
        fn = self._functions.get(function_id)
        out = self._engine.run(fn, args=self._resolve(args), kwargs=self._resolve(kwargs))
        return self._store_tree(out, watch=True)

    def _op_run_steps(self, function_id: str, source: Any, steps: int | None,
                      state: Any) -> Any:
        fn = self._functions.get(function_id)
        # ``source``: an iterator id, or StepItems (the elements themselves).
        iterator = (self._iterators[source] if isinstance(source, int)
                    else iter(self._resolve(source.items)))
        result = self._engine.run_steps(fn, iterator, steps,
                                        initial_state=self._resolve(state))
        return self._store_tree(result, watch=True)

    def _op_values_from_function(self, function_id: str) -> Any:
        fn = self._functions.get(function_id)
        return self._store_tree(self._engine.experimental_distribute_values_from_function(fn))

    def _op_distribute_dataset(self, dataset: Any, options: Any) -> int:
        return self._keep(self._datasets, self._engine.experimental_distribute_dataset(
            _unshipped(dataset), _unshipped(options)))

    def _op_distribute_datasets_from_function(self, function_id: str, options: Any) -> int:
        options = _unshipped(options)
        fn = self._functions.get(function_id)
        return self._keep(self._datasets,
                          self._engine.distribute_datasets_from_function(fn, options))

    def _op_iterator(self, dataset_id: int, steps_per_run: int | None = None) -> int:
        return self._keep(self._iterators, self._datasets[dataset_id].iterate(steps_per_run))

    def _op_next(self, iterator_id: int) -> Any:
        return self._store_tree(next(self._iterators[iterator_id]))

    def _op_reduce(self, op: str, value: Any, axis: int | None) -> Any:
        result = self._engine.reduce(op, self._resolve(value), axis)
        return result if self.process_id == 0 else None

    def _op_gather_parts(self, value: Handle, axis: int, replicas: Any = None,
                         framing: Framing | None = None) -> tuple[int, list[Any]]:
        """With ``framing``, each part comes cut into framed pieces (``Framed``): the
        one copy from device memory, and the caller forwards them as they are."""
        ax, parts = self._engine.gather_parts(self._store.get(value.id), axis, replicas,
                                              views=framing is not None)
        return ax, parts if framing is None else [framing.frame(p) for p in parts]

    def _op_fetch_parts(self, value: Handle) -> list[Any]:
        return self._engine.padded_parts(self._store.get(value.id))

    def _op_local_results(self, value: Any) -> tuple[Any, ...]:
        return tuple(self._engine.experimental_local_results(self._resolve(value)))

    def _op_stats(self) -> dict[str, Any]:
        """Memory held, and the time spent working (operations other than ``stats``, and
        the computations they dispatched): the work measured inside the worker,
        without the time it took to reach it."""
        stats = self._store.stats()
        return {"num_values": stats.num_values, "device_bytes": stats.device_bytes,
                "num_iterators": len(self._iterators), "busy_s": self._busy.seconds(),
                "operations": self._operations}

    def _keep(self, table: dict[int, Any], value: Any) -> int:
        key = self._next_id
        self._next_id += 1
        table[key] = value
        return key


def _unshipped(value: Any) -> Any:
    """``value``, or what it holds if the client pickled it by value (a dataset, its
    options): the coordinator forwards those bytes without unpickling user code."""
    from jaxpod.shipping import ShippedFunction, load

    return load(value) if isinstance(value, ShippedFunction) else value
