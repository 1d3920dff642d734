"""Coordinator restart: a SIGKILLed coordinator's Ray objects are never leaked.

A child process joins the simulated cluster as ``jaxpod serve`` does (by address),
allocates a v4-8 and starts its host worker through the service's own code. To stand
for objects Ray would not free with their driver, it also makes a detached placement
group and actor, named as jaxpod names its objects. The test SIGKILLs the child, runs
the start-up sweep here, and checks Ray's own tables: nothing of the dead instance is
left, while this process's allocation and worker (a live instance) are untouched.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import pytest

from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.local_cluster import LocalTPUCluster
from jaxpod.service.capacity.orphans import (
    NAME_PREFIX,
    find_orphans,
    instance_id,
    instance_of,
    object_name,
    sweep_orphans,
)
from jaxpod.service.capacity.pools import start_replica_group
from jaxpod.timeouts import Deadline, wait_for

CLUSTER_SLICES = "v4-8,v4-8"  # one for the coordinator that dies, one for the live one
READY_TIMEOUT_S = 180.0
GONE_TIMEOUT_S = 30.0

# The dead coordinator: the service's allocation and worker start, plus detached
# objects that only the sweep can release.
CHILD = r"""
import json, sys
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from jaxpod.service.capacity import orphans
from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.resolvers.ray import RAY_NAMESPACE, connect
from jaxpod.service.capacity.pools import start_replica_group

connect(sys.argv[1])
allocation = SliceAllocator().allocate("v4-8", timeout_s=60)
group = start_replica_group(allocation, start_timeout_s=120)
kept = placement_group([{"CPU": 0.01}], name=orphans.object_name("detached", "slice-0"),
                       lifetime="detached")
ray.get(kept.ready(), timeout=60)

@ray.remote(num_cpus=0)
class Holder:
    def ready(self):
        return True

holder = Holder.options(
    name=orphans.object_name("detached", "host-0"), namespace=RAY_NAMESPACE,
    lifetime="detached", scheduling_strategy=PlacementGroupSchedulingStrategy(kept, 0),
).remote()
ray.get(holder.ready.remote(), timeout=60)
print("READY " + json.dumps({"instance": orphans.instance_id(),
                             "job": ray.get_runtime_context().get_job_id(),
                             "pids": group.pids}), flush=True)
sys.stdin.read()  # until killed
"""


def test_names_carry_the_instance() -> None:
    name = object_name("a1b2", "head-sim-0-v4-8")
    assert name == f"{NAME_PREFIX}{instance_id()}:a1b2:head-sim-0-v4-8"
    assert instance_of(name) == instance_id()
    assert instance_of("jaxpod-a1b2-slice-0") is None  # not ours (or an old name)
    assert instance_of("jaxpod::a1b2:slice-0") is None


def test_sweep_releases_a_killed_coordinators_objects_and_spares_live_ones(
        ray_cluster: LocalTPUCluster) -> None:
    # Ours first: the child's detached 0.01-CPU bundle must not take a host's CPU.
    ours = SliceAllocator().allocate("v4-8", timeout_s=60)
    group = start_replica_group(ours, start_timeout_s=120)
    mine = _present(instance_id())
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
    child = subprocess.Popen([sys.executable, "-c", CHILD, ray_cluster.address],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    try:
        ready = _read_ready(child, stderr)
        dead = ready["instance"]
        before = _present(dead)
        assert len(before) == 5, before  # host + head groups, worker, detached pair
        assert all(n.startswith(f"{NAME_PREFIX}{dead}:") for n in before)

        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert wait_for(lambda: _job_dead(ready["job"]), GONE_TIMEOUT_S), ready["job"]
        report = sweep_orphans()

        assert wait_for(lambda: not _present(dead), GONE_TIMEOUT_S), _present(dead)
        assert report.gone
        assert {o.instance for o in report.released} <= {dead}
        detached = {f"{NAME_PREFIX}{dead}:detached:{part}" for part in ("slice-0", "host-0")}
        assert detached <= {o.name for o in report.released}, report
        assert wait_for(lambda: not any(_running(p) for p in ready["pids"]), GONE_TIMEOUT_S)

        # The live instance: every object still there, in the same state; its worker answers.
        assert _present(instance_id()) == mine
        assert {g.id.hex() for g in ours.placement_groups()} <= _group_ids(mine)
        assert all(_running(p) for p in group.pids)
        # Seen from another instance, a live job's objects are never orphans.
        found, live = find_orphans(own_instance="not-this-one")
        assert found == [] and live == len(mine)
        assert sweep_orphans().released == ()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        stderr.close()
        group.stop()
        ours.release()


def _present(instance: str) -> dict[str, tuple[str, str]]:
    """Ray's own view of an instance's objects not dead or removed: name -> (state, id)."""
    import ray._private.state as ray_state
    from ray.util.placement_group import placement_group_table

    prefix = f"{NAME_PREFIX}{instance}:"
    found = {a["Name"]: (a["State"], a["ActorID"]) for a in ray_state.actors().values()
             if a["Name"].startswith(prefix) and a["State"] != "DEAD"}
    found.update({g["name"]: (g["state"], g["placement_group_id"])
                  for g in placement_group_table().values()
                  if g["name"].startswith(prefix) and g["state"] != "REMOVED"})
    return found


def _group_ids(present: dict[str, tuple[str, str]]) -> set[str]:
    return {object_id for state, object_id in present.values() if state == "CREATED"}


def _job_dead(job_id: str) -> bool:
    import ray._private.state as ray_state

    return any(j["JobID"] == job_id and j["IsDead"] for j in ray_state.jobs())


def _running(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def _read_ready(child: subprocess.Popen[bytes], stderr: IO[bytes]) -> dict[str, Any]:
    """The child's ``READY {...}`` line, read within :data:`READY_TIMEOUT_S`."""
    assert child.stdout is not None
    deadline = Deadline(READY_TIMEOUT_S)
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while not deadline.expired():
            if not selector.select(deadline.remaining()):
                continue
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            for line in buffer.split(b"\n")[:-1]:  # whole lines only
                if line.startswith(b"READY "):
                    return dict(json.loads(line[len(b"READY "):]))
    stderr.seek(0)
    tail = stderr.read().decode(errors="replace")[-4000:]
    pytest.fail(f"The child coordinator printed no READY line within {READY_TIMEOUT_S:g} s "
                f"(exit code {child.poll()}). Its stdout: {buffer[-2000:]!r}. "
                f"Its stderr tail:\n{tail}")
