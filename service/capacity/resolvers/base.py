"""What every cluster resolver returns, and the interface resolvers implement.

A resolver turns one environment (GKE env vars, GCE metadata, a Ray cluster, this
host's devices) into a :class:`ClusterInfo`: the TPU slices it can see, their hosts in
worker-id order, and, when this process runs on a TPU host, which slice and worker it
is. Values are frozen dataclasses so they can be shared between threads and compared
in tests.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from jaxpod import settings
from jaxpod.service.capacity.topology import SliceShape

#: Port of the ``jax.distributed`` coordinator on host 0, as JAX's own Cloud TPU
#: cluster detection uses (``jax._src.clusters.cloud_tpu_cluster.coordinator_port``).
DEFAULT_COORDINATOR_PORT = 8482
#: Port of the multi-slice (MegaScale) coordinator; Ray's default as well.
DEFAULT_MEGASCALE_PORT = 8081
#: Makes Ray use the loopback address on Linux: only for the simulated local cluster.
#: Here, not in ``resolvers.ray``, so the cluster's launcher starts before Ray loads.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: The multi-slice (MegaScale) variables of a host's process.
MEGASCALE_VARS = (
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_PORT",
    "MEGASCALE_SLICE_ID",
)


def megascale_env(num_slices: int, slice_index: int, coordinator: str,
                  port: int = DEFAULT_MEGASCALE_PORT) -> tuple[dict[str, str], tuple[str, ...]]:
    """A host's ``MEGASCALE_*`` variables for slice ``slice_index`` of ``num_slices``, and
    those to remove: all of them for a single slice (stale ones from the host's own
    environment would make JAX wait for slices that do not exist)."""
    if num_slices == 1:
        return {}, MEGASCALE_VARS
    return {"MEGASCALE_COORDINATOR_ADDRESS": coordinator,
            "MEGASCALE_NUM_SLICES": str(num_slices), "MEGASCALE_PORT": str(port),
            "MEGASCALE_SLICE_ID": str(slice_index)}, ()


#: How long an acquire waits for whole slices of its type to be free (every provider's;
#: here so that a provider without Ray names it without importing Ray).
ALLOCATION_TIMEOUT = settings.ALLOCATION_TIMEOUT

_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class HostInfo:
    """One TPU host (TPU VM, Kubernetes pod, Ray node) of a slice.

    Attributes:
      worker_id: its index in the slice (``TPU_WORKER_ID``), which is also its JAX
        process id within the slice.
      address: host name or IP other hosts reach it at.
      chips: TPU chips on it.
      node_id: the Ray node id (hex) when known.
    """

    worker_id: int
    address: str
    chips: int
    node_id: str | None = None


@dataclass(frozen=True)
class SliceInfo:
    """One TPU slice: a set of hosts that must be used together.

    Attributes:
      name: unique slice name (``TPU_NAME``, the ``ray.io/tpu-slice-name`` label).
      accelerator_type: e.g. ``v4-16``; ``cpu-8`` for a local CPU host.
      topology: physical chip topology, e.g. ``2x2x2``; the device count for CPU.
      chips_per_host: chips on each host.
      devices_per_chip: JAX devices per chip (1 on v4, v5e, v5p, v6e and CPU).
      expected_hosts: hosts the accelerator type has; ``len(hosts)`` can be smaller
        while a Ray node of the slice is missing.
      hosts: the hosts present, in worker-id order.
      coordinator_port: port of the ``jax.distributed`` coordinator on host 0.
    """

    name: str
    accelerator_type: str
    topology: str
    chips_per_host: int
    devices_per_chip: int
    expected_hosts: int
    hosts: tuple[HostInfo, ...]
    coordinator_port: int = DEFAULT_COORDINATOR_PORT

    @classmethod
    def from_shape(
        cls, name: str, shape: SliceShape, hosts: Sequence[HostInfo]
    ) -> SliceInfo:
        """Builds the info of a TPU slice from its table shape and its hosts."""
        return cls(
            name=name,
            accelerator_type=shape.accelerator_type,
            topology=shape.topology,
            chips_per_host=shape.chips_per_host,
            devices_per_chip=shape.devices_per_chip,
            expected_hosts=shape.num_hosts,
            hosts=tuple(sorted(hosts, key=lambda h: h.worker_id)),
        )

    @property
    def num_hosts(self) -> int:
        """Hosts the slice has (present or not)."""
        return self.expected_hosts

    @property
    def complete(self) -> bool:
        """Whether every host of the slice is present, with worker ids 0..n-1."""
        return [h.worker_id for h in self.hosts] == list(range(self.expected_hosts))

    @property
    def host_addresses(self) -> tuple[str, ...]:
        """Host addresses in worker-id order."""
        return tuple(h.address for h in self.hosts)

    @property
    def devices_per_host(self) -> int:
        """JAX devices each host's process sees."""
        return self.chips_per_host * self.devices_per_chip

    @property
    def coordinator_address(self) -> str:
        """``host0:port`` of this slice's ``jax.distributed`` coordinator."""
        if not self.hosts:
            raise ValueError(f"Slice {self.name!r} has no hosts, so no coordinator.")
        return f"{self.hosts[0].address}:{self.coordinator_port}"


