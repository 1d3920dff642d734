"""The engine's footing: its replicas on the devices and hosts, and values moved
between this host and global arrays.

:class:`EngineCore` is what every part of :class:`~jaxpod.worker.engine.Engine` stands
on: the device assignment and its mesh, which replicas this host holds, the cache of
compiled programs, mirrored values (and mirrored values broadcast to every replica),
this host's rows assembled into global arrays, and small gathers over all hosts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod import trees
from jaxpod.values import PerReplica
from jaxpod.worker import input as input_lib
from jaxpod.worker.device_assignment import DeviceAssignment
from jaxpod.worker.infeed import InputWait
from jaxpod.worker.program_cache import ProgramCache
from jaxpod.worker.replica_context import REPLICA_AXIS

#: What a step's argument or output may be besides a ``PerReplica`` value: an array
#: (numpy or jax) or a Python number, which every replica gets unchanged.
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
_COMPILE_CACHE_SIZE = 256
_T = TypeVar("_T")


class LoopTime:
    """The steps this host ran in loops whose end it waited for, and the seconds from
    each loop's start to its outputs computed: a job's runner compares its hosts by
    them (a straggler's are longer). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = 0
        self._seconds = 0.0

    def add(self, steps: int, seconds: float) -> None:
        with self._lock:
            self._steps += steps
            self._seconds += seconds

    def read(self) -> tuple[int, float]:
        """The steps and seconds so far."""
        with self._lock:
            return self._steps, self._seconds

    def reset(self) -> None:
        with self._lock:
            self._steps, self._seconds = 0, 0.0


class EngineCore:
    """An engine's devices, replicas and hosts, its program cache, and the moving of
    values between this host and global arrays (see the module's docstring).

    Args:
      device_assignment: which devices form each replica; ``None`` uses every device
        this process sees, one device per replica.
      steps_per_run: default number of steps ``run_steps`` runs per call.
    """

    def __init__(self, device_assignment: DeviceAssignment | None = None,
                 steps_per_run: int = 1) -> None:
        if not isinstance(steps_per_run, int) or steps_per_run < 1:
            raise ValueError(f"steps_per_run must be a positive int. Got {steps_per_run!r}.")
        self.device_assignment = device_assignment or DeviceAssignment.build()
        self.steps_per_run = steps_per_run
        self.mesh = self.device_assignment.spmd_mesh
        self._replica_sharding = NamedSharding(self.mesh, P(REPLICA_AXIS))
        self._replicated = NamedSharding(self.mesh, P())
        per_host, self.host_index, self.local_replicas = _host_layout(
            self.device_assignment.replica_devices)
        self.num_hosts = len(per_host)
        self.host_replicas = input_lib.HostReplicas(
            self.local_replicas[0], len(self.local_replicas), self.num_replicas_in_sync,
            min(per_host))
        self._compiled = ProgramCache(_COMPILE_CACHE_SIZE)
        self._full_counts: dict[int, jax.Array] = {}
        #: The time this engine's iterators waited for their input (every infeed's).
        self.input_wait = InputWait()
        #: This host's loops run to their end (``RunSteps`` with ``wait``).
        self.loop_time = LoopTime()

    # ----------------------------------------------------------------- properties
    @property
    def num_replicas_in_sync(self) -> int:
        return self.device_assignment.num_replicas

    @property
    def _num_local_replicas(self) -> int:
        return len(self.local_replicas)

    # ----------------------------------------------------- programs, mirrored values
    def _cached(self, key: Hashable, build: Callable[[], _T]) -> _T:
        return self._compiled.get(key, build)

    def _check_own(self, what: str, where: str, value: PerReplica) -> None:
        if value.num_replicas != self.num_replicas_in_sync:
            raise ValueError(
                f"{what}: {where} is a PerReplica value of {value.num_replicas} replicas, but "
                f"this strategy has {self.num_replicas_in_sync}. Values cannot move between "
                "strategies of different sizes."
            )

    def _mirrored(self, leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            if leaf.sharding == self._replicated:
                return leaf
            if self.num_hosts == 1 or not leaf.is_fully_addressable:
                return jax.device_put(leaf, self._replicated)
            # Every host holds this value (a typed key made from a client's argument):
            # the global array is built from each host's copy.
            data, readable = host_readable(leaf)
            return readable(self._mirrored(np.asarray(data)))
        if self.num_hosts > 1 and np.ndim(leaf):
            arr = np.asarray(leaf)
            return jax.make_array_from_callback(arr.shape, self._replicated, lambda i: arr[i])
        return leaf

    def _broadcast(self, leaf: Any) -> jax.Array:
        """A mirrored value as a per-replica one (each replica gets a copy)."""
        n = self.num_replicas_in_sync
        broadcast = self._cached(("broadcast",), lambda: jax.jit(
            lambda a: jnp.broadcast_to(a, (n, *a.shape)), out_shardings=self._replica_sharding))
        return broadcast(self._mirrored(leaf))

    # -------------------------------------------------- host-local <-> global data
    def _local_slice(self) -> slice:
        return slice(self.local_replicas[0], self.local_replicas[-1] + 1)

    def _to_global(self, local: np.ndarray) -> jax.Array:
        """Assembles this host's replicas' rows (leading axis) into a global array."""
        if self.num_hosts == 1:
            # A copy XLA owns: a CPU buffer aliasing the numpy rows would give them back
            # from XLA's threads, taking the GIL, which aborts the process at exit.
            return jax.device_put(local, self._replica_sharding, may_alias=False)
        global_shape = (self.num_replicas_in_sync, *local.shape[1:])
        return jax.make_array_from_process_local_data(self._replica_sharding, local,
                                                      global_shape)

    def _allgather_json(self, value: Any) -> list[Any]:
        """Every host's ``value`` (small, JSON-serializable), in host order."""
        if self.num_hosts == 1:
            return [value]
        data = np.frombuffer(json.dumps(value).encode(), np.uint8)
        sizes = self._allgather_host(np.array([data.size], np.int32))
        # Hosts' texts differ in length; padded to a power of two, so the gather's
        # program is compiled again only when the longest text doubles.
        padded = np.zeros(1 << max(6, int(sizes.max() - 1).bit_length()), np.uint8)
        padded[:data.size] = data
        texts = np.asarray(multihost_utils.process_allgather(padded, tiled=False))
        return [json.loads(texts[h, :n].tobytes()) for h, n in enumerate(sizes)]

    def _allgather_host(self, local: np.ndarray) -> np.ndarray:
        """Concatenates a small host-local array over hosts, in replica order."""
        if self.num_hosts == 1:
            return local
        return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def host_readable(array: jax.Array) -> tuple[jax.Array, Callable[[Any], Any]]:
    """``array`` in a form numpy can read, and what turns such host data back: typed PRNG
    keys are read as their key data and wrapped again."""
    if not trees.is_typed_key(array):
        return array, lambda host: host
    impl = str(jax.random.key_impl(array))
    return jax.random.key_data(array), lambda host: jax.random.wrap_key_data(host, impl=impl)


def _host_layout(replica_devices: np.ndarray) -> tuple[list[int], int, tuple[int, ...]]:
    """(replicas of each host, this host's index, this host's replicas) of an assignment.

    Hosts are the processes that own replicas, in replica order; each replica must sit
    on one host and each host's replicas must be contiguous and in process order.
    """
    owners = []
    for r, devices in enumerate(replica_devices):
        procs = {d.process_index for d in devices}
        if len(procs) != 1:
            raise ValueError(
                f"Replica {r} spans processes {sorted(procs)}; every replica's logical "
                "devices must belong to one host. Use a computation_shape within a host."
            )
        owners.append(procs.pop())
    hosts = sorted(set(owners))
    if owners != sorted(owners):
        raise ValueError(
            f"Replicas must be ordered by host (process index); got owners {owners}."
        )
    me = jax.process_index()
    local = tuple(r for r, p in enumerate(owners) if p == me)
    if not local:
        raise ValueError(f"Process {me} owns no replica of this device assignment.")
    return [owners.count(h) for h in hosts], hosts.index(me), local
