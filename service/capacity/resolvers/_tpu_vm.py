"""Turns the settings a TPU VM receives (from env vars or from GCE metadata) into a slice.

GKE and GCE hand a TPU host the same facts under different names: accelerator type,
topology, worker id, the slice's host list, the slice name and the ``MEGASCALE_*``
multi-slice values. Both resolvers read their own source into a :class:`TpuVmSettings`
and call :func:`resolve_tpu_vm`, so the checks (and their messages, which name the
variable or attribute the bad value came from) are the same for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpod.service.capacity.resolvers.base import (
    DEFAULT_MEGASCALE_PORT,
    ClusterInfo,
    HostInfo,
    MegascaleInfo,
    SliceInfo,
    parse_host_list,
    parse_index,
    parse_positive,
)
from jaxpod.service.capacity.topology import SliceShape, slice_shape


@dataclass(frozen=True)
class Setting:
    """One raw value and where it came from.

    Attributes:
      source: the variable or metadata attribute, named in error messages.
      value: the value as received, ``None`` when absent.
    """

    source: str
    value: str | None = None


@dataclass(frozen=True)
class TpuVmSettings:
    """The raw per-host TPU settings of one environment."""

    accelerator_type: Setting
    topology: Setting
    chips_per_host_bounds: Setting
    worker_id: Setting
    hostnames: Setting
    name: Setting
    megascale_num_slices: Setting
    megascale_slice_id: Setting
    megascale_coordinator: Setting
    megascale_port: Setting


def resolve_tpu_vm(settings: TpuVmSettings, *, environment: str, source: str) -> ClusterInfo:
    """Builds the one-slice view of a TPU host from its settings.

    Args:
      settings: the raw values and their sources.
      environment: ``gke`` or ``gce``.
      source: where they were read, for messages.

    Returns:
      A :class:`ClusterInfo` with this host's slice as ``current_slice``.

    Raises:
      ValueError: a missing or malformed value, or values that disagree (host count
        vs accelerator type, topology vs chip count); the message names the source.
    """
    shape = _shape(settings)
    hosts = _hosts(settings.hostnames, shape)
    worker_id = _worker_id(settings.worker_id, shape)
    name = settings.name.value or f"{environment}-{shape.accelerator_type}"
    slice_info = SliceInfo.from_shape(
        name,
        shape,
        [HostInfo(worker_id=i, address=h, chips=shape.chips_per_host) for i, h in enumerate(hosts)],
    )
    return ClusterInfo(
        environment=environment,
        source=source,
        slices=(slice_info,),
        current_slice=name,
        worker_id=worker_id,
        megascale=_megascale(settings),
    )


def _shape(settings: TpuVmSettings) -> SliceShape:
    acc = settings.accelerator_type
    if not acc.value:
        raise ValueError(
            f"{acc.source} is not set, so the TPU slice cannot be resolved. Set it to "
            "the slice's accelerator type, e.g. 'v4-16'."
        )
    chips_per_host = _chips_per_host(settings.chips_per_host_bounds)
    try:
        return slice_shape(acc.value, settings.topology.value or None, chips_per_host)
    except ValueError as e:
        raise ValueError(
            f"{acc.source}={acc.value!r}, {settings.topology.source}="
            f"{settings.topology.value!r}: {e}"
        ) from e


def _chips_per_host(bounds: Setting) -> int | None:
    if not bounds.value:
        return None
    parts = bounds.value.split(",")
    if not all(p.strip().isdecimal() and int(p) > 0 for p in parts):
        raise ValueError(
            f"{bounds.source}={bounds.value!r} is malformed. Expected positive integers "
            "joined by ',', e.g. '2,2,1'."
        )
    return math.prod(int(p) for p in parts)


def _hosts(hostnames: Setting, shape: SliceShape) -> tuple[str, ...]:
    if hostnames.value is None:
        if shape.num_hosts == 1:
            return ("localhost",)
        raise ValueError(
            f"{hostnames.source} is not set, but a {shape.accelerator_type} slice has "
            f"{shape.num_hosts} hosts. Set it to the comma-separated host names of the "
            "slice in worker-id order."
        )
    return parse_host_list(hostnames.value, source=hostnames.source, expected=shape.num_hosts)


def _worker_id(worker_id: Setting, shape: SliceShape) -> int:
    if worker_id.value is None:
        if shape.num_hosts == 1:
            return 0
        raise ValueError(
            f"{worker_id.source} is not set, but a {shape.accelerator_type} slice has "
            f"{shape.num_hosts} hosts. Set it to this host's index in [0, {shape.num_hosts})."
        )
    return parse_index(worker_id.value, source=worker_id.source, count=shape.num_hosts)


def _megascale(settings: TpuVmSettings) -> MegascaleInfo | None:
    num, sid = settings.megascale_num_slices, settings.megascale_slice_id
    coord, port = settings.megascale_coordinator, settings.megascale_port
    if not num.value:
        if sid.value or coord.value:
            raise ValueError(
                f"{sid.source} / {coord.source} are set but {num.source} is not. Set "
                f"{num.source} to the number of slices, or unset the others."
            )
        return None
    num_slices = parse_positive(num.value, source=num.source)
    slice_id = parse_index(sid.value or "0", source=sid.source, count=num_slices)
    host = _strip_port(coord.value.strip()) if coord.value else None
    if num_slices > 1 and not host:
        raise ValueError(
            f"{num.source}={num.value!r} asks for {num_slices} slices, but "
            f"{coord.source} is not set. Set it to the address of slice 0's worker 0."
        )
    megascale_port = (
        parse_positive(port.value, source=port.source) if port.value else DEFAULT_MEGASCALE_PORT
    )
    return MegascaleInfo(num_slices, slice_id, host or None, megascale_port)


def _strip_port(address: str) -> str:
    """``host:port`` → ``host``; a bare host or IPv6 address is returned unchanged."""
    if address.startswith("[") and "]" in address:
        return address[1 : address.index("]")]
    return address.split(":")[0] if address.count(":") == 1 else address
