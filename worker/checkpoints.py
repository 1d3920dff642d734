"""A job's checkpoints, written and read by the hosts with orbax.

Each host of a slice keeps one orbax ``CheckpointManager`` per job directory
(``<checkpoint dir>/<job id>``); every host calls it in the same operation, so orbax's
multi-host protocol runs as it does in any ``jax.distributed`` program: each host writes
its own shards, asynchronously (the next loops run while bytes go to storage), the
step's directory is finalized once every host is done, and a crash at any moment leaves
the previous step the latest one. Nothing passes through the coordinator.

A per-replica state's save costs the step loop one small program: it lays the stored
leaves out in fresh device buffers, which the next loop cannot touch, and orbax's save
call (its copy to host memory, its barriers, its directories) runs on this host's
checkpoint thread while the next loops compute. orbax's barriers then go through the
``jax.distributed`` coordination service rather than a device collective (two threads'
collectives, issued in different orders on different hosts, would deadlock). A
global-view state is saved from its live arrays, which the next loop donates: its save
call returns once orbax copied them off the devices.

A checkpoint step holds two items:

* ``state``: the job's state as the user's pytree (orbax's standard pytree format),
  each leaf one replica's copy, of the state's own shape, split over the replicas
  (:class:`Layout`): per-replica jobs train mirrored state, so each device takes its
  replica's part of its own copy, with no transfer, and every byte is written once.
  Typed PRNG keys are saved as their key data. No sharding file is written (it names
  the slice's devices, and orbax refuses to restore it without a target on any other
  topology), so ``orbax.checkpoint.StandardCheckpointer().restore(path)`` reads it in
  any process, as numpy arrays.
* ``meta`` (JSON, written by host 0): each leaf's shape, dtype, partitioning within a
  replica and key implementation, and each host's input position at the step.

A resumed attempt restores each leaf straight onto its devices, each device reading
its replica's part, and gathers the parts over the replicas on device; the state's
frozen structure (:mod:`jaxpod.trees`), which the coordinator keeps, gives the tree.

A global-view job's state (:mod:`jaxpod.worker.global_view`) is saved as it is: each
leaf a global array with the sharding ``init_fn`` gave it, each host writing the shards
it holds (orbax writes a replicated shard once), and restored onto the shardings the
attempt's ``init_fn`` gives, without running it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod import settings, trees
from jaxpod.values import PerReplica, is_per_replica
from jaxpod.worker.global_view import GlobalValue, is_global
from jaxpod.worker.program_cache import ProgramCache

logger = logging.getLogger(__name__)

#: The item names of a step's directory.
STATE, META = "state", "meta"
#: The meta item's format.
META_VERSION = 1
#: How long a host's checkpoint thread waits for the other hosts' input positions (a
#: lost host resets the slice well before).
PEER_TIMEOUT = settings.CHECKPOINT_PEER_TIMEOUT
#: The most bytes of one stored chunk (orbax splits larger shards): whoever reads the
#: checkpoint back in blocks, as the coordinator streams a job's result, holds no more.
CHUNK_BYTES = 4 * 1024 * 1024
#: Compiled layout changes kept per host (one each way per state structure saved).
_PROGRAMS = 32
#: A job folder's record of the steps its forks still read, ``{fork: step}``: the
#: coordinator writes it; the hosts' clean-up never deletes a step it lists.
FORK_PINS = "fork-pins.json"


@dataclass(frozen=True)
class LeafSpec:
    """How one state leaf is kept: one replica's shape and dtype (a key's data's for a
    typed key), its partitioning over the replica's logical devices (``None`` per axis
    unless the step shards it) and the key implementation for a typed key (``None``:
    an array)."""

    shape: tuple[int, ...]
    dtype: str
    spec: tuple[Any, ...]
    key_impl: str | None

    def as_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype,
                "spec": [list(s) if isinstance(s, tuple) else s for s in self.spec],
                "key_impl": self.key_impl}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LeafSpec:
        return cls(tuple(raw["shape"]), str(raw["dtype"]),
                   tuple(tuple(s) if isinstance(s, list) else s for s in raw["spec"]),
                   raw["key_impl"])


class Layout:
    """Where a checkpoint's leaves live on one slice's mesh (the engine's: the replica
    axis first, then the axes of a replica's logical devices).

    Stored, a leaf is one replica's copy split over the replicas along its first axis
    the replicas divide (that a step does not shard already): each device holds and
    writes only its replica's part, so a save copies ``1/replicas`` of the state on
    device and every byte is written once. A leaf no axis of which divides (a scalar, a
    small odd vector) is kept whole on every device (orbax writes one copy).

    Restored on accelerators (``gather``), each device reads only its replica's part
    and the parts are gathered over the replicas on device: the slice reads the state
    from storage once and sends each chip ``1/replicas`` of it over the host link,
    where reading the whole copy onto every chip would read it once per host and send
    every chip all of it. Simulated chips (CPU devices) share the host's memory, and
    their cross-process gather runs over TCP: each reads its whole copy instead.

    Args:
      mesh: the engine's mesh.
      gather: restore by gathering parts on device (default: unless the devices
        are CPUs).
    """

    def __init__(self, mesh: Any, gather: bool | None = None) -> None:
        self.mesh = mesh
        self.replica_axis = str(mesh.axis_names[0])
        self.replicas = int(mesh.shape[self.replica_axis])
        self.gather = (gather if gather is not None
                       else mesh.devices.flat[0].platform != "cpu")

    def split_axis(self, leaf: LeafSpec) -> int | None:
        """The axis ``leaf`` is split along over the replicas (``None``: kept whole)."""
        for axis, (size, entry) in enumerate(zip(leaf.shape, self.spec(leaf), strict=True)):
            if entry is None and size >= self.replicas and size % self.replicas == 0:
                return axis
        return None

    def spec(self, leaf: LeafSpec) -> tuple[Any, ...]:
        """``leaf``'s partitioning within a replica, for axes this mesh has."""
        names = set(self.mesh.axis_names)
        return tuple(e if e is None or set(e if isinstance(e, tuple) else (e,)) <= names
                     else None for e in leaf.spec)

    def stored(self, leaf: LeafSpec) -> NamedSharding:
        """The sharding ``leaf`` is saved from and restored to."""
        spec = list(self.spec(leaf))
        axis = self.split_axis(leaf)
        if axis is not None:
            spec[axis] = self.replica_axis
        return NamedSharding(self.mesh, P(*spec))

    def per_replica(self, leaf: LeafSpec) -> NamedSharding:
        """The sharding of ``leaf``'s data as a per-replica value."""
        return NamedSharding(self.mesh, P(self.replica_axis, *self.spec(leaf)))

    def restored(self, leaf: LeafSpec) -> NamedSharding:
        """The sharding orbax restores ``leaf`` to: its parts (``gather``) or a whole
        copy on every device."""
        if self.gather:
            return self.stored(leaf)
        return NamedSharding(self.mesh, P(*self.spec(leaf)))

    def target(self, leaf: LeafSpec) -> jax.ShapeDtypeStruct:
        """What orbax restores ``leaf`` as."""
        return jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype),
                                    sharding=self.restored(leaf))

    def leaf_spec(self, value: PerReplica) -> LeafSpec:
        """How a per-replica value is kept."""
        array, key_impl = value.array, None
        if trees.is_typed_key(array):
            key_impl = str(jax.random.key_impl(array))
        data = jax.eval_shape(jax.random.key_data, array) if key_impl else array
        sharding = array.sharding
        spec: tuple[Any, ...] = ()
        if (isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh
                and tuple(sharding.spec)[:1] == (self.replica_axis,)):
            spec = tuple(sharding.spec)[1:]
        spec += (None,) * (data.ndim - 1 - len(spec))
        return LeafSpec(tuple(data.shape[1:]), str(data.dtype), spec, key_impl)

    def to_storage(self, leaves: tuple[LeafSpec, ...]) -> Any:
        """One compiled program: per-replica values (typed keys as keys) -> their stored
        arrays. No communication: each device takes its part of its own copy (jobs
        train mirrored state: every replica's copy is the same)."""
        def body(*xs: jax.Array) -> list[jax.Array]:
            r = jax.lax.axis_index(self.replica_axis)
            out = []
            for leaf, x in zip(leaves, xs, strict=True):
                x = x[0]
                axis = self.split_axis(leaf)
                if axis is not None:
                    part = leaf.shape[axis] // self.replicas
                    x = jax.lax.dynamic_slice_in_dim(x, r * part, part, axis=axis)
                out.append(x)
            return out

        split = jax.shard_map(body, mesh=self.mesh, check_vma=False,
                              in_specs=tuple(self.per_replica(f).spec for f in leaves),
                              out_specs=[self.stored(f).spec for f in leaves])

        def program(*values: jax.Array) -> list[jax.Array]:
            return split(*[jax.random.key_data(v) if leaf.key_impl else v
                           for leaf, v in zip(leaves, values, strict=True)])

        return jax.jit(program)

    def from_storage(self, leaves: tuple[LeafSpec, ...]) -> Any:
        """One compiled program: restored arrays -> per-replica values (typed keys
        wrapped again), each replica's copy gathered over the replicas on device if
        its parts were restored."""
        def body(*xs: jax.Array) -> list[jax.Array]:
            out = []
            for leaf, x in zip(leaves, xs, strict=True):
                axis = self.split_axis(leaf)
                if self.gather and axis is not None:
                    x = jax.lax.all_gather(x, self.replica_axis, axis=axis, tiled=True)
                out.append(x[None])
            return out

        gather = jax.shard_map(body, mesh=self.mesh, check_vma=False,
                               in_specs=tuple(self.restored(f).spec for f in leaves),
                               out_specs=[self.per_replica(f).spec for f in leaves])

        def program(*stored: jax.Array) -> list[jax.Array]:
            return [jax.random.wrap_key_data(v, impl=leaf.key_impl) if leaf.key_impl
                    else v for leaf, v in zip(leaves, gather(*stored), strict=True)]

        # The restored arrays are given up: a whole copy becomes its replica's value in
        # place (the added axis is only a new shape), not copied.
        return jax.jit(program, donate_argnums=tuple(range(len(leaves))))


