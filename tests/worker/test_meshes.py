"""Global-view jobs' meshes: named axes, -1 resolved, slice-major on multislice.

No multislice TPU exists here, so the multislice layout is checked on stand-in device
objects carrying ``slice_index`` (and the attributes ``mesh_utils`` reads), as devices
of two or four slices report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import pytest

from jaxpod.worker.meshes import mesh_sizes, slice_major_mesh


@dataclass(frozen=True)
class FakeDevice:
    """What ``mesh_utils`` reads of a device."""

    id: int
    slice_index: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def devices_of(slices: int, per_slice: int, hosts_per_slice: int = 2) -> list[FakeDevice]:
    per_host = per_slice // hosts_per_slice
    devices = [FakeDevice(s * per_slice + i, s, s * hosts_per_slice + i // per_host)
               for s in range(slices) for i in range(per_slice)]
    return devices[::-1]  # in no helpful order: the layout must not depend on it


@pytest.mark.parametrize(("axes", "devices", "want"), [
    ({"data": -1}, 8, {"data": 8}),
    ({"data": -1, "model": 2}, 8, {"data": 4, "model": 2}),
    ({"data": 2, "fsdp": -1, "model": 2}, 16, {"data": 2, "fsdp": 4, "model": 2}),
    ({"data": 4, "model": 2}, 8, {"data": 4, "model": 2}),
])
def test_sizes_resolve_the_free_axis(axes: dict[str, int], devices: int,
                                     want: dict[str, int]) -> None:
    sizes = mesh_sizes(axes, devices)
    assert sizes == want and list(sizes) == list(axes)


@pytest.mark.parametrize(("axes", "error", "match"), [
    ({"data": 3, "model": 2}, ValueError, "cover 6 devices, the slice has 8"),
    ({"data": -1, "model": 3}, ValueError, "do not divide by the fixed axes' product 3"),
    ({"data": -1, "model": -1}, ValueError,
     r"only one axis may be -1 \(the rest of the devices\). Got \['data', 'model'\]"),
    ({"data": 0}, ValueError, "axis 'data' must have a positive size"),
    ({"data": 2.0}, ValueError, "axis 'data' must have a positive size"),
    ({1: 8}, TypeError, "axis names must be identifiers"),
    ({}, TypeError, "mesh must be a dict"),
    ([("data", 8)], TypeError, "mesh must be a dict"),
])
def test_bad_axes_say_what_to_fix(axes: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        mesh_sizes(axes, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize(("slices", "axes"), [
    (2, {"data": -1, "model": 2}),
    (4, {"data": -1, "model": 4}),
    (2, {"data": 4, "fsdp": 2, "model": 2}),
])
def test_multislice_meshes_are_slice_major(slices: int, axes: dict[str, int]) -> None:
    per_slice = 8
    mesh = slice_major_mesh(axes, devices_of(slices, per_slice))
    grid = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert mesh.axis_names == tuple(axes)
    assert grid.shape == tuple(mesh_sizes(axes, slices * per_slice).values())
    # The first axis spans the slices in order, a block of rows per slice; every other
    # axis stays inside one slice.
    rows = grid.shape[0] // slices
    for s in range(slices):
        assert (grid[s * rows:(s + 1) * rows] == s).all()
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert sorted(ids.ravel()) == list(range(slices * per_slice))


def test_a_multislice_first_axis_must_span_the_slices() -> None:
    with pytest.raises(ValueError, match=r"first axis \('data', size 2\) spans the slices"):
        slice_major_mesh({"data": 2, "model": -1}, devices_of(4, 4))


def test_one_slice_uses_the_devices_as_they_are() -> None:
    mesh = slice_major_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": len(jax.devices()) // 2, "model": 2}
    assert sorted(d.id for d in mesh.devices.ravel()) == sorted(d.id for d in jax.devices())
