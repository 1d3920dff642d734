"""A job's in-memory checkpoints: the fast tier beside orbax's persistent one.

Every ``memory_checkpoint_every`` steps each host keeps its shards of the state in its
node's memory and sends a copy to a peer host, which keeps it the same way:

* **Where.** A folder on the node's RAM disk (``JAXPOD_MEMORY_CHECKPOINT_DIR``, default
  ``/dev/shm/jaxpod-memory``), named by the node's slice and worker index (``TPU_NAME``,
  ``TPU_WORKER_ID``). It outlives the worker process, which the slice restarts when any
  host is lost, and goes with the node: a host restarted on its node finds its own
  shards; one whose node was replaced finds nothing.
* **What.** A mirrored per-replica state (every replica trains the same copy; no leaf
  split within a replica) is kept once per host, each chip taking its part of its own
  replica's copy (:class:`MirroredLayout`): a host's copy is every host's, so nothing
  is sent at a save and the peer keeps only its neighbour's input position (an alias of
  its own copy). A restore reads the host's copy onto its chips and gathers the parts
  over them: no other host is involved. Other states (global-view leaves, per-replica
  leaves split within a replica: the persistent tier's stored layout) are each host's
  own shards, and the peer keeps a copy.
* **The peer.** The next host of the slice, or with several slices the same host of the
  next slice (a lost slice then loses no copy). A copy travels as one device
  collective (``ppermute``) of one byte buffer per device (:class:`Packing`), over the
  links the steps use: no port, no service, nothing through the coordinator. Each host
  sends ``1/hosts`` of the state whatever the pod's size.
* **Off the step path.** The step loop only dispatches the programs; the bytes leave
  the devices and reach the RAM disk on this host's writer thread beside the next loops,
  which also gives the peer this host's input position (the ``jax.distributed``
  key-value store). One write is under way at a time and one more may wait: a save
  waits only when the writer is two saves behind.
* **Restore.** The coordinator asks every host what it holds (:meth:`holdings`) and
  restores the newest step every host's shards of which are held somewhere
  (:mod:`jaxpod.service.jobs.memory_plan`): on the host's own node, where each host reads
  its own (mapped, not copied, into the devices' buffers), or on its peer's, which
  sends them back in one collective. Otherwise the job reads its persistent checkpoint.

On the RAM disk, ``<node>/<job>/step-<S>/host-<g>/`` holds host ``g``'s blocks, each
distinct block once (a replicated leaf once per host, not once per chip), and
``meta.json``, written last: a folder without it is never read.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod import settings, trees
from jaxpod.errors import JaxpodError
from jaxpod.values import PerReplica, is_per_replica
from jaxpod.worker.checkpoints import Layout, LeafSpec, global_leaf
from jaxpod.worker.global_view import GlobalValue, is_global
from jaxpod.worker.program_cache import ProgramCache

logger = logging.getLogger(__name__)

MEMORY_DIR = settings.MEMORY_CHECKPOINT_DIR
#: How long a host waits for its peer's input position (a lost host resets the slice
#: well before).
PEER_TIMEOUT = settings.CHECKPOINT_PEER_TIMEOUT
#: A job folder on a node not written for this long belongs to a job that is gone (one
#: that failed, or moved to another slice), and how often a host looks for them.
STALE_AFTER_S = 24 * 3600.0
SWEEP_EVERY_S = 3600.0
#: Writes a host may have submitted at once (one under way, the rest waiting).
WRITES_AHEAD = 2
_META, _BLOCKS, _FORMAT = "meta.json", "blocks.bin", 1
_PROGRAMS = 16


class MemoryCheckpointError(JaxpodError, RuntimeError):
    """The state cannot be kept in memory (its leaves are not laid out on one mesh), or
    a memory checkpoint could not be restored; the persistent tier goes on."""


def node_folder() -> Path:
    """This node's folder of in-memory checkpoints."""
    root = MEMORY_DIR.value() or (
        "/dev/shm/jaxpod-memory" if os.path.isdir("/dev/shm")
        else os.path.join(tempfile.gettempdir(), "jaxpod-memory"))
    node = os.environ.get("TPU_NAME") or socket.gethostname()
    return Path(root) / f"{node}-{os.environ.get('TPU_WORKER_ID', '0')}"