@dataclass(frozen=True)
class MegascaleInfo:
    """Multi-slice settings (the ``MEGASCALE_*`` variables) of this process.

    Attributes:
      num_slices: slices in the job.
      slice_id: this host's slice, in ``[0, num_slices)``.
      coordinator_host: host of slice 0's worker 0, without port.
      port: the MegaScale coordinator port.
    """

    num_slices: int
    slice_id: int
    coordinator_host: str | None
    port: int = DEFAULT_MEGASCALE_PORT


@dataclass(frozen=True)
class ClusterInfo:
    """What a resolver saw.

    Attributes:
      environment: ``gke``, ``gce``, ``ray`` or ``local``.
      source: where it looked, for messages (e.g. ``ray at 127.0.0.1:6379``).
      slices: the slices visible, sorted by name.
      current_slice: name of the slice this process runs on, if any.
      worker_id: this host's worker id in ``current_slice``, if any.
      megascale: multi-slice settings of this process, if set.
      notes: things the resolver skipped or found odd (a TPU node without slice
        labels, a slice missing a host), for ``jaxpod cluster`` to show.
    """

    environment: str
    source: str
    slices: tuple[SliceInfo, ...]
    current_slice: str | None = None
    worker_id: int | None = None
    megascale: MegascaleInfo | None = None
    notes: tuple[str, ...] = field(default=())

    def slice(self, name: str) -> SliceInfo:
        """The slice called ``name``.

        Raises:
          ValueError: no such slice; the message lists the ones there are.
        """
        for s in self.slices:
            if s.name == name:
                return s
        known = ", ".join(repr(s.name) for s in self.slices) or "none"
        raise ValueError(
            f"No TPU slice named {name!r} in {self.source}. Slices there: {known}."
        )


@runtime_checkable
class ClusterResolver(Protocol):
    """One environment's way of finding the TPU cluster.

    ``is_present`` is cheap (no network, no Ray connection); ``resolve`` does the work
    and raises ``ValueError`` naming the variable or attribute that is malformed.
    """

    environment: str

    def is_present(self) -> bool:
        """Whether this process runs in this resolver's environment."""
        ...

    def resolve(self) -> ClusterInfo:
        """Reads the environment into a :class:`ClusterInfo`."""
        ...


def parse_host_list(raw: str, *, source: str, expected: int | None) -> tuple[str, ...]:
    """Parses a comma-separated host list such as ``TPU_WORKER_HOSTNAMES``.

    Args:
      raw: the value as received.
      source: the variable or attribute it came from, named in errors.
      expected: how many hosts the accelerator type has, or ``None`` to skip the check.

    Returns:
      The host names or IPs, in worker-id order.

    Raises:
      ValueError: an empty or malformed entry, or the wrong number of entries.
    """
    entries = [e.strip() for e in raw.split(",")]
    for index, entry in enumerate(entries):
        if not _is_host(entry):
            raise ValueError(
                f"{source}={raw!r} is malformed: entry {index} ({entry!r}) is not a host "
                "name or IP address. Expected a comma-separated list of host names, one "
                "per TPU host in worker-id order, e.g. 'host-0,host-1'."
            )
    if expected is not None and len(entries) != expected:
        raise ValueError(
            f"{source}={raw!r} lists {len(entries)} host(s), but the accelerator type "
            f"has {expected}. Fix the host list or the accelerator type so they agree."
        )
    return tuple(entries)


def _is_host(entry: str) -> bool:
    if _HOSTNAME_RE.match(entry):
        return True
    try:
        ipaddress.ip_address(entry)
    except ValueError:
        return False
    return True


def parse_index(raw: str, *, source: str, count: int) -> int:
    """Parses an index such as ``TPU_WORKER_ID`` that must lie in ``[0, count)``.

    Raises:
      ValueError: not an integer, or out of range; names ``source``.
    """
    value = raw.strip()
    if not value.isdecimal() or int(value) >= count:
        raise ValueError(
            f"{source}={raw!r} is not valid. Expected an integer in [0, {count})."
        )
    return int(value)


def parse_positive(raw: str, *, source: str) -> int:
    """Parses a positive integer such as ``MEGASCALE_NUM_SLICES``.

    Raises:
      ValueError: not a positive integer; names ``source``.
    """
    value = raw.strip()
    if not value.isdecimal() or int(value) < 1:
        raise ValueError(f"{source}={raw!r} is not valid. Expected a positive integer.")
    return int(value)
