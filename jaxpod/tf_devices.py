"""TF's device names for a jaxpod strategy's replicas.

:class:`TFDevicesMixin` gives a strategy ``worker_devices``, ``parameter_devices``,
``get_host_cpu_device`` and ``worker_device_index``, named as TF names devices
(``/job:worker/replica:0/task:<host>/device:<kind>:<n>``), and checks that the
``destinations`` TF1 members take name them. :class:`jaxpod.tf_compat.TFCompatMixin`
builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.scope import get_strategy
from jaxpod.types import ValueContext
from jaxpod.values import PerReplica

_PLATFORMS = ("cpu", "gpu", "tpu", "cuda", "rocm")


# Module-level, so they compile once per strategy and ship by reference.
def _replica_id(ctx: ValueContext) -> np.ndarray:
    return np.asarray(ctx.replica_id_in_sync_group, np.int32)


def _device_table() -> jax.Array:
    """Per replica: (host index, platform, device ordinal on its host) of its logical
    device 0, read from the strategy running the step (while it is traced)."""
    replica_devices = get_strategy().device_assignment.replica_devices
    processes = sorted({d.process_index for d in replica_devices[:, 0]})
    rows = []
    for d in replica_devices[:, 0]:
        on_host = [x for x in jax.devices() if x.process_index == d.process_index]
        platform = _PLATFORMS.index(d.platform) if d.platform in _PLATFORMS else -1
        rows.append([processes.index(d.process_index), platform, on_host.index(d)])
    return jnp.asarray(np.asarray(rows, np.int32))


def _device_name(host: int, kind: str, ordinal: int) -> str:
    return f"/job:worker/replica:0/task:{host}/device:{kind}:{ordinal}"


def _short(name: str) -> str:
    """A device name without its job and replica parts (``/task:0/device:CPU:0``)."""
    return "/" + "/".join(p for p in name.strip("/").split("/")
                          if not p.startswith(("job:", "replica:")))


def _shorts(names: Iterable[str]) -> set[str]:
    return {_short(n) for n in names}


class TFDevicesMixin:
    """TF's device members, composed from a strategy's own ``run``, ``reduce``,
    ``experimental_distribute_values_from_function`` and ``num_hosts``."""

    if TYPE_CHECKING:
        # The strategy's own members (run, num_hosts...), as the type checker sees them
        # from here.
        def __getattr__(self, name: str) -> Any: ...

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Each replica's device (its logical device 0), in replica order, named as TF
        names devices: ``/job:worker/replica:0/task:<host>/device:<TPU|CPU|GPU>:<n>``
        (``n`` counts the host's devices)."""
        cached = self.__dict__.get("_tf_worker_devices")
        if cached is None:
            # Every replica computes the whole table: their maximum is that table.
            table = np.asarray(self.reduce("MAX", self.run(_device_table), axis=None))
            cached = tuple(
                _device_name(int(host), _PLATFORMS[p].upper() if p >= 0 else "DEVICE",
                             int(ordinal)) for host, p, ordinal in table)
            self.__dict__["_tf_worker_devices"] = cached
        return cached

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where values live: every replica's device (``worker_devices``)."""
        return self.worker_devices

    def get_host_cpu_device(self, host_id: int) -> str:
        """The CPU device of host ``host_id`` (what feeds its replicas)."""
        if not isinstance(host_id, int) or isinstance(host_id, bool) or \
                not 0 <= host_id < self.num_hosts:
            raise ValueError(
                f"get_host_cpu_device: host_id must be an int in [0, {self.num_hosts}). "
                f"Got {host_id!r}.")
        return _device_name(host_id, "CPU", 0)

    @property
    def worker_device_index(self) -> Any:
        """A ``PerReplica`` int32 holding each replica's index: passed to
        ``call_for_each_tower``, each replica's ``fn`` gets its own index into
        ``worker_devices``."""
        cached = self.__dict__.get("_tf_worker_device_index")
        if cached is None:
            cached = self.experimental_distribute_values_from_function(_replica_id)
            self.__dict__["_tf_worker_device_index"] = cached
        return cached

    def _check_destinations(self, what: str, destinations: Any) -> None:
        """Destinations are where TF copied a result; jaxpod values live on every
        replica. Accepts ``None``, values, and device names of this strategy."""
        if destinations is None or isinstance(destinations, PerReplica):
            return
        names = [destinations] if isinstance(destinations, str) else destinations
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            return  # a value (e.g. a mirrored pytree): it lives on every replica
        known = set(self.worker_devices) | {self.get_host_cpu_device(h)
                                            for h in range(self.num_hosts)}
        unknown = [n for n in names if n not in known and _short(n) not in _shorts(known)]
        if unknown:
            raise ValueError(
                f"{what}: destinations {unknown} are not devices of this strategy; use "
                f"names from strategy.worker_devices (e.g. {self.worker_devices[0]!r}) or "
                "None.")
