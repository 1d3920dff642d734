"""``HostOperations``: what one host worker does for each host operation.

It implements :class:`jaxpod.operations.Host`: the services the strategy methods'
operations run over (this host's engine, value store, function registry and
iterators), and a method for each other operation of :mod:`jaxpod.operations`.
:meth:`HostOperations.execute` checks each operation's place in the group's sequence,
frees what the coordinator dropped, runs the operation and turns any exception into a
:class:`~jaxpod.operations.RemoteError` reply. Trees arrive
and leave frozen (:mod:`jaxpod.trees`): the coordinator never holds the user's types.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxpod import operations as ops
from jaxpod import trees
from jaxpod.errors import HandleError
from jaxpod.operations import (
    Dropped,
    Handle,
    HandleInfo,
    IdRangeError,
    OperationOrderError,
    RemoteError,
)
from jaxpod.pieces import Streamed
from jaxpod.shipping import ShippedFunction, load
from jaxpod.values import PerReplica, is_per_replica
from jaxpod.worker import compile_cache, preemption
from jaxpod.worker.busy_clock import BusyClock
from jaxpod.worker.checkpoints import HostCheckpoints
from jaxpod.worker.device_assignment import DeviceAssignment
from jaxpod.worker.engine import Engine
from jaxpod.worker.functions import FunctionRegistry
from jaxpod.worker.global_view import GlobalValue, GlobalView, is_global
from jaxpod.worker.memory_checkpoints import HostMemoryCheckpoints
from jaxpod.worker.meshes import slice_major_mesh
from jaxpod.worker.output_capture import OutputCapture
from jaxpod.worker.profiles import HostProfiler
from jaxpod.worker.result_digest import result_digest
from jaxpod.worker.value_store import ValueStore


class HostOperations(ops.Host):
    """Runs host operations for one host, in the group's order.

    Args:
      process_id: this host's index in the group.
      engine: the engine over the group's global mesh.
      hosts: how many hosts the group has: with more than one, uniform operations
        are answered as :class:`~jaxpod.operations.Digested` by the first host and
        as a :class:`~jaxpod.operations.Digest` by the others.
    """

    def __init__(self, process_id: int, engine: Engine, hosts: int = 1) -> None:
        self.process_id = process_id
        self.hosts = hosts
        self.engine = engine
        self.store = ValueStore()
        self.functions = FunctionRegistry()
        self.checkpoints = HostCheckpoints()
        self.memory = HostMemoryCheckpoints()
        self.profiler = HostProfiler()
        self.iterators: dict[int, Any] = {}
        self.datasets: dict[int, Any] = {}
        self._next_id = 1
        self._id_limit: int | None = None
        self._created: list[int] = []  # ids the operation running now created
        self._expected_seq = 0
        self._busy = BusyClock()
        self._busy_base = 0.0  # busy seconds before the slice's current holder
        self._operations = 0
        self._output = OutputCapture()
        # The device assignment the engine was built for: a Configure asking for the
        # same keeps the engine, and with it every compiled program (a warm slice's
        # next holder or job then compiles nothing it already ran).
        self._assignment: tuple[Any, ...] | None = None
        #: A global-view job's mesh and programs (``None``: values are per replica).
        self.global_view: GlobalView | None = None
        #: ``strategy.spmd``'s meshes and programs, by mesh and batch sharding.
        self._spmd_views: dict[tuple[Any, ...], GlobalView] = {}

    def execute(self, envelope: ops.Envelope) -> Any:
        """Runs the envelope's operation if it is the next in this group's sequence.

        Returns:
          The operation's result, or a :class:`RemoteError` carrying the exception.
        """
        op = envelope.operation
        if envelope.seq != self._expected_seq:
            return RemoteError.of(OperationOrderError(
                f"Host {self.process_id} expected operation #{self._expected_seq} but "
                f"received #{envelope.seq} ({type(op).__name__}); an operation was skipped "
                "or reordered. The replica group must be restarted."), "")
        self._expected_seq += 1
        start = time.perf_counter()
        self._next_id, self._id_limit, self._created = envelope.first_id, envelope.id_limit, []
        try:
            if envelope.dropped:
                self._drop(envelope.dropped)
            result = op.apply(self)
        except BaseException as e:
            # What it created here goes with it: the operation took effect nowhere.
            self._drop(Dropped(values=tuple(self._created), iterators=tuple(self._created),
                               datasets=tuple(self._created)))
            return RemoteError.of(e, traceback.format_exc())
        finally:
            if op.counts_as_work:
                self._busy.add(start, time.perf_counter())
                self._operations += 1
        return self._answer(op, result)

    def _answer(self, op: ops.Operation[Any], result: Any) -> Any:
        """The reply to a successful ``op``: its result, or for a uniform operation of
        a group of several hosts, the first host's result with its digest and the
        others' digest alone (a result without a digest goes whole)."""
        if not (op.uniform and self.hosts > 1):
            return result
        digest = result_digest(result)
        if self.process_id == 0:
            return ops.Digested(result, digest)
        return result if digest is None else ops.Digest(digest)

    def close(self) -> None:
        """Stops every iterator's infeed, drops the datasets, stops capturing output
        (putting the process's streams back), discarding what was captured, and closes
        the checkpoint managers once their writes are committed, and ends any profile
        capture."""
        self.iterators.clear()
        self.datasets.clear()
        self._output.discard()
        self.checkpoints.close()
        self.memory.close()
        self.profiler.discard()

    # ------------------------------------------------------------------ helpers
    def _drop(self, dropped: Dropped) -> None:
        self.store.free(list(dropped.values))
        for iterator_id in dropped.iterators:
            self.iterators.pop(iterator_id, None)  # stops its infeed threads
        for dataset_id in dropped.datasets:
            self.datasets.pop(dataset_id, None)  # its iterators keep running
        self.functions.forget(dropped.functions)

    def _new_id(self) -> int:
        """The next id the coordinator gave this operation for the objects it creates."""
        new = self._next_id
        if self._id_limit is not None and new >= self._id_limit:
            raise IdRangeError(
                f"The operation made more objects (values, iterators, datasets) than "
                f"the {len(self._created)} ids it was given. Return fewer leaves from "
                "the function.")
        self._next_id += 1
        self._created.append(new)
        return new

    # ----------------------------------------------- services of the operations
    def function(self, function_id: str) -> Any:
        return self.functions.get(function_id)

    def iterator(self, iterator_id: int) -> Any:
        try:
            return self.iterators[iterator_id]
        except KeyError:
            raise HandleError(
                f"Iterator #{iterator_id} does not exist on this worker: it was freed, or "
                "closed because an operation that used it failed on some hosts only (its "
                "hosts no longer agree on its position). Create a new one with "
                "iter(dataset).") from None

    def _dataset(self, dataset_id: int) -> Any:
        try:
            return self.datasets[dataset_id]
        except KeyError:
            raise HandleError(f"Dataset #{dataset_id} does not exist on this worker: it "
                              "was freed. Distribute the dataset again.") from None

    def resolve(self, tree: ops.ValueArgs) -> Any:
        return trees.thaw(tree, lambda x: self.store.get(x.id) if isinstance(x, Handle) else x)

    def keep(self, tree: Any, wait: bool = False, donated: ops.ValueArgs = ()) -> ops.ValueInfos:
        taken = [h.id for h in jax.tree.leaves(donated, is_leaf=_is_handle)
                 if _is_handle(h) and self.store.get(h.id).array.is_deleted()]
        self.store.free(taken)  # their arrays went into the program that made ``tree``
        if wait:
            jax.block_until_ready(jax.tree.map(lambda v: v.array, tree, is_leaf=_is_value))

        def keep(v: PerReplica | GlobalValue) -> HandleInfo:
            valid = None if v.valid_rows is None else tuple(v.valid_rows.tolist())
            return HandleInfo(self.store.put(v, self._new_id()), v.shape,
                              trees.dtype_name(v.dtype), valid, global_view=is_global(v))

        return trees.freeze(jax.tree.map(keep, tree, is_leaf=_is_value), "result")

    def _keep(self, table: dict[int, Any], value: Any) -> int:
        key = self._new_id()
        table[key] = value
        return key

    # --------------------------------------------------------------- operations
    def configure(self, op: ops.Configure) -> int:
        # Only before any value exists: values belong to one mesh.
        if self.store.stats().num_values or self.iterators:
            raise RuntimeError("configure must come before any value or iterator exists.")
        wanted = (op.computation_shape, op.num_replicas)
        if wanted == self._assignment:
            if op.steps_per_run < 1:
                raise ValueError(f"steps_per_run must be a positive int. Got "
                                 f"{op.steps_per_run!r}.")
            self.engine.steps_per_run = op.steps_per_run
        else:
            computation_shape = (None if op.computation_shape is None
                                 else list(op.computation_shape))
            assignment = DeviceAssignment.build(None, computation_shape, op.num_replicas)
            self.engine = Engine(assignment, op.steps_per_run)
            self._assignment = wanted
        self.datasets.clear()
        self.global_view = None
        self._spmd_views.clear()
        return int(self.engine.num_replicas_in_sync)

    def set_global_view(self, op: ops.SetGlobalView) -> None:
        if self.store.stats().num_values:
            raise RuntimeError("set_global_view must come before any value exists.")
        self.global_view = GlobalView(self.engine, dict(op.mesh),
                                      _unshipped(op.batch_sharding))

    def define(self, op: ops.Define) -> str:
        return str(self.functions.define(op.shipped))



    def run_spmd(self, op: ops.RunSpmd) -> ops.ValueInfos:
        fn = self.functions.get(op.function_id)
        key = (op.mesh, op.batch_sharding)
        if key not in self._spmd_views:
            spec = None if op.batch_sharding is None else PartitionSpec(*op.batch_sharding)
            self._spmd_views[key] = GlobalView(self.engine, dict(op.mesh), spec)
        out = self._spmd_views[key].call(fn, self.resolve(op.args), self.resolve(op.kwargs))
        return self.keep(out)


    def distribute_dataset(self, op: ops.DistributeDataset) -> int:
        return self._keep(self.datasets, self.engine.experimental_distribute_dataset(
            _unshipped(op.dataset), _unshipped(op.options)))

    def distribute_datasets_from_function(self, op: ops.DistributeDatasetsFromFunction
                                          ) -> int:
        fn = self.functions.get(op.function_id)
        return self._keep(self.datasets, self.engine.distribute_datasets_from_function(
            fn, _unshipped(op.options)))

    def create_iterator(self, op: ops.CreateIterator) -> int:
        return self._keep(self.iterators, self._dataset(op.dataset_id).iterate(op.steps_per_run))


    def reduce(self, op: ops.Reduce) -> Any:
        value = jax.tree.map(lambda v: v.array if is_global(v) else v,
                             self.resolve(op.value), is_leaf=is_global)
        result = self.engine.reduce(op.reduce_op, value, op.axis)
        return trees.freeze(result, "result") if self.process_id == 0 else None

    def gather_parts(self, op: ops.GatherParts) -> tuple[int, list[Any]]:
        # Streamed parts are views of device memory: the receiver copies them once.
        axis, parts = self.engine.extended.gather_parts(
            self.store.per_replica(op.value.id), op.axis, op.replicas, views=op.streamed,
            padded=op.padded)
        if op.rows is not None:
            parts = [p[op.rows[0]:op.rows[1]] for p in parts]
        return axis, [Streamed(p) for p in parts] if op.streamed else parts

    def fetch_parts(self, op: ops.FetchParts) -> list[np.ndarray]:
        return list(self.engine.extended.padded_parts(self.store.per_replica(op.value.id)))

    def fetch_shards(self, op: ops.FetchShards) -> list[tuple[ops.ShardIndex, np.ndarray]]:
        value = self.store.get(op.value.id)
        if not is_global(value):
            raise TypeError(f"Handle {op.value.id} is a per-replica value, not a global "
                            "array: fetch its replicas' parts instead.")
        array = value.array
        shards = [(_bounds(shard.index, array.shape), shard.data)
                  for shard in array.addressable_shards if shard.replica_id == 0]
        if op.rows is None or not array.shape:
            return [(index, np.asarray(data)) for index, data in shards]
        start, stop = op.rows
        out = []
        for index, data in shards:  # each shard's rows within [start, stop)
            (first, last), rest = index[0], index[1:]
            a, b = max(start, first), min(stop, last)
            if a < b:
                out.append((((a, b), *rest), np.asarray(data[a - first:b - first])))
        return out


    def replica_value(self, op: ops.ReplicaValue) -> Any:
        return trees.freeze(self.engine.extended.replica_value(self.resolve(op.value), op.replica),
                            "state")

    def stats(self, op: ops.Stats) -> ops.HostStats:
        held = self.store.stats()
        busy_s = self._busy.seconds() - self._busy_base
        return ops.HostStats(num_values=held.num_values, device_bytes=held.device_bytes,
                             num_iterators=len(self.iterators), busy_s=busy_s,
                             operations=self._operations,
                             input_wait_s=self.engine.input_wait.seconds(),
                             input_queue_depth=self._prefetched())

    def _prefetched(self) -> int:
        return sum(it.prefetched for it in self.iterators.values())

    def reset_host(self, op: ops.ResetHost) -> ops.HostReset:
        # Functions stay (their jitted programs stay compiled); the figures start over,
        # as ``stats`` describes one holder's use of the slice.
        freed = ops.HostReset(values=self.store.clear(), datasets=len(self.datasets),
                              iterators=len(self.iterators),
                              functions_kept=len(self.functions), pid=os.getpid())
        self.close()  # stops the iterators' infeed threads and the output capture
        self.global_view = None
        # An offset, not a new clock: a new one would leave the old one's thread behind.
        self._busy_base, self._operations = self._busy.seconds(), 0
        self.engine.input_wait.reset()
        self.engine.loop_time.reset()
        return freed

    def capture_output(self, op: ops.CaptureOutput) -> None:
        if op.enabled:
            self._output.start()
        else:
            self._output.stop()

    def take_output(self, op: ops.TakeOutput) -> list[str]:
        return self._output.take()

    def preemption_notices(self, op: ops.PreemptionNotices) -> ops.Notice | None:
        return preemption.notice()

    def host_report(self, op: ops.HostReport) -> ops.HostNews:
        loaded, compiled = compile_cache.programs() or (None, None)
        loop_steps, loop_s = self.engine.loop_time.read()
        return ops.HostNews(
            lines=self._output.take(), input_wait_s=self.engine.input_wait.seconds(),
            input_queue_depth=self._prefetched(), notice=preemption.notice(),
            checkpoint=(self.checkpoints.committed(op.checkpoints)
                        if op.checkpoints is not None else None),
            programs_loaded=loaded, programs_compiled=compiled, loop_steps=loop_steps,
            loop_s=loop_s)

    def save_checkpoint(self, op: ops.SaveCheckpoint) -> None:
        state = self.resolve(op.state)
        position = (self.iterator(op.iterator_id).position if op.iterator_id is not None
                    else None)
        # The operation's number is the same on every host and never used twice.
        self.checkpoints.save(op.directory, op.step, op.keep, state, self.engine.mesh,
                              position, f"jaxpod/checkpoint-input/{self._expected_seq - 1}")

    def wait_checkpoints(self, op: ops.WaitCheckpoints) -> int | None:
        return self.checkpoints.wait(op.directory)

    def restore_checkpoint(self, op: ops.RestoreCheckpoint) -> tuple[ops.ValueInfos, Any]:
        targets = None
        if self.global_view is not None and op.init_function_id is not None:
            targets = self.global_view.abstract_init(self.functions.get(op.init_function_id))
        state, position = self.checkpoints.restore(
            op.directory, op.step, op.keep, op.skeleton, self.engine.mesh,
            self.engine.host_index, targets=targets)
        return self.keep(state), position

    def save_memory_checkpoint(self, op: ops.SaveMemoryCheckpoint) -> None:
        position = (self.iterator(op.iterator_id).position if op.iterator_id is not None
                    else None)
        # The operation's number is the same on every host and never used twice.
        self.memory.save(op.job, op.step, self.resolve(op.state), self.engine.mesh, position,
                         f"jaxpod/memory-checkpoint/{self._expected_seq - 1}",
                         self.checkpoints.storage_program)

    def memory_holdings(self, op: ops.MemoryHoldings) -> dict[int, dict[int, Any]]:
        mesh = (slice_major_mesh(dict(op.mesh), list(self.engine.mesh.devices.flat))
                if op.mesh else self.engine.mesh)
        return self.memory.holdings(op.job, mesh)

    def restore_memory_checkpoint(self, op: ops.RestoreMemoryCheckpoint) -> ops.ValueInfos:
        targets = None
        if self.global_view is not None and op.init_function_id is not None:
            targets = self.global_view.abstract_init(self.functions.get(op.init_function_id))
        return self.keep(self.memory.restore(
            op.job, op.step, op.sources, op.skeleton, self.engine.mesh,
            f"jaxpod/memory-restore/{self._expected_seq - 1}", targets=targets))

    def drop_memory_checkpoints(self, op: ops.DropMemoryCheckpoints) -> None:
        self.memory.drop(op.job)

    def start_profile(self, op: ops.StartProfile) -> None:
        self.profiler.start(f"{op.folder.rstrip('/')}/host-{self.process_id}", op.seconds)

    def stop_profile(self, op: ops.StopProfile) -> list[str]:
        return self.profiler.stop()


def _is_handle(x: Any) -> bool:
    return isinstance(x, Handle)


def _is_value(x: Any) -> bool:
    return is_per_replica(x) or is_global(x)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> ops.ShardIndex:
    """A shard's slices as (start, stop) pairs along every axis."""
    return tuple((int(start), int(stop)) for start, stop, _ in
                 (s.indices(n) for s, n in zip(index, shape, strict=True)))


def _unshipped(value: Any) -> Any:
    """``value``, or what it holds if the client pickled it by value (a dataset, its
    options): the coordinator forwards those bytes without unpickling user code."""
    return load(value) if isinstance(value, ShippedFunction) else value