def _position_of(inputs: Sequence[Any], host: int, hosts: int, step: int) -> Any:
    """Host ``host``'s input position in a checkpoint whose hosts saved ``inputs``.
    On as many hosts as saved it, each takes its own; on another number (an elastic
    job moved to another slice type) every host takes the one position they all saved
    (each host reads the whole stream of global batches, so they agree), and hosts
    that each read their own input cannot move."""
    if len(inputs) == hosts or not inputs:
        return inputs[host] if host < len(inputs) else None
    if any(p != inputs[0] for p in inputs):
        raise ValueError(
            f"Checkpoint step {step} holds the input positions of {len(inputs)} hosts that "
            f"each read their own input (dataset_fn); this slice has {hosts} hosts, and a "
            "host's position means nothing on another number of hosts. Resume it on a "
            f"slice of {len(inputs)} hosts, or use dataset= (global batches) for a job that "
            "moves between slice types.")
    return inputs[0]


def global_leaf(value: GlobalValue) -> LeafSpec:
    """How a global-view state leaf is kept: its global shape (typed keys as key data)."""
    array, key_impl = value.array, None
    if trees.is_typed_key(array):
        key_impl = str(jax.random.key_impl(array))
        array = jax.eval_shape(jax.random.key_data, array)
    return LeafSpec(tuple(array.shape), str(array.dtype), (None,) * array.ndim, key_impl)


