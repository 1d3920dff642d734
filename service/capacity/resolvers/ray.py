"""Ray: the TPU slices of a Ray cluster, read from its nodes' resources and labels.

A TPU host in a Ray cluster (GKE/KubeRay, GCE, or the simulated local cluster)
advertises, by Ray's own TPU detection (``ray._private.accelerators.tpu``):

* resources ``TPU: <chips>``, ``accelerator_type:TPU-V4: 1``, ``<slice name>: 1`` and,
  on worker 0 only, ``TPU-<pod type>-head: 1`` (e.g. ``TPU-v4-16-head``);
* labels ``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``, ``ray.io/tpu-pod-type``,
  ``ray.io/tpu-topology`` and ``ray.io/accelerator-type``.

:func:`discover_slices` groups alive nodes by slice-name label and checks each slice
against the topology table; the allocator uses the same function, with the nodes'
free resources, to find slices it can take whole.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from jaxpod.service.capacity.resolvers.base import LOOPBACK_ENV, ClusterInfo, HostInfo, SliceInfo
from jaxpod.service.capacity.topology import SliceShape, slice_shape

SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
ACCELERATOR_TYPE_LABEL = "ray.io/accelerator-type"
TPU_RESOURCE = "TPU"
#: The Ray namespace jaxpod's drivers join: its placement groups and named actors live
#: there, apart from other users' names (see :mod:`jaxpod.service.capacity.orphans`).
RAY_NAMESPACE = "jaxpod"

#: A Ray node as ``ray.nodes()`` returns it.
RayNode = Mapping[str, Any]


@dataclass(frozen=True)
class RayHost:
    """One host of a slice, with what is free on its Ray node right now.

    Attributes:
      info: the host.
      tpu_free: ``TPU`` resource not held by anyone.
      head_free: for worker 0, whether its ``TPU-<type>-head`` resource is free.
    """

    info: HostInfo
    tpu_free: float
    head_free: bool = False


@dataclass(frozen=True)
class RaySlice:
    """One slice of a Ray cluster, its health and whether it can be taken whole.

    Attributes:
      info: the slice.
      shape: its row of the topology table; ``None`` for a type the table lacks.
      hosts: its hosts' free resources, in worker-id order.
      problems: why it cannot be allocated even when idle (missing hosts, no head
        resource, unknown type); empty for a healthy slice.
    """

    info: SliceInfo
    shape: SliceShape | None
    hosts: tuple[RayHost, ...]
    problems: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        """Every host present and consistent with the topology table."""
        return not self.problems

    @property
    def idle(self) -> bool:
        """Healthy, every host's chips free and the head resource free."""
        return (
            self.healthy
            and all(h.tpu_free >= h.info.chips for h in self.hosts)
            and self.hosts[0].head_free
        )

    @property
    def state(self) -> str:
        """``idle``, ``busy`` or ``unhealthy``, for tables and messages."""
        if not self.healthy:
            return "unhealthy"
        return "idle" if self.idle else "busy"


def discover_slices(
    nodes: Sequence[RayNode],
    available: Mapping[str, Mapping[str, float]],
) -> tuple[tuple[RaySlice, ...], tuple[str, ...]]:
    """Groups a Ray cluster's alive TPU nodes into slices.

    Args:
      nodes: ``ray.nodes()``.
      available: free resources per node id (``available_resources_per_node()``);
        a node missing from it counts as fully busy.

    Returns:
      The slices sorted by name, and notes on TPU nodes that belong to no slice.
    """
    groups: dict[str, list[RayNode]] = {}
    notes = []
    for node in nodes:
        if not node.get("Alive") or not node.get("Resources", {}).get(TPU_RESOURCE):
            continue
        name = (node.get("Labels") or {}).get(SLICE_NAME_LABEL)
        if not name:
            notes.append(
                f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress')}) has TPU "
                f"chips but no {SLICE_NAME_LABEL} label, so it is in no slice"
            )
            continue
        groups.setdefault(name, []).append(node)
    slices = tuple(_slice(name, groups[name], available) for name in sorted(groups))
    return slices, tuple(notes)


def _slice(
    name: str, nodes: list[RayNode], available: Mapping[str, Mapping[str, float]]
) -> RaySlice:
    problems: list[str] = []
    labels = [n.get("Labels") or {} for n in nodes]
    pod_types = sorted({lab.get(POD_TYPE_LABEL, "") for lab in labels})
    topology = labels[0].get(TOPOLOGY_LABEL) or None
    chips = sorted({int(n["Resources"][TPU_RESOURCE]) for n in nodes})
    if len(pod_types) > 1 or len(chips) > 1:
        problems.append(f"hosts disagree: pod types {pod_types}, chips per host {chips}")
    shape: SliceShape | None = None
    try:
        shape = slice_shape(pod_types[0], topology, chips[0])
    except ValueError as e:
        problems.append(f"{POD_TYPE_LABEL}={pod_types[0]!r}: {e}")
    hosts = _hosts(name, nodes, shape, available, problems)
    infos = [h.info for h in hosts]
    if shape is not None:
        info = SliceInfo.from_shape(name, shape, infos)
        _check_complete(info, problems)
    else:
        info = SliceInfo(name, pod_types[0] or "unknown", topology or "?", chips[0], 1,
                         len(infos), tuple(infos))
    return RaySlice(info, shape, hosts, tuple(problems))


