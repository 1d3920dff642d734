"""Cluster resolvers, one per environment, and :func:`auto` to pick one.

``auto()`` tries, in this order, and takes the first whose ``is_present()`` is true:

1. ``gke``   -- ``TPU_WORKER_HOSTNAMES`` / ``TPU_ACCELERATOR_TYPE`` / ``TPU_WORKER_ID``
   is set: a GKE TPU pod (or a host of the simulated local cluster). Most specific,
   and needs no network.
2. ``gce``   -- ``GCE_METADATA_IP`` is set, or this is a GCE VM with TPU devices: a
   Cloud TPU VM; the metadata server is read on ``resolve()``.
3. ``ray``   -- this process is connected to Ray or ``RAY_ADDRESS`` is set: the view
   of every slice in the Ray cluster (the coordinator's case).
4. ``local`` -- always: this host's JAX devices.

A TPU host that also runs Ray resolves through 1 or 2 (its own slice); the
coordinator, on a CPU node, through 3.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from jaxpod.service.capacity.resolvers.base import (
    ClusterInfo,
    ClusterResolver,
    HostInfo,
    MegascaleInfo,
    SliceInfo,
)
from jaxpod.service.capacity.resolvers.gce import GceResolver
from jaxpod.service.capacity.resolvers.gke import GkeResolver
from jaxpod.service.capacity.resolvers.local import LocalResolver
from jaxpod.service.capacity.resolvers.tpu_cluster_resolver import TPUClusterResolver

#: The order :func:`auto` tries environments in.
AUTO_ORDER = ("gke", "gce", "ray", "local")

__all__ = [
    "AUTO_ORDER",
    "ClusterInfo",
    "ClusterResolver",
    "GceResolver",
    "GkeResolver",
    "HostInfo",
    "LocalResolver",
    "MegascaleInfo",
    "SliceInfo",
    "TPUClusterResolver",
    "auto",
    "resolver_for",
]


def resolver_for(environment: str) -> ClusterResolver:
    """The default resolver of one environment.

    Args:
      environment: one of :data:`AUTO_ORDER`.

    Raises:
      ValueError: an unknown environment name.
    """
    if environment == "gke":
        return GkeResolver()
    if environment == "gce":
        return GceResolver()
    if environment == "ray":
        from jaxpod.service.capacity.resolvers.ray import RayResolver

        return RayResolver()
    if environment == "local":
        return LocalResolver()
    raise ValueError(
        f"Unknown cluster environment {environment!r}. Expected one of {list(AUTO_ORDER)}."
    )


def auto(resolvers: Sequence[ClusterResolver] | None = None) -> ClusterResolver:
    """The first present resolver, in :data:`AUTO_ORDER` (see the module docstring).

    Args:
      resolvers: candidates to try in order; the default resolver of each environment
        in :data:`AUTO_ORDER` when ``None`` (injectable for tests).

    Returns:
      The chosen resolver; call ``resolve()`` on it.
    """
    candidates = resolvers if resolvers is not None else _defaults()
    tried = []
    for resolver in candidates:
        if resolver.is_present():
            return resolver
        tried.append(resolver.environment)
    raise ValueError(f"None of the cluster environments {tried} is present.")


def _defaults() -> Iterator[ClusterResolver]:
    """Each environment's default resolver, built only when reached (Ray is imported
    only when GKE and GCE are absent, and skipped when it is not installed)."""
    for environment in AUTO_ORDER:
        try:
            yield resolver_for(environment)
        except ImportError:
            continue
