"""A job's in-memory checkpoints: the fast tier beside orbax's persistent one.

Every ``memory_checkpoint_every`` steps each host keeps its shards of the state in its
node's memory and sends a copy to a peer host, which keeps it the same way:

* **Where.** A folder on the node's RAM disk (``JAXPOD_MEMORY_CHECKPOINT_DIR``, default
  ``/dev/shm/jaxpod-memory``), named by the node's slice and worker index (``TPU_NAME``,
  ``TPU_WORKER_ID``). It outlives the worker process, which the slice restarts when any
  host is lost, and goes with the node: a host restarted on its node finds its own
  shards; one whose node was replaced finds nothing.
* **The peer.** The next host of the slice, or with several slices the same host of the
  next slice (a lost slice then loses no copy). The copy travels as one device
  collective (``ppermute``) of one byte buffer per device, over the links the steps
  use: no port, no service, nothing through the coordinator. Each host sends
  ``1/hosts`` of the state whatever the pod's size.
* **Off the step path.** The step loop only dispatches the collective; the bytes leave
  the devices and reach the RAM disk on this host's writer thread beside the next loops.
  One write is under way at a time: a save waits for the one before (its memory is
  bounded by two copies).
* **Restore.** The coordinator asks every host what it holds (:meth:`holdings`) and
  restores the newest step every host's shards of which are held somewhere
  (:mod:`jaxpod.service.jobs.memory_plan`): on the host's own node, or on its peer's,
  which sends them back in the same kind of collective. Otherwise the job reads its
  persistent checkpoint.

The layout is the persistent tier's stored arrays (:mod:`jaxpod.worker.checkpoints`): a
per-replica state split over the replicas, global-view leaves as they are. On a device
they are packed into one byte buffer, each leaf's block bitcast to bytes
(:class:`Packing`); on the RAM disk, ``<node>/<job>/step-<S>/host-<g>/`` holds host
``g``'s blocks, each distinct block once (a replicated leaf is kept once per host, not
once per chip), and ``meta.json``, written last: a folder without it is never read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
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
#: A job folder on a node not written for this long belongs to a job that is gone.
STALE_AFTER_S = 24 * 3600.0
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

    def local(self, process: int) -> list[int]:
        """The positions of ``process``'s devices in the mesh's device order."""
        return [i for i, d in enumerate(self.devices) if d.process_index == process]

    def bounds(self, leaf: int, position: int) -> list[list[int]]:
        """Leaf ``leaf``'s block on the device at ``position``: (start, stop) per axis."""
        f = self.leaves[leaf]
        index = f.sharding.devices_indices_map(f.shape)[self.devices[position]]
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


# ---------------------------------------------------------------- one host's sets
@dataclass(frozen=True)
class HeldSet:
    """One host's shards at one step, as a node holds them."""

    step: int
    host: int
    position: Any


def _write_set(folder: Path, packing: Packing, host: int, buffers: Sequence[np.ndarray],
               meta: dict[str, Any]) -> None:
    """Host ``host``'s buffers (one per device of it) as a set under ``folder``: each
    distinct block once."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    blocks: dict[str, list[int]] = {}  # (leaf, bounds) -> [offset, nbytes]
    devices: list[list[int]] = []  # per device: each leaf's block's offset
    offset = 0
    with open(tmp / _BLOCKS, "wb") as out:
        for position, buffer in zip(packing.local(host), buffers, strict=True):
            row = []
            for i, f in enumerate(packing.leaves):
                key = json.dumps([i, packing.bounds(i, position)])
                if key not in blocks:
                    out.write(buffer[packing.offsets[i]:packing.offsets[i + 1]].data)
                    blocks[key] = [offset, f.nbytes]
                    offset += f.nbytes
                row.append(blocks[key][0])
            devices.append(row)
    (tmp / _META).write_text(json.dumps({**meta, "host": host, "devices": devices}))
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)


def _read_set(folder: Path, packing: Packing) -> list[np.ndarray]:
    """A set's buffers, one per device of its host."""
    meta = json.loads((folder / _META).read_text())
    raw = np.fromfile(folder / _BLOCKS, dtype=np.uint8)
    out = []
    for row in meta["devices"]:
        buffer = np.zeros(packing.total, np.uint8)
        for i, f in enumerate(packing.leaves):
            buffer[packing.offsets[i]:packing.offsets[i + 1]] = raw[row[i]:row[i] + f.nbytes]
        out.append(buffer)
    return out


