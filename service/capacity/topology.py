"""The TPU topology table: what an accelerator type such as ``v4-16`` is made of.

The number in an accelerator type counts **TensorCores** for v4 and v5p (2 cores per
chip: ``v4-16`` is 8 chips on 2 hosts) and **chips** for v5e and v6e (``v6e-16`` is 16
chips on 4 hosts). Multi-host slices have 4 chips per host on every generation here;
v5e and v6e single-host slices pack up to 8 chips on one host. JAX sees one device per
chip on all four generations (v4 and v5p run their two cores as one "megacore"
device).

Sources: Cloud TPU system-architecture pages per generation, and the identical rules
in ``ray._private.accelerators.tpu`` (``get_tpu_cores_per_chip``,
``get_chips_per_host``), which decide the resources a real TPU host advertises.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

#: Chips on one host of a multi-host slice, for every generation in the table.
MULTI_HOST_CHIPS_PER_HOST = 4
#: Chip counts a single TPU host (or a Ray ``TPU`` resource request) can have.
VALID_CHIPS_PER_HOST = (1, 2, 4, 8)


@dataclass(frozen=True)
class Generation:
    """One TPU generation.

    Attributes:
      name: the prefix of its accelerator types, as GKE/GCE and Ray spell it
        (``v4``, ``v5litepod``, ``v5p``, ``v6e``).
      aliases: other prefixes accepted on input (``v5e`` for ``v5litepod``).
      cores_per_chip: TensorCores on one chip.
      devices_per_chip: JAX devices one chip shows up as.
      counts: what the number in the accelerator type counts: ``"cores"`` or ``"chips"``.
      max_single_host_chips: the largest slice that still fits on one host.
      topology_dims: 3 for the 3-D torus generations, 2 for the 2-D ones.
      default_topologies: the default physical topology per accelerator-type number.
    """

    name: str
    aliases: tuple[str, ...]
    cores_per_chip: int
    devices_per_chip: int
    counts: Literal["cores", "chips"]
    max_single_host_chips: int
    topology_dims: int
    default_topologies: Mapping[int, str]

    def chips_for(self, type_number: int) -> int:
        """Chips in the slice whose accelerator-type number is ``type_number``."""
        if self.counts == "chips":
            return type_number
        return type_number // self.cores_per_chip

    def type_number_for(self, chips: int) -> int:
        """The accelerator-type number of a slice with ``chips`` chips."""
        return chips if self.counts == "chips" else chips * self.cores_per_chip


def _table(pairs: dict[int, str]) -> Mapping[int, str]:
    return MappingProxyType(dict(sorted(pairs.items())))


_V4_TOPOLOGIES = _table({
    8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8",
    512: "4x8x8", 1024: "8x8x8", 1536: "8x8x12", 2048: "8x8x16",
})
_V5P_TOPOLOGIES = _table({
    8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8",
    384: "4x4x12", 512: "4x8x8", 768: "4x8x12", 1024: "8x8x8", 1536: "8x8x12",
    2048: "8x8x16", 3072: "8x12x16", 4096: "8x16x16", 6144: "12x16x16",
    8192: "16x16x16", 12288: "16x16x24",
})
_LITE_TOPOLOGIES = _table({
    1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
    256: "16x16",
})

GENERATIONS: tuple[Generation, ...] = (
    Generation("v4", (), 2, 1, "cores", 4, 3, _V4_TOPOLOGIES),
    Generation("v5litepod", ("v5e",), 1, 1, "chips", 8, 2, _LITE_TOPOLOGIES),
    Generation("v5p", (), 2, 1, "cores", 4, 3, _V5P_TOPOLOGIES),
    Generation("v6e", (), 1, 1, "chips", 8, 2, _LITE_TOPOLOGIES),
)
_BY_PREFIX: Mapping[str, Generation] = MappingProxyType(
    {p: g for g in GENERATIONS for p in (g.name, *g.aliases)}
)
_TYPE_RE = re.compile(r"^(?:tpu-?)?(?P<prefix>v\d+[a-z]*)-(?P<number>\d+)$")


@dataclass(frozen=True)
class SliceShape:
    """What one TPU slice of a given accelerator type and topology consists of.

    Attributes:
      accelerator_type: canonical type, e.g. ``v4-16`` or ``v5litepod-16``; equals the
        ``ray.io/tpu-pod-type`` label of its hosts.
      generation: the generation's row of the table.
      topology: physical chip topology, e.g. ``2x2x2`` or ``4x4``.
      chips: chips in the slice.
      chips_per_host: chips on each host (the ``TPU`` resource of each Ray node).
      num_hosts: hosts (TPU VMs, Ray nodes, JAX processes) in the slice.
    """

    accelerator_type: str
    generation: Generation
    topology: str
    chips: int
    chips_per_host: int
    num_hosts: int

    @property
    def cores_per_chip(self) -> int:
        """TensorCores per chip."""
        return self.generation.cores_per_chip

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip."""
        return self.generation.devices_per_chip

    @property
    def devices_per_host(self) -> int:
        """JAX devices one host's process sees (``jax.local_device_count()``)."""
        return self.chips_per_host * self.devices_per_chip

    @property
    def num_devices(self) -> int:
        """JAX devices in the whole slice (``jax.device_count()`` on one slice)."""
        return self.chips * self.devices_per_chip

    @property
    def num_cores(self) -> int:
        """TensorCores in the slice."""
        return self.chips * self.cores_per_chip

    @property
    def head_resource(self) -> str:
        """The Ray resource only worker 0 of such a slice has: ``TPU-<type>-head``."""
        return f"TPU-{self.accelerator_type}-head"

    @property
    def ray_accelerator_type(self) -> str:
        """Ray's accelerator-type name (``TPU-V4``), the ``ray.io/accelerator-type`` label."""
        return f"TPU-{self.generation.name.upper()}"