def _exchanged(position: Any, key: str) -> list[Any] | None:
    """Every host's ``position`` (JSON), in process order, on process 0 (orbax's primary
    host, the one that writes the meta item; ``None`` elsewhere), through the
    ``jax.distributed`` key-value store: no device collective, so a checkpoint thread
    may ask while the step loop runs its own, and one read per host, not per pair.
    Process 0 deletes the keys once read."""
    if jax.process_count() == 1:
        return [position]
    from jax._src.distributed import global_state  # the client orbax's barriers use too

    client = global_state.client
    assert client is not None, "several processes share jax.distributed's client"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(position))
    if jax.process_index() != 0:
        return None
    limit_ms = int(PEER_TIMEOUT.seconds() * 1000)
    positions = [json.loads(client.blocking_key_value_get(f"{key}/{host}", limit_ms))
                 for host in range(jax.process_count())]
    # Each key is read once: deleting them keeps the coordination service's store from
    # growing by hosts x saves over a long job.
    client.key_value_delete(key)  # the folder: every host's key under it
    return positions


@functools.cache
def _barriers_on_the_coordination_service() -> None:
    """Makes orbax synchronise hosts through ``jax.distributed``'s coordination service
    (its ``experimental_orbax_use_distributed_barrier`` flag) instead of a device
    collective, so a save call can run beside the step loop's own collectives. Its
    barriers also time out instead of waiting for ever on a lost host."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost  # defines the flag

    if not flags.FLAGS.is_parsed():  # a worker has no command line of absl flags
        flags.FLAGS(["jaxpod-host-worker"], known_only=True)
    flags.FLAGS.set_default(multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name, True)


def pinned_steps(directory: str) -> set[int] | None:
    """The steps of ``directory`` (a job's checkpoint folder) its forks still read;
    ``None`` when the record exists but cannot be read (then nothing may be deleted)."""
    from etils import epath

    path = epath.Path(directory) / FORK_PINS
    try:
        if not path.exists():
            return set()
        return {int(step) for step in json.loads(path.read_text()).values()}
    except Exception as e:  # unreadable: keep every step rather than a fork's
        logger.warning("cannot read %s (%s: %s); no checkpoint of it is deleted this time",
                       path, type(e).__name__, e)
        return None


@dataclass(frozen=True)
class _ForkPinned:
    """orbax's preservation policy for the steps a fork still reads (:data:`FORK_PINS`),
    read at each clean-up: a fork may be made from a running job's checkpoint."""

    directory: str

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        pinned = pinned_steps(self.directory)
        return [pinned is None or info.step in pinned for info in checkpoints]


def _preservation(directory: str, keep: int) -> Any:
    """The newest ``keep`` steps, and any step a fork reads."""
    from orbax.checkpoint import checkpoint_managers as managers

    return managers.AnyPreservationPolicy([
        managers.preservation_policy.LatestN(keep), _ForkPinned(directory)])


def _save_args() -> Any:
    import orbax.checkpoint as ocp

    return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)


