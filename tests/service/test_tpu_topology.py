"""The topology table against hand-written facts and against Ray's own TPU arithmetic."""

from __future__ import annotations

import math

import pytest
from ray._private.accelerators.tpu import (
    TPUAcceleratorManager,
    get_chips_per_host,
    get_num_chips_from_topology,
    get_tpu_cores_per_chip,
    infer_tpu_pod_type_from_topology,
)

from jaxpod.service.capacity.topology import (
    GENERATIONS,
    known_accelerator_types,
    parse_topology,
    slice_shape,
)

# (chips, hosts, chips per host, topology), from the Cloud TPU docs per generation.
FACTS = {
    "v4-8": (4, 1, 4, "2x2x1"),
    "v4-16": (8, 2, 4, "2x2x2"),
    "v4-32": (16, 4, 4, "2x2x4"),
    "v4-2048": (1024, 256, 4, "8x8x16"),
    "v5p-8": (4, 1, 4, "2x2x1"),
    "v5p-16": (8, 2, 4, "2x2x2"),
    "v5p-12288": (6144, 1536, 4, "16x16x24"),
    "v5litepod-1": (1, 1, 1, "1x1"),
    "v5litepod-4": (4, 1, 4, "2x2"),
    "v5litepod-8": (8, 1, 8, "2x4"),
    "v5litepod-16": (16, 4, 4, "4x4"),
    "v5litepod-256": (256, 64, 4, "16x16"),
    "v6e-1": (1, 1, 1, "1x1"),
    "v6e-8": (8, 1, 8, "2x4"),
    "v6e-16": (16, 4, 4, "4x4"),
    "v6e-256": (256, 64, 4, "16x16"),
}


@pytest.mark.parametrize("accelerator_type", sorted(FACTS))
def test_known_shapes(accelerator_type: str) -> None:
    chips, hosts, per_host, topology = FACTS[accelerator_type]
    shape = slice_shape(accelerator_type)
    assert (shape.chips, shape.num_hosts, shape.chips_per_host, shape.topology) == (
        chips, hosts, per_host, topology)
    assert shape.devices_per_host == per_host  # one JAX device per chip
    assert shape.head_resource == f"TPU-{accelerator_type}-head"


def test_v4_counts_cores_and_v6e_counts_chips() -> None:
    assert slice_shape("v4-16").num_cores == 16
    assert slice_shape("v4-16").chips == 8
    assert slice_shape("v6e-16").chips == 16
    assert slice_shape("v6e-16").num_cores == 16
    assert slice_shape("v5p-16").chips == 8


@pytest.mark.parametrize("accelerator_type", known_accelerator_types())
def test_every_known_type_agrees_with_ray(accelerator_type: str) -> None:
    """Ray decides the resources real TPU hosts advertise; the table must agree with it."""
    shape = slice_shape(accelerator_type)
    generation = shape.generation.name
    assert math.prod(parse_topology(shape.topology)) == shape.chips
    assert get_num_chips_from_topology(shape.topology) == shape.chips
    assert get_tpu_cores_per_chip(accelerator_type) == shape.cores_per_chip
    assert infer_tpu_pod_type_from_topology(shape.topology, f"TPU-{generation.upper()}") == (
        accelerator_type)
    assert TPUAcceleratorManager.is_valid_tpu_accelerator_topology(generation, shape.topology)
    if shape.num_hosts > 1 or shape.chips <= 8:
        assert get_chips_per_host(shape.topology, generation) == shape.chips_per_host


@pytest.mark.parametrize("spelling", ["V4-16", "tpu-v4-16", "TPU-V4-16", " v4-16 "])
def test_spellings(spelling: str) -> None:
    assert slice_shape(spelling).accelerator_type == "v4-16"


def test_v5e_alias_is_v5litepod() -> None:
    assert slice_shape("v5e-16").accelerator_type == "v5litepod-16"


@pytest.mark.parametrize("bad", ["v3-8", "v4-12", "v6e-2", "tpu", "", "v7x-8", "v4_16"])
def test_unknown_types_list_the_known_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="Unknown TPU accelerator type") as info:
        slice_shape(bad)
    for generation in GENERATIONS:
        assert generation.name in str(info.value)
    assert "v4-{8,16,32" in str(info.value)


def test_explicit_topology_is_checked() -> None:
    assert slice_shape("v4-16", "2x2x2").topology == "2x2x2"
    assert slice_shape("v4-16", "1x2x4").topology == "1x2x4"
    with pytest.raises(ValueError, match=r"'2x2x4' does not match accelerator type 'v4-16'"):
        slice_shape("v4-16", "2x2x4")
    with pytest.raises(ValueError, match="3-D"):
        slice_shape("v4-16", "2x4")
    with pytest.raises(ValueError, match="malformed"):
        slice_shape("v4-16", "2x2xx")


def test_chips_per_host_override() -> None:
    two_vms = slice_shape("v6e-8", "2x4", chips_per_host=4)
    assert (two_vms.num_hosts, two_vms.chips_per_host) == (2, 4)
    with pytest.raises(ValueError, match="8 chips per host does not fit"):
        slice_shape("v4-16", chips_per_host=8)
    with pytest.raises(ValueError, match="3 chips per host"):
        slice_shape("v6e-16", chips_per_host=3)