# ---------------------------------------------------------------- the packing
@dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sharding: NamedSharding
    block: tuple[int, ...]
    nbytes: int


def _to_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(raw: jax.Array, leaf: _Leaf) -> jax.Array:
    dtype = np.dtype(np.uint8) if leaf.dtype == np.bool_ else leaf.dtype
    shape = leaf.block + ((dtype.itemsize,) if dtype.itemsize > 1 else ())
    x = jax.lax.bitcast_convert_type(raw.reshape(shape), dtype)
    return x.astype(jnp.bool_) if leaf.dtype == np.bool_ else x


class Packing:
    """Arrays laid out on one mesh as one byte buffer per device: device ``i`` (in the
    mesh's device order) holds its block of every leaf, in leaf order. The buffers form
    one global ``uint8`` array of shape ``(devices, bytes)`` split over every axis."""

    def __init__(self, mesh: Any, leaves: Sequence[tuple[tuple[int, ...], Any, Any]]) -> None:
        self.mesh = mesh
        self.axes = tuple(mesh.axis_names)
        self.devices = list(mesh.devices.flat)
        self.leaves: list[_Leaf] = []
        for shape, dtype, sharding in leaves:
            if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
                raise MemoryCheckpointError(
                    f"a state leaf of shape {tuple(shape)} is laid out by {sharding}, not on "
                    "the job's mesh: in-memory checkpoints need every leaf on one mesh")
            block = tuple(sharding.shard_shape(tuple(shape)))
            dtype = np.dtype(dtype)
            self.leaves.append(_Leaf(tuple(shape), dtype, sharding, block,
                                     int(np.prod(block, dtype=np.int64)) * dtype.itemsize))
        self.offsets = [int(o) for o in np.cumsum([0] + [f.nbytes for f in self.leaves])]
        self.total = max(1, self.offsets[-1])
        self.buffers = NamedSharding(mesh, P(self.axes))
        self._maps: dict[int, Any] = {}

    def local(self, process: int) -> list[int]:
        """The positions of ``process``'s devices in the mesh's device order."""
        return [i for i, d in enumerate(self.devices) if d.process_index == process]

    def bounds(self, leaf: int, position: int) -> list[list[int]]:
        """Leaf ``leaf``'s block on the device at ``position``: (start, stop) per axis."""
        f = self.leaves[leaf]
        if leaf not in self._maps:  # one map per leaf: it covers every device
            self._maps[leaf] = f.sharding.devices_indices_map(f.shape)
        index = self._maps[leaf][self.devices[position]]
        return [list(s.indices(n)[:2]) for s, n in zip(index, f.shape, strict=True)]

    def save_program(self, perm: tuple[tuple[int, int], ...]) -> Any:
        """The arrays -> (this device's buffer, the one ``perm`` sends it)."""
        def body(*blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
            packed = jnp.concatenate([_to_bytes(b) for b in blocks])[None]
            sent = (jax.lax.ppermute(packed, self.axes, list(perm)) if perm
                    else jnp.zeros_like(packed))
            return packed, sent

        return jax.jit(jax.shard_map(
            body, mesh=self.mesh, check_vma=False,
            in_specs=tuple(f.sharding.spec for f in self.leaves),
            out_specs=(P(self.axes), P(self.axes))))

    def restore_program(self, perm: tuple[tuple[int, int], ...]) -> Any:
        """(buffers held here, buffers to send along ``perm``, per device 1 to take the
        received buffer instead of its own) -> the arrays."""
        def body(mine: jax.Array, sending: jax.Array, use: jax.Array) -> list[jax.Array]:
            got = (jax.lax.ppermute(sending, self.axes, list(perm)) if perm
                   else jnp.zeros_like(sending))
            packed = jnp.where(use[0] > 0, got, mine)[0]
            return [_from_bytes(packed[self.offsets[i]:self.offsets[i + 1]], f)
                    for i, f in enumerate(self.leaves)]

        return jax.jit(jax.shard_map(
            body, mesh=self.mesh, check_vma=False,
            in_specs=(P(self.axes), P(self.axes), P(self.axes)),
            out_specs=[f.sharding.spec for f in self.leaves]))

    def global_buffers(self, process: int, per_device: Sequence[np.ndarray]) -> jax.Array:
        """This process's buffers (in :meth:`local` order) as the global array."""
        local = self.local(process)
        arrays = [jax.device_put(b.reshape(1, -1), self.devices[i])
                  for i, b in zip(local, per_device, strict=True)]
        return jax.make_array_from_single_device_arrays(
            (len(self.devices), self.total), self.buffers, arrays)


def _peer_offset(devices: Sequence[Any]) -> int:
    """How many processes on a host's peer is: the next slice's host, else the next."""
    processes = len({d.process_index for d in devices})
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    return processes // slices if slices > 1 else 1


def _fingerprint(mesh: Any) -> str:
    """What a held step must have been saved on to restore here: the mesh's axes and
    devices (a moved job's copies are of another layout)."""
    return json.dumps([list(mesh.axis_names), [int(n) for n in mesh.devices.shape],
                       [int(d.id) for d in mesh.devices.flat], jax.process_count()])


#: How a state is kept: a per-replica state's whole copy once per host (no leaf split
#: within a replica: every host's copy is every other's), a per-replica state split over
#: the replicas (the persistent tier's stored layout), or a global-view state's shards.
MIRRORED, SPLIT, GLOBAL = "mirrored", "split", "global"


def _per_replica_layout(mesh: Any, leaves: Sequence[LeafSpec]) -> str:
    layout = Layout(mesh, gather=False)
    if all(entry is None for f in leaves for entry in layout.spec(f)):
        return MIRRORED
    return SPLIT


class MirroredLayout:
    """Where a mirrored per-replica state's copy is kept: once per host, each leaf split
    over the host's chips along its first axis they divide (else whole on each), on a
    mesh of the slice's devices as (host, chip of the host). Saving, each chip takes its
    part of its own replica's copy (no communication, ``1/chips`` of a copy each);
    restoring, the parts are gathered over the host's chips (no other host's)."""

    gather = MIRRORED  # a program cache key, as Layout's

    def __init__(self, mesh: Any) -> None:
        self.engine = Layout(mesh, gather=False)
        devices = list(mesh.devices.flat)
        processes = sorted({d.process_index for d in devices})
        self.mesh = Mesh(np.array([[d for d in devices if d.process_index == p]
                                   for p in processes]), ("host", "chip"))
        self.chips = int(self.mesh.shape["chip"])

    def _axis(self, leaf: LeafSpec) -> int | None:
        for axis, size in enumerate(leaf.shape):
            if size >= self.chips and size % self.chips == 0:
                return axis
        return None

    def _spec(self, leaf: LeafSpec) -> P:
        spec: list[Any] = [None] * len(leaf.shape)
        axis = self._axis(leaf)
        if axis is not None:
            spec[axis] = "chip"
        return P(*spec)

    def restored(self, leaf: LeafSpec) -> NamedSharding:
        return NamedSharding(self.mesh, self._spec(leaf))

    def target(self, leaf: LeafSpec) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype),
                                    sharding=self.restored(leaf))

    def to_storage(self, leaves: tuple[LeafSpec, ...]) -> Any:
        """One compiled program: per-replica values -> each host's parts of its copy."""
        replicas = P(("host", "chip"))

        def body(*xs: jax.Array) -> list[jax.Array]:
            k = jax.lax.axis_index("chip")
            out = []
            for leaf, x in zip(leaves, xs, strict=True):
                x, axis = x[0], self._axis(leaf)
                if axis is not None:
                    part = leaf.shape[axis] // self.chips
                    x = jax.lax.dynamic_slice_in_dim(x, k * part, part, axis=axis)
                out.append(x)
            return out

        split = jax.jit(jax.shard_map(body, mesh=self.mesh, check_vma=False,
                                      in_specs=tuple(replicas for _ in leaves),
                                      out_specs=[self._spec(f) for f in leaves]))
        on_hosts = NamedSharding(self.mesh, replicas)

        def program(*values: jax.Array) -> list[jax.Array]:
            # Each chip's replica goes to the hosts' mesh as it is: the copies are equal,
            # so the replicas' order there does not matter and nothing moves.
            return split(*[_rewrap(jax.random.key_data(v) if f.key_impl else v, on_hosts)
                           for f, v in zip(leaves, values, strict=True)])

        return program

    def from_storage(self, leaves: tuple[LeafSpec, ...]) -> Callable[..., list[jax.Array]]:
        """Compiled for this layout's arrays: each host's parts -> per-replica values
        (typed keys wrapped again), gathered over the host's chips."""
        def body(*xs: jax.Array) -> list[jax.Array]:
            out = []
            for leaf, x in zip(leaves, xs, strict=True):
                axis = self._axis(leaf)
                if axis is not None:
                    x = jax.lax.all_gather(x, "chip", axis=axis, tiled=True)
                out.append(x[None])
            return out

        gather = jax.jit(jax.shard_map(body, mesh=self.mesh, check_vma=False,
                                       in_specs=tuple(self._spec(f) for f in leaves),
                                       out_specs=[P(("host", "chip")) for _ in leaves]),
                         donate_argnums=tuple(range(len(leaves))))
        compiled = gather.lower(*[self.target(f) for f in leaves]).compile()

        def program(*stored: jax.Array) -> list[jax.Array]:
            out = []
            for leaf, v in zip(leaves, compiled(*stored), strict=True):
                # Back on the engine's mesh as it is: the copies are equal.
                v = _rewrap(v, self.engine.per_replica(leaf))
                out.append(jax.random.wrap_key_data(v, impl=leaf.key_impl)
                           if leaf.key_impl else v)
            return out

        return program


