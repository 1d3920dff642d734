"""An allocation of whole slices: what is asked for, what is held, and giving it back.

:class:`SliceRequest` is what :class:`~jaxpod.service.capacity.allocator.SliceAllocator`
is asked for and :class:`AllocationEvent` each step it reports;
:class:`Allocation` is what it hands out: the slices (:class:`SliceAllocation`, one
placement group each, plus its head reservation) and their hosts
(:class:`HostAssignment`, with the environment each host's JAX process needs).
:meth:`Allocation.release` removes its placement groups (:func:`remove_groups`) and
waits until the hosts show their chips free again (:func:`capacity_back`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxpod import settings
from jaxpod.service.capacity.resolvers.base import SliceInfo
from jaxpod.service.capacity.topology import parse_accelerator_type
from jaxpod.timeouts import wait_for

logger = logging.getLogger(__name__)

#: How long ``release()`` waits for the hosts to show the released TPUs free again.
RELEASE_TIMEOUT = settings.RELEASE_TIMEOUT


@dataclass(frozen=True)
class AllocationEvent:
    """A step of an allocation, for progress reporting (and for tests to sync on).

    Attributes:
      kind: ``waiting`` (too few idle slices), ``claim_lost`` (another request took a
        slice first), ``heads_claimed``, ``allocated``, ``released``, ``timed_out``,
        ``cancelled``.
      detail: a human-readable line.
      slices: the slices concerned (for ``heads_claimed`` and ``allocated``).
    """

    kind: str
    detail: str
    slices: tuple[str, ...] = ()


EventCallback = Callable[[AllocationEvent], None]


@dataclass(frozen=True)
class SliceRequest:
    """What to allocate.

    Attributes:
      accelerator_type: canonical accelerator type, e.g. ``v4-16``.
      num_slices: slices, all of that type (multi-slice when more than one).
      cpus_per_host: ``CPU`` in each host's bundle (for the host worker actor).
      extra_resources: more resources for each host's bundle.
    """

    accelerator_type: str
    num_slices: int = 1
    cpus_per_host: float = 1.0
    extra_resources: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        accelerator_type: str,
        num_slices: int = 1,
        cpus_per_host: float = 1.0,
        extra_resources: Mapping[str, float] | None = None,
    ) -> SliceRequest:
        """Validates and canonicalises a request (``v5e-16`` becomes ``v5litepod-16``).

        Raises:
          ValueError: unknown accelerator type, or a non-positive count.
        """
        generation, number = parse_accelerator_type(accelerator_type)
        if not isinstance(num_slices, int) or num_slices < 1:
            raise ValueError(f"num_slices must be a positive int. Got {num_slices!r}.")
        if cpus_per_host < 0:
            raise ValueError(f"cpus_per_host must be >= 0. Got {cpus_per_host!r}.")
        return cls(f"{generation.name}-{number}", num_slices, float(cpus_per_host),
                   dict(extra_resources or {}))

    def describe(self, chips_per_host: int | None = None, hosts: int | None = None) -> str:
        """``2 x v4-16 slice(s) (2 hosts x {TPU: 4, CPU: 1} each)`` for messages."""
        per_host = f"TPU: {chips_per_host}, " if chips_per_host else ""
        host_part = f"{hosts} hosts x " if hosts else ""
        return (
            f"{self.num_slices} x {self.accelerator_type} slice(s) ({host_part}"
            f"{{{per_host}CPU: {self.cpus_per_host:g}}} each)"
        )


@dataclass(frozen=True)
class HostAssignment:
    """One allocated host: where it is and the environment its JAX process needs.

    Attributes:
      slice_index: the slice's index in the allocation (its ``MEGASCALE_SLICE_ID``).
      slice_name: the slice's name.
      worker_id: the host's index in its slice (``TPU_WORKER_ID``).
      bundle_index: its bundle in the slice's placement group; equals ``worker_id``.
      process_id: its JAX process id across all slices
        (``slice_index * hosts_per_slice + worker_id``).
      num_processes: JAX processes across all slices.
      node_id: the Ray node id (hex).
      node_ip: the node's IP address.
      chips: TPU chips on the host.
      env: variables to set in the host's JAX process: ``TPU_*`` of its slice and, for
        multi-slice allocations, ``MEGASCALE_*``.
      unset_env: variables to remove from the process (stale ``MEGASCALE_*`` for a
        single-slice allocation), which a Ray ``runtime_env`` cannot express.
    """

    slice_index: int
    slice_name: str
    worker_id: int
    bundle_index: int
    process_id: int
    num_processes: int
    node_id: str
    node_ip: str
    chips: int
    env: Mapping[str, str]
    unset_env: tuple[str, ...] = ()

    def apply_env(self, environ: MutableMapping[str, str]) -> None:
        """Sets :attr:`env` and removes :attr:`unset_env` in ``environ`` (e.g. ``os.environ``)."""
        for name in self.unset_env:
            environ.pop(name, None)
        environ.update(self.env)


@dataclass(frozen=True)
class SliceAllocation:
    """One allocated slice.

    Attributes:
      index: its index in the allocation.
      info: the slice as resolved when it was allocated.
      placement_group: one bundle per host; bundle ``i`` is worker ``i``.
      head_placement_group: the reservation of the slice's head resource.
      hosts: the hosts, in worker-id order.
    """

    index: int
    info: SliceInfo
    placement_group: PlacementGroup
    head_placement_group: PlacementGroup
    hosts: tuple[HostAssignment, ...]

    def scheduling_strategy(self, worker_id: int) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy that places a task or actor on host ``worker_id``."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.hosts[worker_id].bundle_index,
            placement_group_capture_child_tasks=True,
        )


class Allocation:
    """Whole slices held for one job or session; release with :meth:`release` or ``with``.

    Attributes:
      id: unique id, part of the placement group names.
      request: what was asked for.
      slices: the slices, in ``MEGASCALE_SLICE_ID`` order.
    """

    def __init__(
        self,
        allocation_id: str,
        request: SliceRequest,
        slices: Sequence[SliceAllocation],
        on_release: Callable[[Allocation], None] | None = None,
    ) -> None:
        self.id = allocation_id
        self.request = request
        self.slices = tuple(slices)
        self._on_release = on_release
        self._lock = threading.Lock()
        self._released = False

    @property
    def hosts(self) -> tuple[HostAssignment, ...]:
        """Every host, in JAX process-id order."""
        return tuple(h for s in self.slices for h in s.hosts)

    @property
    def coordinator_host(self) -> str:
        """IP of process 0 (slice 0, worker 0): where ``jax.distributed`` and MegaScale
        coordinators run. The port is the worker's to pick on that host."""
        return self.slices[0].hosts[0].node_ip

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return self._released

    def names(self) -> list[str]:
        """The slices' names, in ``MEGASCALE_SLICE_ID`` order."""
        return [s.info.name for s in self.slices]

    def describe(self) -> dict[str, Any]:
        """What a held slice reports of this allocation."""
        return {"accelerator_type": self.slices[0].info.accelerator_type,
                "num_slices": len(self.slices), "num_hosts": len(self.hosts),
                "slice_names": self.names()}

    def placement_groups(self) -> tuple[PlacementGroup, ...]:
        """Every placement group this allocation holds (hosts first, then heads)."""
        return tuple(s.placement_group for s in self.slices) + tuple(
            s.head_placement_group for s in self.slices
        )

    def release(self, timeout_s: float | None = None) -> None:
        """Gives every host and head reservation back. Idempotent and thread-safe.

        The reservations are removed at once; the call returns when the hosts show
        their TPUs and head resource free again (about 0.1 s), so the next request
        sees the capacity.

        Args:
          timeout_s: how long to wait for that (``JAXPOD_RELEASE_TIMEOUT_S``); on
            time-out a warning is logged (the reservations are gone regardless).
        """
        with self._lock:
            if self._released:
                return
            self._released = True
        groups = self.placement_groups()
        remove_groups(groups)
        if self._on_release is not None:
            self._on_release(self)
        limit = RELEASE_TIMEOUT.resolve(timeout_s)
        ours = {g.id.hex() for g in groups}
        if not wait_for(lambda: capacity_back(self._held(), ours), limit, max_poll_s=0.05):
            logger.warning("Allocation %s released, but its hosts did not show the TPUs "
                           "free within %.1f s (%s).", self.id, limit, RELEASE_TIMEOUT.env_var)

    def _held(self) -> dict[str, dict[str, float]]:
        """The scarce resources this allocation held, per node: chips and head."""
        held: dict[str, dict[str, float]] = {}
        for s in self.slices:
            for h in s.hosts:
                held[h.node_id] = {"TPU": float(h.chips)}
            head = f"TPU-{s.info.accelerator_type}-head"
            held[s.hosts[0].node_id][head] = 1.0
        return held

    def __enter__(self) -> Allocation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        names = [s.info.name for s in self.slices]
        state = "released" if self._released else "held"
        return f"Allocation({self.id!r}, {self.request.accelerator_type}, slices={names}, {state})"


def remove_groups(groups: Sequence[PlacementGroup]) -> None:
    """Removes placement groups, pending or created (the GCS drops them at once)."""
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # already removed, or the GCS is going away
            logger.debug("removing placement group %s failed", group.id.hex(), exc_info=True)


def capacity_back(held: Mapping[str, Mapping[str, float]], ours: set[str]) -> bool:
    """Whether every node shows the resources ``held`` there as free again.

    Raylets hand removed bundles back asynchronously (about 0.1 s later). A resource
    also counts as back when another placement group already holds it on that node
    (a waiting request took it first), or when the node is gone.

    Args:
      held: per node id, the resources our removed groups held there.
      ours: hex ids of our removed groups.
    """
    from ray._private.state import available_resources_per_node
    from ray._private.state import state as gcs_state

    available = available_resources_per_node()
    total = gcs_state.total_resources_per_node()
    for node, resources in held.items():
        if node not in total:
            continue
        for name, amount in resources.items():
            if available.get(node, {}).get(name, 0.0) >= amount:
                continue
            prefix = f"{name}_group_"
            if not any(k.startswith(prefix) and k.rsplit("_", 1)[-1] not in ours
                       for k in total[node]):
                return False
    return True
