"""The device mesh of a global-view job (DESIGN §8): named axes over a whole slice.

A job says ``mesh={"data": -1, "model": 2}``: axis names to sizes, in order, with at
most one ``-1`` taking the devices the others leave. On one slice the devices are laid
out by ``mesh_utils.create_device_mesh`` (on TPUs it follows the chips' physical
torus, so the last axes, which talk most, stay on neighbouring chips). Devices that
carry ``slice_index`` belong to several slices joined by the data-centre network
(multislice): the mesh is then slice-major, as ``create_hybrid_device_mesh`` builds it,
so the first axis (data parallelism, one all-reduce per step) spans the slices and every
other axis stays inside one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxpod.jobs import check_mesh_axes


def mesh_sizes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """``axes`` with its ``-1`` resolved, checked to cover ``num_devices`` exactly.

    Raises:
      TypeError, ValueError: the names, the sizes or their product are wrong (the
        message says what was received and how to fix it).
    """
    sizes = check_mesh_axes(axes)
    free = [name for name, size in sizes.items() if size == -1]
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh {axes!r}: the slice's {num_devices} devices do not divide by the "
                f"fixed axes' product {fixed}; give axes whose sizes divide "
                f"{num_devices}.")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"mesh {axes!r}: its axes cover {math.prod(sizes.values())} devices, the "
            f"slice has {num_devices}. Make the sizes multiply to {num_devices}, or "
            "let one axis be -1.")
    return sizes


def slice_major_mesh(axes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """The job's mesh over ``devices`` (default: every device of the slice).

    Raises:
      TypeError, ValueError: as :func:`mesh_sizes`, or on several slices when the first
        axis is not a multiple of the slice count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(axes, len(devices))
    names, shape = tuple(sizes), tuple(sizes.values())
    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    if len(slices) <= 1:
        return Mesh(mesh_utils.create_device_mesh(shape, devices), names)
    if shape[0] % len(slices):
        raise ValueError(
            f"mesh {dict(axes)!r} on {len(slices)} slices: the first axis "
            f"({names[0]!r}, size {shape[0]}) spans the slices, so its size must be a "
            f"multiple of {len(slices)}. Put the data-parallel axis first.")
    inner = (shape[0] // len(slices), *shape[1:])
    outer = (len(slices),) + (1,) * (len(shape) - 1)
    return Mesh(mesh_utils.create_hybrid_device_mesh(inner, outer, devices), names)