def _rewrap(array: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``array``'s per-device buffers as they are, under ``sharding`` of the same
    devices (each device's buffer taken as its block there)."""
    by_device = {s.device: s.data for s in array.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        array.shape, sharding, [by_device[d] for d in sharding.addressable_devices])


@functools.lru_cache(maxsize=8)
def _mirrored(mesh: Any) -> MirroredLayout:
    return MirroredLayout(mesh)


def _local_arrays(folder: Path, packing: Packing, process: int) -> list[jax.Array]:
    """The arrays from this node's set of this host, each device's blocks put on it."""
    raw, rows = _set_blocks(folder)
    local = packing.local(process)
    out: list[jax.Array] = []
    for i, f in enumerate(packing.leaves):
        dtype = np.dtype(np.uint8) if f.dtype == np.bool_ else f.dtype
        parts = []
        for position, row in zip(local, rows, strict=True):
            block = raw[row[i]:row[i] + f.nbytes].view(dtype).reshape(f.block)
            parts.append(jax.device_put(block.astype(np.bool_) if f.dtype == np.bool_
                                        else block, packing.devices[position]))
        out.append(jax.make_array_from_single_device_arrays(f.shape, f.sharding, parts))
    return out


# ---------------------------------------------------------------- one host's sets
#: One device's blocks, leaf by leaf: each block's bounds and how to read its bytes.
DeviceBlocks = Sequence[tuple[list[list[int]], Callable[[], np.ndarray]]]


def _write_set(folder: Path, devices: Sequence[DeviceBlocks], meta: dict[str, Any]) -> None:
    """A host's shards as a set under ``folder``, each distinct block read and written
    once (a replicated leaf once per host, not once per chip)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    offsets: dict[str, int] = {}  # (leaf, bounds) -> offset in the blocks file
    rows: list[list[int]] = []  # per device: each leaf's block's offset
    end = 0
    with open(tmp / _BLOCKS, "wb") as out:
        for blocks in devices:
            row = []
            for leaf, (bounds, read) in enumerate(blocks):
                key = json.dumps([leaf, bounds])
                if key not in offsets:
                    data = np.ascontiguousarray(read()).reshape(-1).view(np.uint8)
                    out.write(data.data)
                    offsets[key] = end
                    end += data.size
                row.append(offsets[key])
            rows.append(row)
    (tmp / _META).write_text(json.dumps({**meta, "devices": rows}))
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)


def _write_alias(folder: Path, holder: int, meta: dict[str, Any]) -> None:
    """A set of a host whose shards equal those of ``holder``'s set beside it (mirrored
    state): its input position only."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / _META).write_text(json.dumps({**meta, "alias": holder}))
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)


