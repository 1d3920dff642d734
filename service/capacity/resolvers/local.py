"""Local: this host's own JAX devices as a one-host slice.

On a real TPU VM the devices' kind names the generation (``TPU v4``) and their count
gives the accelerator type (4 devices of ``TPU v4`` → ``v4-8``). On CPU (including
``--xla_force_host_platform_device_count=N`` / ``jax_num_cpu_devices``), every device
stands for one simulated chip and the slice is reported as ``cpu-N``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxpod.service.capacity.resolvers.base import ClusterInfo, HostInfo, SliceInfo
from jaxpod.service.capacity.topology import GENERATIONS, Generation, slice_shape

LOCAL_SLICE_NAME = "local"
LOCAL_ADDRESS = "localhost"

# ``device_kind`` prefixes JAX reports, most specific first.
_KIND_TO_GENERATION = (
    ("tpu v5 lite", "v5litepod"),
    ("tpu v5e", "v5litepod"),
    ("tpu v5p", "v5p"),
    ("tpu v5", "v5p"),
    ("tpu v6 lite", "v6e"),
    ("tpu v6e", "v6e"),
    ("tpu v4", "v4"),
)


def _jax_local_devices() -> Sequence[Any]:
    import jax

    return list(jax.local_devices())


class LocalResolver:
    """Resolves this host's JAX devices; always present, so ``auto()`` ends here."""

    environment = "local"

    def __init__(self, devices: Callable[[], Sequence[Any]] | None = None) -> None:
        """Args:
        devices: returns the devices to describe (objects with ``platform`` and
          ``device_kind``); ``jax.local_devices`` when ``None``.
        """
        self._devices = devices or _jax_local_devices

    def is_present(self) -> bool:
        """Always true: every process has local devices."""
        return True

    def resolve(self) -> ClusterInfo:
        """Describes the local devices as one slice with one host, worker 0."""
        devices = list(self._devices())
        if not devices:
            raise ValueError("JAX reports no local devices, so there is nothing to resolve.")
        info = _slice(devices)
        return ClusterInfo(
            environment=self.environment,
            source=f"this host's {len(devices)} {devices[0].platform} device(s)",
            slices=(info,),
            current_slice=info.name,
            worker_id=0,
        )


def _slice(devices: Sequence[Any]) -> SliceInfo:
    count = len(devices)
    generation = _generation(devices[0]) if devices[0].platform == "tpu" else None
    if generation is None:
        host = HostInfo(worker_id=0, address=LOCAL_ADDRESS, chips=count)
        return SliceInfo(LOCAL_SLICE_NAME, f"{devices[0].platform}-{count}", str(count),
                         count, 1, 1, (host,))
    chips = count // generation.devices_per_chip
    shape = slice_shape(f"{generation.name}-{generation.type_number_for(chips)}")
    host = HostInfo(worker_id=0, address=LOCAL_ADDRESS, chips=chips)
    return SliceInfo.from_shape(LOCAL_SLICE_NAME, shape, [host])


def _generation(device: Any) -> Generation | None:
    kind = str(getattr(device, "device_kind", "")).lower()
    for prefix, name in _KIND_TO_GENERATION:
        if kind.startswith(prefix):
            return next(g for g in GENERATIONS if g.name == name)
    return None
