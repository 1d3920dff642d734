"""A node's folder of in-memory checkpoints, in one process (8 simulated chips): what a
save leaves there, what it sweeps, and what ``drop`` removes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.values import PerReplica
from jaxpod.worker.checkpoints import Layout
from jaxpod.worker.memory_checkpoints import STALE_AFTER_S, HostMemoryCheckpoints


def _state(step: int) -> dict[str, PerReplica]:
    mesh = jax.make_mesh((8,), ("replica",))
    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * step  # every replica's copy
    whole = np.broadcast_to(w[0], (8, 16))
    return {"w": PerReplica(jax.make_array_from_callback(
        whole.shape, NamedSharding(mesh, P("replica")), lambda index: whole[index]))}


def _to_storage(layout: Layout, leaves: tuple) -> object:
    return layout.to_storage(leaves)


def test_a_save_keeps_the_newest_step_sweeps_stale_jobs_and_drop_removes_it(
        tmp_path: Path) -> None:
    stale, fresh = tmp_path / "gone-job", tmp_path / "other-job"
    for folder in (stale, fresh):
        (folder / "step-1").mkdir(parents=True)
    old = time.time() - STALE_AFTER_S - 60
    os.utime(stale, (old, old))
    memory = HostMemoryCheckpoints(tmp_path)
    mesh = jax.make_mesh((8,), ("replica",))
    for step in (3, 5):
        memory.save("job", step, _state(step), mesh, {"at": step}, "unused", _to_storage)
    memory.settle()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "other-job"]
    assert [p.name for p in (tmp_path / "job").iterdir()] == ["step-5"]
    # One process: its own set only, one copy of the 16 floats for its 8 chips.
    assert (tmp_path / "job/step-5/host-0/blocks.bin").stat().st_size == 16 * 4
    held = memory.holdings("job", mesh)
    assert held == {5: {0: {"at": 5}}}
    state = memory.restore("job", 5, [0], {"w": 0}, mesh, "unused")
    np.testing.assert_array_equal(np.asarray(state["w"].array),
                                  np.broadcast_to(np.arange(16, dtype=np.float32) * 5, (8, 16)))
    memory.drop("job")
    assert not (tmp_path / "job").exists() and fresh.exists()