def _set_blocks(folder: Path) -> tuple[np.ndarray, list[list[int]]]:
    """A set's blocks file and each device's row of offsets (an alias's: its holder's)."""
    meta = json.loads((folder / _META).read_text())
    if "alias" in meta:
        return _set_blocks(folder.with_name(f"host-{meta['alias']}"))
    # Mapped, not read: pages go to the devices straight from the node's memory (private:
    # a device buffer made from them may be written without touching the file).
    size = (folder / _BLOCKS).stat().st_size
    raw = (np.memmap(folder / _BLOCKS, dtype=np.uint8, mode="c") if size
           else np.zeros(0, np.uint8))
    return raw, meta["devices"]


def _read_set(folder: Path, packing: Packing) -> list[np.ndarray]:
    """A set's packed buffers, one per device of its host."""
    raw, rows = _set_blocks(folder)
    out = []
    for row in rows:
        buffer = np.empty(packing.total, np.uint8)
        for i, f in enumerate(packing.leaves):
            buffer[packing.offsets[i]:packing.offsets[i + 1]] = raw[row[i]:row[i] + f.nbytes]
        out.append(buffer)
    return out


def _part(buffer: np.ndarray, start: int, stop: int) -> np.ndarray:
    return buffer[start:stop]


def _array_blocks(stored: Sequence[jax.Array], packing: Packing, process: int
                  ) -> list[DeviceBlocks]:
    """This process's blocks of ``stored``, by device, read off the devices on demand."""
    shards = [{s.device: s for s in a.addressable_shards} for a in stored]
    return [[(packing.bounds(i, position),
              functools.partial(_shard_data, by_device[packing.devices[position]]))
             for i, by_device in enumerate(shards)]
            for position in packing.local(process)]


