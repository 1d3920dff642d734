"""GKE: a TPU pod learns its slice from environment variables.

GKE's TPU webhook (and KubeRay on GKE) sets, in every container of a TPU slice:
``TPU_ACCELERATOR_TYPE`` (``v4-16``), ``TPU_TOPOLOGY`` (``2x2x2``), ``TPU_WORKER_ID``
(this host's index), ``TPU_WORKER_HOSTNAMES`` (all hosts, in worker-id order),
``TPU_NAME`` (the slice name) and, for multi-slice jobs, ``MEGASCALE_NUM_SLICES``,
``MEGASCALE_SLICE_ID``, ``MEGASCALE_COORDINATOR_ADDRESS`` (and ``MEGASCALE_PORT``).
The simulated local cluster sets the same variables on its simulated hosts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from jaxpod.service.capacity.resolvers._tpu_vm import Setting, TpuVmSettings, resolve_tpu_vm
from jaxpod.service.capacity.resolvers.base import ClusterInfo

#: Any of these set means "this container runs on a GKE TPU host".
PRESENCE_VARS = ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")


class GkeResolver:
    """Resolves this host's slice from GKE's TPU environment variables."""

    environment = "gke"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        """Args:
        environ: the variables to read; ``os.environ`` when ``None`` (injectable
          so tests and callers can resolve another process's environment).
        """
        self._environ = environ

    @property
    def environ(self) -> Mapping[str, str]:
        """The variables this resolver reads."""
        return os.environ if self._environ is None else self._environ

    def is_present(self) -> bool:
        """Whether any of :data:`PRESENCE_VARS` is set."""
        return any(self.environ.get(v) for v in PRESENCE_VARS)

    def resolve(self) -> ClusterInfo:
        """Reads the variables into this host's slice.

        Raises:
          ValueError: a missing or malformed variable, named in the message.
        """
        env = self.environ

        def setting(name: str) -> Setting:
            return Setting(name, env.get(name))

        settings = TpuVmSettings(
            accelerator_type=setting("TPU_ACCELERATOR_TYPE"),
            topology=setting("TPU_TOPOLOGY"),
            chips_per_host_bounds=setting("TPU_CHIPS_PER_HOST_BOUNDS"),
            worker_id=setting("TPU_WORKER_ID"),
            hostnames=setting("TPU_WORKER_HOSTNAMES"),
            name=setting("TPU_NAME"),
            megascale_num_slices=setting("MEGASCALE_NUM_SLICES"),
            megascale_slice_id=setting("MEGASCALE_SLICE_ID"),
            megascale_coordinator=setting("MEGASCALE_COORDINATOR_ADDRESS"),
            megascale_port=setting("MEGASCALE_PORT"),
        )
        return resolve_tpu_vm(settings, environment=self.environment, source="GKE env vars")