def known_accelerator_types() -> tuple[str, ...]:
    """Every accelerator type the table knows, generation by generation."""
    return tuple(f"{g.name}-{n}" for g in GENERATIONS for n in g.default_topologies)


def _known_summary() -> str:
    return "; ".join(
        f"{g.name}-{{{','.join(str(n) for n in g.default_topologies)}}}"
        + (f" (alias {', '.join(g.aliases)})" if g.aliases else "")
        for g in GENERATIONS
    )


def parse_topology(topology: str) -> tuple[int, ...]:
    """Splits ``"2x2x2"`` into ``(2, 2, 2)``.

    Raises:
      ValueError: not positive integers joined by ``x``.
    """
    parts = topology.strip().lower().split("x")
    if len(parts) < 2 or not all(p.isdecimal() and int(p) > 0 for p in parts):
        raise ValueError(
            f"TPU topology {topology!r} is malformed. Expected positive integers joined "
            "by 'x', e.g. '2x2x2' (v4, v5p) or '4x4' (v5e, v6e)."
        )
    return tuple(int(p) for p in parts)


def parse_accelerator_type(accelerator_type: str) -> tuple[Generation, int]:
    """Splits an accelerator type into its generation and its number.

    Accepts any case and Ray's ``TPU-`` prefix; ``v5e-N`` means ``v5litepod-N``.

    Raises:
      ValueError: the generation or the size is not in the table; the message lists
        the known types.
    """
    match = _TYPE_RE.match(accelerator_type.strip().lower())
    generation = _BY_PREFIX.get(match["prefix"]) if match else None
    if match is None or generation is None or int(match["number"]) not in (
        generation.default_topologies
    ):
        raise ValueError(
            f"Unknown TPU accelerator type {accelerator_type!r}. Known types: "
            f"{_known_summary()}."
        )
    return generation, int(match["number"])


def slice_shape(
    accelerator_type: str,
    topology: str | None = None,
    chips_per_host: int | None = None,
) -> SliceShape:
    """Looks an accelerator type up in the table.

    Args:
      accelerator_type: e.g. ``v4-16``, ``v6e-16``, ``v5litepod-4``, ``TPU-v4-8``.
      topology: the slice's physical topology when known (``TPU_TOPOLOGY``, the
        ``ray.io/tpu-topology`` label); it is checked against the chip count. ``None``
        takes the generation's default.
      chips_per_host: chips per host when known (a Ray node's ``TPU`` resource); it
        resolves e.g. a v6e ``2x4`` slice built from two 4-chip hosts. ``None`` takes
        the table's rule.

    Returns:
      The slice's shape.

    Raises:
      ValueError: unknown type, or a topology / chips-per-host that does not fit it.
    """
    generation, number = parse_accelerator_type(accelerator_type)
    canonical = f"{generation.name}-{number}"
    chips = generation.chips_for(number)
    topo = _check_topology(canonical, generation, chips, topology)
    per_host = _check_chips_per_host(canonical, generation, chips, chips_per_host)
    return SliceShape(canonical, generation, topo, chips, per_host, chips // per_host)


def _check_topology(
    canonical: str, generation: Generation, chips: int, topology: str | None
) -> str:
    if topology is None:
        return generation.default_topologies[generation.type_number_for(chips)]
    dims = parse_topology(topology)
    if math.prod(dims) != chips or len(dims) != generation.topology_dims:
        raise ValueError(
            f"TPU topology {topology!r} does not match accelerator type {canonical!r}: "
            f"{canonical} has {chips} chips in a {generation.topology_dims}-D topology "
            f"(default {generation.default_topologies[generation.type_number_for(chips)]!r})"
            f", {topology!r} has {math.prod(dims)} chips in {len(dims)}-D."
        )
    return "x".join(str(d) for d in dims)


def _check_chips_per_host(
    canonical: str, generation: Generation, chips: int, chips_per_host: int | None
) -> int:
    if chips_per_host is None:
        if chips <= generation.max_single_host_chips:
            return chips
        return MULTI_HOST_CHIPS_PER_HOST
    if (
        chips_per_host not in VALID_CHIPS_PER_HOST
        or chips % chips_per_host
        or chips_per_host > generation.max_single_host_chips
    ):
        raise ValueError(
            f"{chips_per_host} chips per host does not fit accelerator type {canonical!r} "
            f"({chips} chips; a {generation.name} host has one of "
            f"{[c for c in VALID_CHIPS_PER_HOST if c <= generation.max_single_host_chips]}"
            " chips and the slice must be a whole number of hosts)."
        )
    return chips_per_host