def _shard_data(shard: Any) -> np.ndarray:
    return np.asarray(shard.data)


def _buffer_blocks(buffers: Sequence[np.ndarray], packing: Packing, process: int
                   ) -> list[DeviceBlocks]:
    """Host ``process``'s blocks in its packed buffers (one per device)."""
    return [[(packing.bounds(i, position),
              functools.partial(_part, buffer, packing.offsets[i], packing.offsets[i + 1]))
             for i in range(len(packing.leaves))]
            for position, buffer in zip(packing.local(process), buffers, strict=True)]


class HostMemoryCheckpoints:
    """This host's in-memory checkpoints of every job it runs. :meth:`save` and
    :meth:`restore` are called on every host of the slice in the same operation (they
    run a collective); :meth:`holdings` and :meth:`drop` on any."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or node_folder()
        self._programs = ProgramCache(_PROGRAMS)
        self._packings = ProgramCache(_PROGRAMS)  # layouts of the states saved lately
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="jaxpod-memory-checkpoint")
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="jaxpod-memory-compile")
        #: Writes submitted and not yet waited for, oldest first.
        self._writing: collections.deque[Future[None]] = collections.deque()
        self._next_sweep = 0.0

    # -------------------------------------------------------------- saving
    def save(self, job: str, step: int, state: Any, mesh: Any, position: Any,
             exchange: str, to_storage: Any) -> None:
        """Keeps ``state`` (the user's tree of per-replica or global values) as step
        ``step`` of ``job`` here and on the peer. Returns once the copy is dispatched;
        the writes follow on the writer thread. ``position``: this host's input
        position, which its writer gives its peer through the ``jax.distributed``
        key-value store under ``exchange``. ``to_storage(layout, leaves)``: the persistent tier's
        compiled layout change of per-replica values.

        A mirrored per-replica state (no leaf split within a replica) is kept as one
        whole copy per host and sends nothing: every host's copy is its peer's too."""
        values, _ = jax.tree.flatten(state, is_leaf=lambda x: is_per_replica(x) or is_global(x))
        fingerprint = _fingerprint(mesh)
        layout, leaves, stored, mesh = self._stored(values, mesh, to_storage)
        if layout == GLOBAL:
            fingerprint = _fingerprint(mesh)
        avals = tuple((tuple(a.shape), np.dtype(a.dtype), a.sharding) for a in stored)
        packing = self._packings.get((mesh, avals), lambda: Packing(mesh, avals))
        process, processes = jax.process_index(), jax.process_count()
        offset = _peer_offset(packing.devices)
        peer, source = (process + offset) % processes, (process - offset) % processes
        has_peer = processes > 1 and peer != process
        perm = tuple((s, d) for p in range(processes) if has_peer and layout != MIRRORED
                     for s, d in zip(packing.local(p), packing.local((p + offset) % processes),
                                     strict=True))
        # At most one write waits behind the one under way: the step loop stalls only
        # when the writer falls two saves behind, and a node holds at most three steps.
        self._settle(WRITES_AHEAD - 1)
        own: list[jax.Array] | jax.Array = stored
        sent = None
        if perm and stored:  # the live arrays (the next loop donates them) are copied too
            own, sent = self._programs.get(("save", packing.mesh, _key(packing), perm),
                                           lambda: packing.save_program(perm))(*stored)
        meta = {"format": _FORMAT, "step": step, "layout": layout,
                "fingerprint": fingerprint, "leaves": [f.as_json() for f in leaves]}
        self._writing.append(self._writer.submit(
            self._write, job, step, packing, own, sent, meta, position,
            (source, exchange) if has_peer else None))

    def _stored(self, values: Sequence[Any], mesh: Any, to_storage: Any
                ) -> tuple[str, tuple[LeafSpec, ...], list[jax.Array], Any]:
        """The state's layout (:data:`MIRRORED`, :data:`SPLIT` or :data:`GLOBAL`), its
        leaves, the arrays kept and their mesh."""
        if values and all(isinstance(v, GlobalValue) for v in values):
            leaves = tuple(global_leaf(v) for v in values)
            stored = [jax.random.key_data(v.array) if f.key_impl else v.array
                      for f, v in zip(leaves, values, strict=True)]
            sharding = stored[0].sharding
            return GLOBAL, leaves, stored, getattr(sharding, "mesh", mesh)
        if all(isinstance(v, PerReplica) for v in values):
            leaves = tuple(Layout(mesh).leaf_spec(v) for v in values)
            layout = _per_replica_layout(mesh, leaves)
            arrays = [v.array for v in values]
            if not leaves:
                return MIRRORED, leaves, [], mesh
            if layout == MIRRORED:
                mirrored = _mirrored(mesh)
                split = self._programs.get(("to", mirrored.mesh, leaves),
                                           lambda: mirrored.to_storage(leaves))
                return layout, leaves, list(split(*arrays)), mirrored.mesh
            split = to_storage(Layout(mesh, gather=True), leaves)
            return layout, leaves, list(split(*arrays)), mesh
        raise MemoryCheckpointError("A job's state must hold only values on the slice.")

    def _write(self, job: str, step: int, packing: Packing,
               own: list[jax.Array] | jax.Array, sent: jax.Array | None,
               meta: dict[str, Any], position: Any, peer: tuple[int, str] | None) -> None:
        started = time.monotonic()
        folder = self.folder / job / f"step-{step}"
        process = jax.process_index()
        if peer is not None:  # the peer's writer waits for it, not the step loop
            _kv().key_value_set(f"{peer[1]}/{process}", json.dumps(position))
        blocks = _array_blocks(own, packing, process) if isinstance(own, list) else _buffer_blocks(
            _local_buffers(own, packing, process), packing, process)
        _write_set(folder / f"host-{process}", blocks,
                   {**meta, "host": process, "position": position})
        if peer is not None:
            source, exchange = peer
            client = _kv()
            key = f"{exchange}/{source}"
            theirs = json.loads(client.blocking_key_value_get(
                key, int(PEER_TIMEOUT.seconds() * 1000)))
            client.key_value_delete(key)  # read once: the store does not grow
            theirs_meta = {**meta, "host": source, "position": theirs}
            if sent is None:  # mirrored: this host's copy is theirs
                _write_alias(folder / f"host-{source}", process, theirs_meta)
            else:
                _write_set(folder / f"host-{source}", _buffer_blocks(
                    _local_buffers(sent, packing, process), packing, source), theirs_meta)
        for older in (self.folder / job).glob("step-*"):
            if older.name != folder.name and not older.name.endswith(".tmp"):
                shutil.rmtree(older, ignore_errors=True)
        if time.monotonic() >= self._next_sweep:  # hourly: a worker may live for months
            self._next_sweep = time.monotonic() + SWEEP_EVERY_S
            self._sweep(job)
        logger.debug("memory checkpoint %s step %d written in %.3fs", job, step,
                     time.monotonic() - started)

    def _sweep(self, job: str) -> None:
        """Removes job folders on this node not written for :data:`STALE_AFTER_S`."""
        for other in self.folder.iterdir():
            try:
                if other.name != job and time.time() - other.stat().st_mtime > STALE_AFTER_S:
                    shutil.rmtree(other, ignore_errors=True)
            except OSError:
                continue

    def settle(self) -> None:
        """Waits for every write submitted; raises the first error."""
        self._settle(0)

    def _settle(self, pending: int) -> None:
        """Waits until at most ``pending`` writes are left; raises the first error."""
        while len(self._writing) > pending:
            # bounded: the peer's position waits PEER_TIMEOUT at most
            self._writing.popleft().result()

    # -------------------------------------------------------------- restoring
    def holdings(self, job: str, mesh: Any) -> dict[int, dict[int, Any]]:
        """The steps of ``job`` this node holds whole sets of, saved on ``mesh``'s
        layout: step -> {host whose shards they are: its input position}."""
        self.settle()
        held: dict[int, dict[int, Any]] = {}
        fingerprint = _fingerprint(mesh)
        for meta_file in (self.folder / job).glob("step-*/host-*/" + _META):
            try:
                meta = json.loads(meta_file.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("format") == _FORMAT and meta.get("fingerprint") == fingerprint:
                held.setdefault(int(meta["step"]), {})[int(meta["host"])] = meta["position"]
        return held

    def restore(self, job: str, step: int, sources: Sequence[int], skeleton: Any,
                mesh: Any, exchange: str,
                targets: Sequence[jax.ShapeDtypeStruct] | None = None) -> Any:
        """Step ``step`` of ``job`` onto this slice's devices, as the user's tree
        (``skeleton``: its frozen structure, each leaf's index): host ``g``'s shards
        come from host ``sources[g]``'s node (``g`` itself, or its peer). With
        ``targets`` (a global-view state), the leaves take their shardings. Where
        every host's shards are on its own node, each host reads its own, with no
        program but the persistent tier's layout change."""
        self.settle()
        process = jax.process_index()
        folder = self.folder / job / f"step-{step}"
        layout, specs = self._saved_layout(folder, sources, exchange)
        if not specs:
            return ()
        per_replica: Layout | MirroredLayout | None = None
        if targets is not None:
            shardings = [t.sharding for t in targets]
        else:
            per_replica = _mirrored(mesh) if layout == MIRRORED else Layout(mesh, gather=True)
            shardings = [per_replica.restored(f) for f in specs]
        packing = Packing(shardings[0].mesh, [(f.shape, np.dtype(f.dtype), s)
                                              for f, s in zip(specs, shardings, strict=True)])
        order = jax.tree.leaves(skeleton)
        gather: Future[Any] | None = None
        if per_replica is not None:  # compiled while the shards are read
            leaves = tuple(specs[i] for i in order)
            gather = self._compiler.submit(self._from_storage, per_replica, leaves)
        perm = tuple((s, d) for g, holder in enumerate(sources) if holder != g
                     for s, d in zip(packing.local(holder), packing.local(g), strict=True))
        if perm:
            stored = self._exchanged(folder, packing, sources, perm)
        else:
            stored = _local_arrays(folder / f"host-{process}", packing, process)
        if gather is None:
            values = [GlobalValue(jax.random.wrap_key_data(v, impl=f.key_impl)
                                  if f.key_impl else v) for f, v in zip(specs, stored,
                                                                         strict=True)]
            return trees.thaw(skeleton, lambda i: values[i])
        # bounded: a compile, under the coordinator's operation time-out
        arrays = dict(zip(order, gather.result()(*[stored[i] for i in order]), strict=True))
        return trees.thaw(skeleton, lambda i: PerReplica(arrays[i]))

    def _from_storage(self, layout: Layout | MirroredLayout, leaves: tuple[LeafSpec, ...]
                      ) -> Any:
        def build() -> Any:
            if isinstance(layout, MirroredLayout):
                return layout.from_storage(leaves)
            return layout.from_storage(leaves).lower(
                *[layout.target(f) for f in leaves]).compile()

        return self._programs.get(("from", layout.mesh, layout.gather, leaves), build)

    def _exchanged(self, folder: Path, packing: Packing, sources: Sequence[int],
                   perm: tuple[tuple[int, int], ...]) -> list[jax.Array]:
        """The arrays, hosts whose node was replaced receiving their shards from the
        node that holds them, in one collective."""
        process = jax.process_index()
        local = packing.local(process)
        empty = [np.zeros(packing.total, np.uint8) for _ in local]
        mine = _read_set(folder / f"host-{process}", packing) if sources[process] == process \
            else empty
        owed = [g for g, holder in enumerate(sources) if holder == process and g != process]
        sending = _read_set(folder / f"host-{owed[0]}", packing) if owed else empty
        use = np.full(len(local), 1 if sources[process] != process else 0, np.int32)
        use_global = jax.make_array_from_single_device_arrays(
            (len(packing.devices),), packing.buffers,
            [jax.device_put(use[i:i + 1], packing.devices[p]) for i, p in enumerate(local)])
        program = self._programs.get(("restore", packing.mesh, _key(packing), perm),
                                     lambda: packing.restore_program(perm))
        return list(program(packing.global_buffers(process, mine),
                            packing.global_buffers(process, sending), use_global))

    def _saved_layout(self, folder: Path, sources: Sequence[int], exchange: str
                      ) -> tuple[str, list[LeafSpec]]:
        """The saved layout and leaves: from a set this node holds, else from the
        key-value store, where the holder of host 0's shards puts them."""
        process = jax.process_index()
        held = [folder / f"host-{g}" / _META for g, holder in enumerate(sources)
                if holder == process and (folder / f"host-{g}" / _META).exists()]
        raw = None
        if held:
            meta = json.loads(held[0].read_text())
            raw = [meta["layout"], meta["leaves"]]
        holders = set(sources)
        if any(p not in holders for p in range(len(sources))):
            # Hosts on replaced nodes hold nothing (the key is this restore's own).
            key = f"{exchange}/leaves"
            if sources[0] == process and raw is not None:
                _kv().key_value_set(key, json.dumps(raw))
            if raw is None:
                raw = json.loads(_kv().blocking_key_value_get(
                    key, int(PEER_TIMEOUT.seconds() * 1000)))
        if raw is None:
            raise MemoryCheckpointError(f"no memory checkpoint under {folder}")
        return str(raw[0]), [LeafSpec.from_json(f) for f in raw[1]]

    def drop(self, job: str) -> None:
        """Removes ``job``'s memory checkpoints from this node (the job ended)."""
        self.settle()
        shutil.rmtree(self.folder / job, ignore_errors=True)

    def close(self) -> None:
        """Waits for the write under way (the slice's next holder starts clean)."""
        try:
            self.settle()
        except Exception as e:  # the next holder must not inherit it
            logger.warning("a memory checkpoint's write failed: %s", e)


def _key(packing: Packing) -> tuple[Any, ...]:
    return tuple((f.shape, str(f.dtype), f.sharding.spec) for f in packing.leaves)


def _local_buffers(packed: jax.Array | None, packing: Packing, process: int
                   ) -> list[np.ndarray]:
    """This process's rows of a packed global array, in :meth:`Packing.local` order."""
    local = packing.local(process)
    if packed is None:
        return [np.zeros(packing.total, np.uint8) for _ in local]
    rows = {shard.index[0].start: np.asarray(shard.data)[0] for shard in packed.addressable_shards}
    return [rows[p] for p in local]


def _kv() -> Any:
    from jax._src.distributed import global_state  # the client orbax's barriers use too

    client = global_state.client
    assert client is not None, "several processes share jax.distributed's client"
    return client
