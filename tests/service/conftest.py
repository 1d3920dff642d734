"""Fixtures for the service tests: real local Ray clusters of simulated TPU hosts.

A test module that needs a cluster sets ``CLUSTER_SLICES = "v4-16,v4-8"`` (default
``"v4-16"``) and uses ``ray_cluster``: one cluster per module, with this process
connected as the driver; ``group`` is a v4-16 replica group on it (one per module), and
``process_group`` one whose hosts are plain processes (no cluster).
Tear-down disconnects, stops the cluster, asserts that every process started under it
is gone, and undoes the driver's loopback setting so later tests in the same pytest
process see Ray as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from process_hosts import start_process_group

from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.local_cluster import (
    LocalTPUCluster,
    descendants,
    is_running,
)
from jaxpod.service.capacity.pools import start_replica_group
from jaxpod.service.capacity.resolvers.base import LOOPBACK_ENV
from jaxpod.service.slices.group_engine import GroupEngine


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[LocalTPUCluster]:
    """A running simulated TPU cluster with this process connected to it."""
    import ray
    import ray._private.ray_constants as ray_constants

    saved_env = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    slices = getattr(request.module, "CLUSTER_SLICES", "v4-16")
    cluster = LocalTPUCluster(slices).start()
    try:
        cluster.connect()
        yield cluster
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert cluster.pid is not None
        started = descendants(cluster.pid)
        cluster.stop()
        survivors = [p for p, start in started.items() if is_running(p, start)]
        assert not survivors, f"processes of the local cluster survived stop(): {survivors}"


@pytest.fixture(scope="module")
def group(ray_cluster: LocalTPUCluster) -> Iterator[GroupEngine]:
    """Host workers on a whole v4-16 (2 hosts x 4 chips), with the strategy methods."""
    allocation = SliceAllocator().allocate("v4-16", timeout_s=60)
    replica_group = start_replica_group(allocation, start_timeout_s=120)
    try:
        yield GroupEngine(replica_group)
    finally:
        replica_group.stop()
        allocation.release()


@pytest.fixture(scope="module")
def process_group() -> Iterator[GroupEngine]:
    """A v4-16 replica group (2 hosts x 4 chips) whose hosts are plain processes
    (:mod:`process_hosts`)."""
    replica_group = start_process_group()
    try:
        yield GroupEngine(replica_group)
    finally:
        replica_group.stop()
