"""A replica group whose hosts are plain processes, as ``jaxpod serve --provider
processes`` starts them (no Ray cluster): for the tests of what a replica group does
the same whichever launcher started its workers."""

from __future__ import annotations

from jaxpod.service.capacity.local_cluster import plan_slices
from jaxpod.service.capacity.process_hosts import LocalHeld, ProcessWorkers
from jaxpod.service.slices.replica_group import ReplicaGroup

START_TIMEOUT_S = 120.0


def start_process_group(accelerator_type: str = "v4-16") -> ReplicaGroup:
    """Every host of one simulated slice of that type, with its host's environment."""
    held = LocalHeld(tuple(plan_slices(accelerator_type)), lambda held: None)
    return ReplicaGroup.start(held.placements(), held.slices[0].shape.devices_per_host,
                              launcher=ProcessWorkers(), start_timeout_s=START_TIMEOUT_S)
