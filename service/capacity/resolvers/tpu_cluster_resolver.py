"""``jaxpod.TPUClusterResolver``: one slice of the resolved environment, TF-style.

Mirrors ``tf.distribute.cluster_resolver.TPUClusterResolver(tpu=...)``: ``tpu`` ``None``
or ``''`` resolves this environment (:func:`jaxpod.service.capacity.resolvers.auto`),
``'local'`` this host's devices, and any other string names a slice to pick from the
environment (useful against a Ray cluster with several slices).
"""

from __future__ import annotations

from jaxpod.service.capacity.resolvers.base import (
    ClusterInfo,
    ClusterResolver,
    MegascaleInfo,
    SliceInfo,
)
from jaxpod.service.capacity.topology import parse_accelerator_type


class TPUClusterResolver:
    """The slice this process works with, and the cluster it was found in.

    Attributes:
      cluster: everything the resolver saw (all slices, notes).
      environment: ``gke``, ``gce``, ``ray`` or ``local``.
    """

    def __init__(
        self,
        tpu: str | None = None,
        *,
        environment: str | None = None,
        resolver: ClusterResolver | None = None,
    ) -> None:
        """Resolves the environment now (like TF's resolver, which queries at construction).

        Args:
          tpu: ``None``/``''``: this environment; ``'local'``: this host's devices;
            otherwise the name of the slice to use.
          environment: force one environment (``gke``, ``gce``, ``ray``, ``local``)
            instead of :func:`auto`'s choice.
          resolver: use this resolver (overrides ``environment``).

        Raises:
          ValueError: the environment is malformed, or ``tpu`` names no slice there.
        """
        from jaxpod.service.capacity.resolvers import auto, resolver_for

        if resolver is None:
            if tpu == "local":
                environment = "local"
            resolver = resolver_for(environment) if environment else auto()
        self.cluster: ClusterInfo = resolver.resolve()
        self.environment = self.cluster.environment
        self._slice = self._pick(tpu if tpu not in (None, "", "local") else None)

    def _pick(self, name: str | None) -> SliceInfo | None:
        if name is not None:
            return self.cluster.slice(name)
        if self.cluster.current_slice is not None:
            return self.cluster.slice(self.cluster.current_slice)
        if len(self.cluster.slices) == 1:
            return self.cluster.slices[0]
        return None

    @property
    def slice(self) -> SliceInfo:
        """The chosen slice.

        Raises:
          ValueError: the environment has no slice, or several and none was named.
        """
        if self._slice is None:
            names = ", ".join(repr(s.name) for s in self.cluster.slices)
            raise ValueError(
                f"{self.cluster.source} has {len(self.cluster.slices)} TPU slices "
                f"({names or 'none'}) and this process runs on none of them. Pick one "
                "with TPUClusterResolver(tpu='<slice name>')."
            )
        return self._slice

    @property
    def slice_name(self) -> str:
        """Name of the slice (``TPU_NAME``)."""
        return self.slice.name

    @property
    def accelerator_type(self) -> str:
        """Accelerator type, e.g. ``v4-16``."""
        return self.slice.accelerator_type

    @property
    def topology(self) -> str:
        """Physical topology, e.g. ``2x2x2``."""
        return self.slice.topology

    @property
    def num_hosts(self) -> int:
        """Hosts in the slice."""
        return self.slice.num_hosts

    @property
    def worker_id(self) -> int | None:
        """This host's worker id in the slice, or ``None`` when not on one of its hosts."""
        if self.cluster.current_slice == self.slice.name:
            return self.cluster.worker_id
        return None

    @property
    def task_id(self) -> int | None:
        """TF's name for :attr:`worker_id`."""
        return self.worker_id

    @property
    def host_addresses(self) -> tuple[str, ...]:
        """Host addresses in worker-id order."""
        return self.slice.host_addresses

    @property
    def megascale(self) -> MegascaleInfo | None:
        """Multi-slice settings of this process, when set."""
        return self.cluster.megascale

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of the ``jax.distributed`` coordinator.

        Slice 0's worker 0 (``MEGASCALE_COORDINATOR_ADDRESS``) in a multi-slice job,
        else this slice's worker 0, on JAX's Cloud TPU coordinator port.
        """
        mega = self.megascale
        if mega is not None and mega.num_slices > 1 and mega.coordinator_host:
            return f"{mega.coordinator_host}:{self.slice.coordinator_port}"
        return self.slice.coordinator_address

    def master(self) -> str:
        """TF's name for the coordinator address."""
        return self.coordinator_address

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """Accelerators per host, as TF's resolver reports them: ``{"TPU": n}``.

        ``n`` is the number of JAX devices one host's process sees (one per chip on
        every generation in the topology table); a local CPU host reports ``{"CPU": n}``.
        ``task_type`` and ``task_id`` are accepted for TF compatibility; every host
        of a slice has the same count.
        """
        del task_type, task_id
        try:
            parse_accelerator_type(self.accelerator_type)
            kind = "TPU"
        except ValueError:  # a local non-TPU host: "cpu-8" -> "CPU"
            kind = self.accelerator_type.split("-")[0].upper()
        return {kind: self.slice.devices_per_host}

    def cluster_spec(self) -> dict[str, list[str]]:
        """The slice's hosts as TF's cluster spec dict: ``{"worker": [host, ...]}``."""
        return {"worker": list(self.host_addresses)}

    def __repr__(self) -> str:
        chosen = self._slice.name if self._slice else None
        return (
            f"TPUClusterResolver(environment={self.environment!r}, slice={chosen!r}, "
            f"slices={len(self.cluster.slices)})"
        )