class HostMemoryCheckpoints:
    """This host's in-memory checkpoints of every job it runs. :meth:`save` and
    :meth:`restore` are called on every host of the slice in the same operation (they
    run a collective); :meth:`holdings` and :meth:`drop` on any."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or node_folder()
        self._programs = ProgramCache(_PROGRAMS)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="jaxpod-memory-checkpoint")
        self._writing: Future[None] | None = None
        self._swept = False

    # -------------------------------------------------------------- saving
    def save(self, job: str, step: int, state: Any, mesh: Any, position: Any,
             exchange: str, to_storage: Any) -> None:
        """Keeps ``state`` (the user's tree of per-replica or global values) as step
        ``step`` of ``job`` here and on the peer. Returns once the copy is dispatched;
        the writes follow on the writer thread. ``position``: this host's input
        position, which its peer reads from the ``jax.distributed`` key-value store
        under ``exchange``. ``to_storage(layout, leaves)``: the persistent tier's
        compiled layout change of per-replica values."""
        values, _ = jax.tree.flatten(state, is_leaf=lambda x: is_per_replica(x) or is_global(x))
        kind, leaves, stored, mesh = self._stored(values, mesh, to_storage)
        packing = self._packing(mesh, stored)
        process, processes = jax.process_index(), jax.process_count()
        offset = _peer_offset(packing.devices)
        peer, source = (process + offset) % processes, (process - offset) % processes
        perm = tuple((s, d) for p in range(processes) if processes > 1
                     for s, d in zip(packing.local(p), packing.local((p + offset) % processes),
                                     strict=True))
        self.settle()  # one write at a time: what it holds is bounded
        own, sent = (self._programs.get(("save", packing.mesh, _key(packing), perm),
                                        lambda: packing.save_program(perm))(*stored)
                     if stored else (None, None))
        if processes > 1:
            _kv().key_value_set(f"{exchange}/{process}", json.dumps(position))
        meta = {"format": _FORMAT, "step": step, "kind": kind, "fingerprint": _fingerprint(mesh),
                "leaves": [f.as_json() for f in leaves]}
        self._writing = self._writer.submit(
            self._write, job, step, packing, own, sent, meta, position,
            (source, exchange) if processes > 1 and peer != process else None)

    @staticmethod
    def _stored(values: Sequence[Any], mesh: Any, to_storage: Any
                ) -> tuple[str, tuple[LeafSpec, ...], list[jax.Array], Any]:
        if values and all(isinstance(v, GlobalValue) for v in values):
            leaves = tuple(global_leaf(v) for v in values)
            stored = [jax.random.key_data(v.array) if f.key_impl else v.array
                      for f, v in zip(leaves, values, strict=True)]
            sharding = stored[0].sharding
            return "global", leaves, stored, getattr(sharding, "mesh", mesh)
        if all(isinstance(v, PerReplica) for v in values):
            layout = Layout(mesh, gather=True)
            leaves = tuple(layout.leaf_spec(v) for v in values)
            stored = list(to_storage(layout, leaves)(*[v.array for v in values])) if leaves else []
            return "per_replica", leaves, stored, mesh
        raise MemoryCheckpointError("A job's state must hold only values on the slice.")

    @staticmethod
    def _packing(mesh: Any, stored: Sequence[jax.Array]) -> Packing:
        return Packing(mesh, [(a.shape, a.dtype, a.sharding) for a in stored])

    def _write(self, job: str, step: int, packing: Packing, own: jax.Array | None,
               sent: jax.Array | None, meta: dict[str, Any], position: Any,
               peer: tuple[int, str] | None) -> None:
        started = time.monotonic()
        folder = self.folder / job / f"step-{step}"
        process = jax.process_index()
        _write_set(folder / f"host-{process}", packing, process,
                   _local_buffers(own, packing, process), {**meta, "position": position})
        if peer is not None:
            source, exchange = peer
            client = _kv()
            key = f"{exchange}/{source}"
            theirs = json.loads(client.blocking_key_value_get(
                key, int(PEER_TIMEOUT.seconds() * 1000)))
            client.key_value_delete(key)  # read once: the store does not grow
            _write_set(folder / f"host-{source}", packing, source,
                       _local_buffers(sent, packing, process), {**meta, "position": theirs})
        for older in (self.folder / job).glob("step-*"):
            if older.name != folder.name and not older.name.endswith(".tmp"):
                shutil.rmtree(older, ignore_errors=True)
        if not self._swept:
            self._swept = True
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
        """Waits for the write under way; raises its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()  # bounded: the peer's position waits PEER_TIMEOUT at most

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
        ``targets`` (a global-view state), the leaves take their shardings."""
        self.settle()
        process = jax.process_index()
        folder = self.folder / job / f"step-{step}"
        specs = self._leaf_specs(folder, sources, exchange)
        if not specs:
            return ()
        if targets is not None:
            shardings = [t.sharding for t in targets]
            layout = None
        else:
            layout = Layout(mesh, gather=True)
            shardings = [layout.stored(f) for f in specs]
        packing = Packing(shardings[0].mesh, [(f.shape, np.dtype(f.dtype), s)
                                              for f, s in zip(specs, shardings, strict=True)])
        local = packing.local(process)
        empty = [np.zeros(packing.total, np.uint8) for _ in local]
        mine = _read_set(folder / f"host-{process}", packing) if sources[process] == process \
            else empty
        owed = [g for g, holder in enumerate(sources) if holder == process and g != process]
        sending = _read_set(folder / f"host-{owed[0]}", packing) if owed else empty
        perm = tuple((s, d) for g, holder in enumerate(sources) if holder != g
                     for s, d in zip(packing.local(holder), packing.local(g), strict=True))
        use = np.full(len(local), 1 if sources[process] != process else 0, np.int32)
        use_global = jax.make_array_from_single_device_arrays(
            (len(packing.devices),), packing.buffers,
            [jax.device_put(use[i:i + 1], packing.devices[p]) for i, p in enumerate(local)])
        program = self._programs.get(("restore", packing.mesh, _key(packing), perm),
                                     lambda: packing.restore_program(perm))
        stored = program(packing.global_buffers(process, mine),
                         packing.global_buffers(process, sending), use_global)
        order = jax.tree.leaves(skeleton)
        if layout is None:
            values: list[Any] = [GlobalValue(jax.random.wrap_key_data(v, impl=specs[i].key_impl)
                                             if specs[i].key_impl else v)
                                 for i, v in zip(range(len(specs)), stored, strict=True)]
            return trees.thaw(skeleton, lambda i: values[i])
        leaves = tuple(specs[i] for i in order)
        gather = self._programs.get(("from", layout.mesh, leaves),
                                    lambda: layout.from_storage(leaves))
        arrays = gather(*[stored[i] for i in order])
        by_index = dict(zip(order, arrays, strict=True))
        return trees.thaw(skeleton, lambda i: PerReplica(by_index[i]))

    def _leaf_specs(self, folder: Path, sources: Sequence[int], exchange: str
                    ) -> list[LeafSpec]:
        """The saved leaves: from a set this node holds, else from the key-value store,
        where the holder of host 0's shards puts them."""
        process = jax.process_index()
        held = [folder / f"host-{g}" / _META for g, holder in enumerate(sources)
                if holder == process and (folder / f"host-{g}" / _META).exists()]
        raw = json.loads(held[0].read_text())["leaves"] if held else None
        holders = set(sources)
        needy = [p for p in range(len(sources)) if p not in holders]
        if needy:  # hosts on replaced nodes hold nothing (the key is this restore's own)
            key = f"{exchange}/leaves"
            if sources[0] == process and raw is not None:
                _kv().key_value_set(key, json.dumps(raw))
            if raw is None:
                raw = json.loads(_kv().blocking_key_value_get(
                    key, int(PEER_TIMEOUT.seconds() * 1000)))
        if raw is None:
            raise MemoryCheckpointError(f"no memory checkpoint under {folder}")
        return [LeafSpec.from_json(f) for f in raw]

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
