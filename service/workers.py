"""Host workers for an allocation: the bridge from slices to a replica group.

The allocator hands out whole slices (placement groups, one bundle per host, with the
environment each host's JAX process needs); this module starts one host worker per
bundle and forms their ``jax.distributed`` group.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.allocator import Allocation, SliceAllocator
from jaxpod.service.group_engine import GroupEngine
from jaxpod.service.replica_group import HostPlacement, ReplicaGroup
from jaxpod.service.sessions import HeldSlice
from jaxpod.worker.host_worker import SIMULATED_PLATFORM


def placements(allocation: Allocation) -> list[HostPlacement]:
    """One placement per allocated host, in JAX process-id order."""
    cpus = allocation.request.cpus_per_host
    return [
        HostPlacement(placement_group=s.placement_group, bundle_index=h.bundle_index,
                      resources={"TPU": float(h.chips)}, num_cpus=cpus, env=dict(h.env),
                      unset_env=tuple(h.unset_env))
        for s in allocation.slices for h in s.hosts
    ]


def start_replica_group(allocation: Allocation, platform: str = SIMULATED_PLATFORM,
                        start_timeout_s: float | None = None) -> ReplicaGroup:
    """Starts the host workers of ``allocation`` as one replica group.

    Args:
      allocation: whole slices from :class:`~jaxpod.service.allocator.SliceAllocator`.
      platform: ``"cpu"`` on simulated hosts (one CPU device per chip), ``"tpu"`` on
        real TPU hosts.
      start_timeout_s: overrides ``JAXPOD_WORKER_START_TIMEOUT_S``.

    Raises:
      jaxpod.WorkerStartError: a host did not start or join in time.
    """
    first = allocation.slices[0].info
    devices_per_host = first.chips_per_host * first.devices_per_chip
    return ReplicaGroup.start(placements(allocation), devices_per_host, platform,
                              start_timeout_s)


class RaySlices:
    """The coordinator's slice provider: allocation, host workers, device assignment.

    Args:
      allocator: whole-slice allocation on the Ray cluster this process joined.
      platform: ``"cpu"`` for simulated hosts, ``"tpu"`` on real ones.
      start_timeout_s: overrides ``JAXPOD_WORKER_START_TIMEOUT_S``.
    """

    def __init__(self, allocator: SliceAllocator | None = None,
                 platform: str = SIMULATED_PLATFORM,
                 start_timeout_s: float | None = None) -> None:
        self.allocator = allocator or SliceAllocator()
        self.platform = platform
        self.start_timeout_s = start_timeout_s

    def acquire(self, request: pb.AcquireSliceRequest, slice_id: str) -> HeldSlice:
        """Allocates, starts and configures; on any failure nothing stays held."""
        allocation = self.allocator.allocate(request.accelerator_type,
                                             request.num_slices or 1,
                                             timeout_s=request.timeout_s or None)
        group: ReplicaGroup | None = None
        try:
            group = start_replica_group(allocation, self.platform, self.start_timeout_s)
            engine = GroupEngine(group)
            engine.configure(request.steps_per_run or 1,
                             list(request.computation_shape) or None,
                             request.num_replicas or None)
        except BaseException:
            if group is not None:
                group.stop()
            allocation.release()
            raise
        return HeldSlice(slice_id, engine, _release_once(group, allocation),
                         _describe(allocation))

    def cluster(self) -> list[pb.ClusterSlice]:
        from jaxpod.service.resolvers.ray import snapshot

        slices, _ = snapshot()
        return [pb.ClusterSlice(name=s.info.name, accelerator_type=s.info.accelerator_type,
                                num_hosts=len(s.hosts)) for s in slices]


def _release_once(group: ReplicaGroup, allocation: Allocation) -> Any:
    lock = threading.Lock()
    done = [False]

    def release() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        try:
            group.stop()
        finally:
            allocation.release()

    return release


def _describe(allocation: Allocation) -> dict[str, Any]:
    first = allocation.slices[0].info
    return {"accelerator_type": first.accelerator_type,
            "num_slices": len(allocation.slices),
            "num_hosts": len(allocation.hosts),
            "slice_names": [s.info.name for s in allocation.slices]}