def _hosts(
    name: str,
    nodes: list[RayNode],
    shape: SliceShape | None,
    available: Mapping[str, Mapping[str, float]],
    problems: list[str],
) -> tuple[RayHost, ...]:
    hosts = []
    for node in nodes:
        raw_id = (node.get("Labels") or {}).get(WORKER_ID_LABEL, "")
        if not raw_id.isdecimal():
            problems.append(f"node {node['NodeID'][:12]} has {WORKER_ID_LABEL}={raw_id!r}")
            continue
        free = available.get(node["NodeID"], {})
        if not node["Resources"].get(name):
            problems.append(f"worker {raw_id} lacks the slice-name resource {name!r}")
        head_free = False
        if raw_id == "0" and shape is not None:
            if not node["Resources"].get(shape.head_resource):
                problems.append(f"worker 0 lacks the head resource {shape.head_resource!r}")
            head_free = free.get(shape.head_resource, 0.0) >= 1
        info = HostInfo(
            worker_id=int(raw_id),
            address=node["NodeManagerAddress"],
            chips=int(node["Resources"][TPU_RESOURCE]),
            node_id=node["NodeID"],
        )
        hosts.append(RayHost(info, free.get(TPU_RESOURCE, 0.0), head_free))
    return tuple(sorted(hosts, key=lambda h: h.info.worker_id))


def _check_complete(info: SliceInfo, problems: list[str]) -> None:
    ids = [h.worker_id for h in info.hosts]
    if len(set(ids)) != len(ids):
        problems.append(f"duplicate worker ids {sorted(ids)}")
    elif not info.complete:
        missing = sorted(set(range(info.expected_hosts)) - set(ids))
        extra = sorted(set(ids) - set(range(info.expected_hosts)))
        problems.append(
            f"{len(ids)}/{info.expected_hosts} hosts present"
            + (f", missing worker(s) {missing}" if missing else "")
            + (f", unexpected worker(s) {extra}" if extra else "")
        )


def use_loopback() -> None:
    """Makes this process's Ray use 127.0.0.1 as its node address.

    Sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for this process and its children and,
    because Ray reads the variable once when ``ray._private.ray_constants`` is first
    imported, updates the constant too when Ray is already loaded. Only for drivers of
    the simulated local cluster, whose GCS listens on 127.0.0.1 only; never in
    ``deploy/``, where hosts must reach each other.
    """
    os.environ.update(LOOPBACK_ENV)
    constants: Any = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False



def connect(address: str | None = None) -> None:
    """Connects this process to Ray as a driver unless it already is connected.

    A loopback address (the simulated local cluster) makes this process use Ray's
    loopback mode first (:func:`use_loopback`), without
    which Ray would dial the host's network address instead of 127.0.0.1.
    The driver joins the Ray namespace :data:`RAY_NAMESPACE`, where jaxpod's named
    placement groups are kept (a process connected before keeps its own namespace).

    Args:
      address: the cluster's GCS address; ``$RAY_ADDRESS`` when ``None``.

    Raises:
      ValueError: not connected and no address given or in ``RAY_ADDRESS``.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError(
            "Not connected to Ray and no address given. Pass the cluster address "
            "(e.g. '127.0.0.1:6379') or set RAY_ADDRESS."
        )
    if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        use_loopback()
    ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False,
             logging_level=logging.WARNING)


def snapshot() -> tuple[tuple[RaySlice, ...], tuple[str, ...]]:
    """The connected cluster's slices with their free resources right now."""
    # Per-node free resources come straight from the GCS; Ray's own TPU utilities
    # (ray.util.tpu) read them the same way. The public state API would need the
    # dashboard, which the local cluster does not run.
    from ray._private.state import available_resources_per_node

    return discover_slices(ray.nodes(), available_resources_per_node())


class RayResolver:
    """Resolves the TPU slices of a Ray cluster."""

    environment = "ray"

    def __init__(self, address: str | None = None) -> None:
        """Args:
        address: GCS address to connect to when this process is not connected yet;
          ``$RAY_ADDRESS`` when ``None``.
        """
        self.address = address

    def is_present(self) -> bool:
        """Connected to Ray already, or ``RAY_ADDRESS`` (or ``address``) is set."""
        return ray.is_initialized() or bool(self.address or os.environ.get("RAY_ADDRESS"))

    def resolve(self) -> ClusterInfo:
        """Connects if needed and reads every alive TPU node into slices.

        Returns:
          All slices; when this process is a Ray task or actor on a TPU host, that
          host's slice and worker id as ``current_slice`` / ``worker_id``.
        """
        connect(self.address)
        slices, notes = snapshot()
        problems = tuple(f"slice {s.info.name}: {p}" for s in slices for p in s.problems)
        current, worker_id = _current_host(slices)
        return ClusterInfo(
            environment=self.environment,
            source=f"ray at {ray.get_runtime_context().gcs_address}",
            slices=tuple(s.info for s in slices),
            current_slice=current,
            worker_id=worker_id,
            notes=notes + problems,
        )


def _current_host(slices: Sequence[RaySlice]) -> tuple[str | None, int | None]:
    """This process's slice and worker id when it is a task/actor on a TPU host.

    A driver is never "on" a slice: with the simulated cluster every node shares
    127.0.0.1, so the raylet a driver attaches to says nothing about it.
    """
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return None, None
    node_id = context.get_node_id()
    for s in slices:
        for h in s.hosts:
            if h.info.node_id == node_id:
                return s.info.name, h.info.worker_id
    return None, None
