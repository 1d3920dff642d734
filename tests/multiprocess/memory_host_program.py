"""One simulated host of two (4 chips each) keeping or restoring in-memory
checkpoints with :class:`jaxpod.worker.memory_checkpoints.HostMemoryCheckpoints`.

Arguments: coordinator address, process id, ``save`` or ``restore``, ``per_replica``
(mirrored), ``split`` (a leaf split within each replica) or ``global``. ``save`` keeps
steps 2 and 4 of a state made from the step number; ``restore`` plans from every host's
holdings (exchanged through jax.distributed's key-value store), restores, and prints
whether each leaf's values on this host are numpy's, with the plan. The node's folder
is named by ``TPU_NAME`` and ``TPU_WORKER_ID`` under ``JAXPOD_MEMORY_CHECKPOINT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys

address, process_id, mode, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["TPU_WORKER_ID"] = str(process_id)

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(address, num_processes=2, process_id=process_id,
                           initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpod.service.jobs.memory_plan import plan  # noqa: E402
from jaxpod.values import PerReplica  # noqa: E402
from jaxpod.worker.global_view import GlobalValue  # noqa: E402
from jaxpod.worker.memory_checkpoints import HostMemoryCheckpoints  # noqa: E402


def expected(step: int) -> dict[str, np.ndarray]:
    """The state at ``step``, as numpy (one replica's copy)."""
    return {"w": np.arange(16 * 4, dtype=np.float32).reshape(16, 4) * step,
            "n": np.asarray(step, np.int32),
            "mask": (np.arange(8 * 5).reshape(8, 5) % (step + 1)) == 0,
            "h": (np.arange(6, dtype=np.float32) + step).astype(jax.numpy.bfloat16)}


if kind == "per_replica":  # mirrored: every replica's copy whole on its chip
    mesh = jax.make_mesh((8,), ("replica",))
elif kind == "split":  # each replica's w split over its 2 chips
    mesh = jax.make_mesh((4, 2), ("replica", "core"))
else:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
SPECS = {"w": P("data", "model"), "n": P(), "mask": P("data"), "h": P("model")}


def on_slice(step: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in expected(step).items():
        if kind != "global":  # every replica's copy
            whole = np.broadcast_to(value, (int(mesh.shape["replica"]), *value.shape))
            split = kind == "split" and name == "w"
            sharding = NamedSharding(mesh, P("replica", "core") if split else P("replica"))
            out[name] = PerReplica(jax.make_array_from_callback(
                whole.shape, sharding, lambda index, whole=whole: whole[index]))
        else:
            sharding = NamedSharding(mesh, SPECS[name])
            out[name] = GlobalValue(jax.make_array_from_callback(
                value.shape, sharding, lambda index, value=value: value[index]))
    return out


def to_storage(layout: object, leaves: object) -> object:
    return layout.to_storage(leaves)  # type: ignore[attr-defined]


memory = HostMemoryCheckpoints()
client = jax._src.distributed.global_state.client
if mode == "save":
    for step in (2, 4):
        memory.save("job-1", step, on_slice(step), mesh, {"host": process_id, "step": step},
                    f"test/save-{step}", to_storage)
    memory.settle()
    print(json.dumps({"process": process_id, "saved": True}), flush=True)
else:
    held = memory.holdings("job-1", mesh)
    client.key_value_set(f"held/{process_id}", json.dumps(
        {str(s): {str(g): p for g, p in hosts.items()} for s, hosts in held.items()}))
    everyone = [{int(s): {int(g): p for g, p in hosts.items()} for s, hosts in
                 json.loads(client.blocking_key_value_get(f"held/{h}", 60_000)).items()}
                for h in range(2)]
    chosen = plan(everyone, None)
    assert chosen is not None, everyone
    step, sources, positions = chosen.step, list(chosen.sources), list(chosen.positions)
    skeleton = {name: i for i, name in enumerate(sorted(expected(step)))}  # leaf order
    targets = None
    if kind == "global":
        targets = [jax.ShapeDtypeStruct(v.array.shape, v.array.dtype, sharding=v.array.sharding)
                   for v in jax.tree.leaves(on_slice(step), is_leaf=lambda x: isinstance(
                       x, GlobalValue))]
    state = memory.restore("job-1", step, sources, skeleton, mesh, "test/restore",
                           targets=targets)
    got = {}
    for name, value in state.items():
        array = value.array
        shard = array.addressable_shards[0]
        data = np.asarray(shard.data)
        want = expected(step)[name]
        if kind != "global":
            want = np.broadcast_to(want, (int(mesh.shape["replica"]), *want.shape))
        ok = bool(np.array_equal(data, want[shard.index]))
        got[name] = ok
    print(json.dumps({"process": process_id, "step": step, "sources": sources,
                      "positions": positions, "equal": got}), flush=True)
jax.distributed.shutdown()