def _state_handler() -> Any:
    """The state item's orbax handler: the standard pytree format, its arrays written
    without a sharding file."""
    import orbax.checkpoint as ocp

    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(enable_write_sharding_file=False)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class HostCheckpoints:
    """This host's checkpoint managers, one per job directory. Every method is called
    on every host of the slice in the same operation (orbax synchronises them)."""

    def __init__(self) -> None:
        self._managers: dict[str, Any] = {}
        self._committed: dict[str, int] = {}  # directory -> newest step known committed
        #: Compiled layout changes, kept for the slice's next holders as the engine's
        #: programs are: a warm slice's next job with the same state compiles none.
        self._programs = ProgramCache(_PROGRAMS)
        self._lock = threading.Lock()
        # orbax's save calls of per-replica states, in order, beside the step loop;
        # directory -> the one under way (its error is raised by the next call).
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="jaxpod-checkpoint-save")
        self._saving: dict[str, Future[None]] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="jaxpod-checkpoint-compile")

    def _program(self, to_storage: bool, layout: Layout, leaves: tuple[LeafSpec, ...]
                 ) -> Any:
        def build() -> Any:
            if to_storage:
                return layout.to_storage(leaves)
            # Compiled for the arrays orbax restores, while it reads them.
            return layout.from_storage(leaves).lower(
                *[layout.target(leaf) for leaf in leaves]).compile()

        return self._programs.get((to_storage, layout.mesh, layout.gather, leaves), build)

    def storage_program(self, layout: Layout, leaves: tuple[LeafSpec, ...]) -> Any:
        """The compiled change of per-replica values to their stored layout (what the
        in-memory tier keeps, too)."""
        return self._program(True, layout, leaves)

    def _manager(self, directory: str, keep: int) -> Any:
        import orbax.checkpoint as ocp

        _barriers_on_the_coordination_service()
        with self._lock:
            manager = self._managers.get(directory)
            if manager is None:
                manager = self._managers[directory] = ocp.CheckpointManager(
                    directory, options=ocp.CheckpointManagerOptions(
                        preservation_policy=_preservation(directory, keep),
                        enable_async_checkpointing=True, create=True),
                    item_handlers={STATE: _state_handler(),
                                   META: ocp.JsonCheckpointHandler()})
            return manager

    def save(self, directory: str, step: int, keep: int, state: Any, mesh: Any,
             position: Any, exchange: str) -> None:
        """Starts writing ``state`` (the user's tree of per-replica or global values) as
        step ``step``. Returns once the stored leaves are laid out in their own device
        buffers (per-replica: orbax's save call follows on the checkpoint thread) or
        off the devices (global values). ``position``: this host's input position at
        the step (JSON), which the hosts exchange under the key ``exchange`` (the same
        on every host, used once)."""
        import orbax.checkpoint as ocp

        values, treedef = jax.tree.flatten(
            state, is_leaf=lambda x: is_per_replica(x) or is_global(x))
        if values and all(isinstance(v, GlobalValue) for v in values):
            leaves = tuple(global_leaf(v) for v in values)
            stored = [jax.random.key_data(v.array) if leaf.key_impl else v.array
                      for leaf, v in zip(leaves, values, strict=True)]
        elif all(isinstance(v, PerReplica) for v in values):
            layout = Layout(mesh)
            leaves = tuple(layout.leaf_spec(v) for v in values)
            stored = (self._program(True, layout, leaves)(*[v.array for v in values])
                      if leaves else [])
        else:
            raise TypeError("A job's state must hold only values on the slice.")
        state_item = (ocp.args.PyTreeSave(
            jax.tree.unflatten(treedef, stored),
            save_args=jax.tree.unflatten(treedef, [_save_args()] * len(stored))) if leaves
            else None)  # a job without state keeps only its input positions
        self._settle(directory)
        manager = self._manager(directory, keep)
        start = functools.partial(self._start, directory, manager, step, leaves, state_item,
                                  position, exchange)
        if isinstance(values[0] if values else None, GlobalValue):  # the live arrays
            start()
        else:  # fresh buffers: saved beside the next loops
            self._saving[directory] = self._saver.submit(start)

    def _start(self, directory: str, manager: Any, step: int, leaves: Sequence[LeafSpec],
               state_item: Any, position: Any, exchange: str) -> None:
        """orbax's save call, with every host's input position: returns once the bytes
        are in host memory."""
        import orbax.checkpoint as ocp

        meta = {"version": META_VERSION, "leaves": [leaf.as_json() for leaf in leaves],
                "input": _exchanged(position, exchange)}
        items = {META: ocp.args.JsonSave(meta)}
        if state_item is not None:
            items[STATE] = state_item
        args = ocp.args.Composite(**items)
        # orbax writes one step at a time: the previous one is committed first (or
        # its error raised here), and stays the newest committed while this one goes.
        manager.wait_until_finished()
        manager.check_for_errors()
        latest = manager.latest_step()
        if latest is not None:
            self._committed[directory] = int(latest)
        manager.save(step, args=args)

    def _settle(self, directory: str) -> None:
        """Waits for the save call under way under ``directory``; raises its error."""
        saving = self._saving.pop(directory, None)
        if saving is not None:
            # bounded: the coordinator's operation time-out resets a stuck slice
            saving.result()

    def committed(self, directory: str) -> int | None:
        """The newest step every host committed (``None``: none yet; a step being
        written is not). Raises what a failed asynchronous write raised."""
        manager = self._managers.get(directory)
        if manager is None:
            return None
        saving = self._saving.get(directory)
        if saving is not None and not saving.done():
            return self._committed.get(directory)
        self._settle(directory)
        manager.check_for_errors()
        if manager.is_saving_in_progress():
            return self._committed.get(directory)
        step = manager.latest_step()
        return None if step is None else int(step)

    def wait(self, directory: str) -> int | None:
        """Waits until the writes under way are committed; the newest step."""
        manager = self._managers.get(directory)
        if manager is None:
            return None
        self._settle(directory)
        manager.wait_until_finished()
        return self.committed(directory)

    def restore(self, directory: str, step: int, keep: int, skeleton: Any, mesh: Any,
                host: int, gather: bool | None = None,
                targets: Sequence[jax.ShapeDtypeStruct] | None = None) -> tuple[Any, Any]:
        """Step ``step``'s state onto this slice's devices, as the user's tree of
        per-replica values (``skeleton``: the state's frozen structure with each
        leaf's index), and this host's input position at the step (``keep``: as for
        :meth:`save`, which the attempt calls next; ``gather``: see :class:`Layout`).
        With ``targets`` (a global-view state: each leaf's shape, dtype and sharding,
        in leaf order), the leaves are global values with those shardings."""
        import orbax.checkpoint as ocp

        self._settle(directory)
        manager = self._manager(directory, keep)
        meta = manager.restore(step, args=ocp.args.Composite(
            **{META: ocp.args.JsonRestore()}))[META]
        position = _position_of(meta.get("input") or [], host, jax.process_count(), step)
        specs = [LeafSpec.from_json(raw) for raw in meta["leaves"]]
        if not specs:  # a job without state
            return (), position
        if targets is not None:
            return self._restore_global(manager, step, skeleton, specs, targets), position
        layout = Layout(mesh, gather)
        leaves = tuple(specs[i] for i in jax.tree.leaves(skeleton))
        # A fresh worker compiles the layout change while orbax reads, not after.
        program = self._compiler.submit(self._program, False, layout, leaves)
        abstract = trees.thaw(skeleton, lambda i: layout.target(specs[i]))
        restore = ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        restored = manager.restore(step, args=ocp.args.Composite(**{STATE: restore}))[STATE]
        stored, treedef = jax.tree.flatten(restored)
        # bounded: a compile, under the coordinator's operation time-out
        values = program.result()(*stored)
        return jax.tree.unflatten(treedef, [PerReplica(v) for v in values]), position

    @staticmethod
    def _restore_global(manager: Any, step: int, skeleton: Any, specs: Sequence[LeafSpec],
                        targets: Sequence[jax.ShapeDtypeStruct]) -> Any:
        import orbax.checkpoint as ocp

        if len(targets) != len(specs):
            raise ValueError(
                f"Checkpoint step {step} holds {len(specs)} state leaves; init_fn now makes "
                f"{len(targets)}. The job's code changed since it was saved: resume it "
                "with the code that wrote it.")

        def target(i: int) -> jax.ShapeDtypeStruct:
            spec, want = specs[i], targets[i]
            data = (jax.eval_shape(jax.random.key_data, want) if spec.key_impl else want)
            if tuple(data.shape) != spec.shape or str(data.dtype) != spec.dtype:
                raise ValueError(
                    f"Checkpoint step {step}'s state leaf {i} is {spec.dtype}{list(spec.shape)}; "
                    f"init_fn now makes {data.dtype}{list(data.shape)}. The job's code changed "
                    "since it was saved: resume it with the code that wrote it.")
            return jax.ShapeDtypeStruct(spec.shape, np.dtype(spec.dtype), sharding=want.sharding)

        abstract = trees.thaw(skeleton, target)
        restore = ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        restored = manager.restore(step, args=ocp.args.Composite(**{STATE: restore}))[STATE]
        stored, treedef = jax.tree.flatten(restored)
        order = jax.tree.leaves(skeleton)
        values = [GlobalValue(jax.random.wrap_key_data(v, impl=specs[i].key_impl)
                              if specs[i].key_impl else v)
                  for i, v in zip(order, stored, strict=True)]
        return jax.tree.unflatten(treedef, values)

    def close(self) -> None:
        """Waits for every write under way, then closes the managers."""
        with self._lock:
            managers, self._managers = list(self._managers.values()), {}
            saving, self._saving = list(self._saving.values()), {}
            self._committed.clear()
        for call in saving:
            try:  # bounded: a stuck worker is killed after JAXPOD_WORKER_STOP_TIMEOUT_S
                call.result()
            except Exception as e:
                logger.warning("a checkpoint's save call failed: %s", e)
        for manager in managers:
            try:
                manager.wait_until_finished()
                manager.close()
            except Exception as e:  # the next holder must not inherit it
                logger.warning("closing a checkpoint manager failed: %s", e)
