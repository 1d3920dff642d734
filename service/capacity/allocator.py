"""Whole-slice allocation on Ray: all hosts of a slice, or nothing.

A TPU slice is only usable whole: a job that gets 3 of a slice's 4 hosts hangs in
``jax.distributed.initialize``. :class:`SliceAllocator` therefore:

1. finds idle, healthy slices of the requested type (every host alive and free, head
   resource free) from the nodes' labels and free resources;
2. claims each chosen slice by reserving its head resource (``TPU-<type>-head``, only
   on worker 0) with a placement group pinned to that slice's worker 0, and learns
   the slice name from the node the reservation landed on;
3. reserves the slice's hosts with one placement group per slice, one bundle per host
   (``{"TPU": chips_per_host, "CPU": cpus, "<slice name>": 1}``), each bundle pinned
   by label selector to its slice and worker id, so bundle ``i`` is worker ``i``.

The head reservation is kept for the allocation's lifetime: it marks the slice as
taken for every Ray TPU user, so nobody reserves the head of a slice whose hosts are
held and then waits on it. Claims of several slices are made together or dropped
together (no holding while waiting), so two multi-slice requests cannot deadlock.
Every placement group made for a request is removed on time-out, cancel or error, and
:meth:`Allocation.release` removes them at once and returns when the hosts show the
chips free again. Placement groups are not detached: if the coordinator dies, Ray
frees them too. They are named ``jaxpod:<instance>:<allocation>:slice-<index>`` and
``...:head-<slice name>`` (:mod:`jaxpod.service.capacity.orphans`), so a coordinator started
later can tell a dead one's leftovers from a live one's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import uuid
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxpod import settings
from jaxpod.errors import AllocationCancelledError, AllocationTimeoutError
from jaxpod.service.capacity.orphans import object_name
from jaxpod.service.capacity.resolvers.base import (
    ALLOCATION_TIMEOUT,
    DEFAULT_MEGASCALE_PORT,
    SliceInfo,
    megascale_env,
)
from jaxpod.service.capacity.resolvers.ray import (
    POD_TYPE_LABEL,
    SLICE_NAME_LABEL,
    WORKER_ID_LABEL,
    RaySlice,
    connect,
    snapshot,
)
from jaxpod.service.capacity.topology import parse_accelerator_type
from jaxpod.timeouts import Deadline, wait_for

logger = logging.getLogger(__name__)

#: How long a head reservation on a slice that looked idle may stay pending before
#: the claim counts as lost to a concurrent request (and is retried elsewhere).
HEAD_CLAIM_TIMEOUT = settings.HEAD_CLAIM_TIMEOUT
#: How long ``release()`` waits for the hosts to show the released TPUs free again.
RELEASE_TIMEOUT = settings.RELEASE_TIMEOUT
#: Longest pause between looks at the cluster while waiting for idle slices.
POLL_S = 0.25



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


class SliceAllocator:
    """Allocates whole TPU slices on the connected Ray cluster."""

    def __init__(
        self, address: str | None = None, *, megascale_port: int = DEFAULT_MEGASCALE_PORT
    ) -> None:
        """Args:
        address: Ray cluster to connect to if this process is not connected yet
          (``$RAY_ADDRESS`` when ``None``).
        megascale_port: ``MEGASCALE_PORT`` given to multi-slice allocations.
        """
        self.address = address
        self.megascale_port = megascale_port
        self._lock = threading.Lock()
        self._live: dict[str, Allocation] = {}

    def live(self) -> tuple[Allocation, ...]:
        """Allocations made here and not released yet."""
        with self._lock:
            return tuple(self._live.values())

    def allocate(
        self,
        accelerator_type: str,
        num_slices: int = 1,
        *,
        cpus_per_host: float = 1.0,
        extra_resources: Mapping[str, float] | None = None,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
        on_event: EventCallback | None = None,
    ) -> Allocation:
        """Reserves ``num_slices`` whole slices of ``accelerator_type``, or nothing.

        Args:
          accelerator_type: e.g. ``v4-16``.
          num_slices: slices; more than one is a multi-slice allocation whose hosts
            get per-slice ``MEGASCALE_*`` values.
          cpus_per_host: ``CPU`` in each host's bundle.
          extra_resources: more resources in each host's bundle.
          timeout_s: overall limit (``JAXPOD_ALLOCATION_TIMEOUT_S``, default 60 s).
          cancel: set it (from another thread) to give up.
          on_event: called with progress events, on this thread.

        Returns:
          The allocation; release it when done.

        Raises:
          ValueError: unknown accelerator type or bad counts.
          AllocationTimeoutError: not allocated in time; says what was asked for and
            what the cluster has. Nothing stays reserved.
          AllocationCancelledError: ``cancel`` was set. Nothing stays reserved.
        """
        request = SliceRequest.build(accelerator_type, num_slices, cpus_per_host,
                                     extra_resources)
        connect(self.address)
        attempt = _Attempt(
            request, Deadline(ALLOCATION_TIMEOUT.resolve(timeout_s)), cancel, on_event,
            allocation_id=uuid.uuid4().hex[:12],
        )
        try:
            slices = attempt.run(self.megascale_port)
        except BaseException:
            attempt.abandon()
            raise
        allocation = Allocation(attempt.allocation_id, request, slices, self._forget)
        with self._lock:
            self._live[allocation.id] = allocation
        names = [s.info.name for s in slices]
        attempt.emit("allocated", f"allocation {allocation.id}: {names}", names)
        return allocation

    async def allocate_async(self, accelerator_type: str, num_slices: int = 1,
                             **kwargs: Any) -> Allocation:
        """:meth:`allocate` in a thread; cancelling the awaiting task cancels it cleanly.

        On cancellation the worker thread is told to stop and awaited (so nothing
        stays reserved) before ``asyncio.CancelledError`` propagates.
        """
        cancel = threading.Event()
        task = asyncio.ensure_future(asyncio.to_thread(
            self.allocate, accelerator_type, num_slices, cancel=cancel, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            cancel.set()
            try:
                allocation = await task
            except Exception:  # cancelled, or failed on its own meanwhile: nothing held
                raise asyncio.CancelledError() from None
            await asyncio.to_thread(allocation.release)  # it won the race with the cancel
            raise

    def release_all(self) -> None:
        """Releases every live allocation (coordinator shutdown)."""
        for allocation in self.live():
            allocation.release()

    def _forget(self, allocation: Allocation) -> None:
        with self._lock:
            self._live.pop(allocation.id, None)


class _Attempt:
    """One run of :meth:`SliceAllocator.allocate`; owns every group it creates."""

    def __init__(
        self,
        request: SliceRequest,
        deadline: Deadline,
        cancel: threading.Event | None,
        on_event: EventCallback | None,
        *,
        allocation_id: str,
    ) -> None:
        self.request = request
        self.deadline = deadline
        self.cancel = cancel or threading.Event()
        self.on_event = on_event
        self.allocation_id = allocation_id
        self.groups: list[PlacementGroup] = []
        self._last_wait = ""

    def emit(self, kind: str, detail: str, slices: Sequence[str] = ()) -> None:
        logger.debug("allocation %s: %s: %s", self.allocation_id, kind, detail)
        if self.on_event is not None:
            self.on_event(AllocationEvent(kind, detail, tuple(slices)))

    def abandon(self) -> None:
        """Removes every group this attempt created (on error, time-out or cancel)."""
        remove_groups(self.groups)
        self.groups.clear()

    def run(self, megascale_port: int) -> list[SliceAllocation]:
        slices, heads = self._claim_heads()
        groups = [self._host_group(i, s) for i, s in enumerate(slices)]
        self._wait_ready(groups, slices)
        return _build_slices(slices, heads, groups, megascale_port)

    # -- step 1 and 2: find idle slices and claim their heads --------------------

    def _claim_heads(self) -> tuple[list[RaySlice], list[PlacementGroup]]:
        pause = 0.02
        while True:
            self._check_cancel()
            slices, _ = snapshot()
            if self.deadline.expired():
                self.emit("timed_out", "no slices claimed in time")
                raise AllocationTimeoutError(self._timeout_message(slices))
            idle = [s for s in slices if s.info.accelerator_type == self.request.accelerator_type
                    and s.idle]
            if len(idle) >= self.request.num_slices:
                # Claim in name order: two requests wanting the same slices collide on
                # the first one, and the loser drops everything before it waits.
                chosen = sorted(random.sample(idle, self.request.num_slices),
                                key=lambda s: s.info.name)
                heads = self._try_claim(chosen)
                if heads is not None:
                    return chosen, heads
                pause = 0.02
                continue
            self._note_waiting(slices, len(idle))
            self.cancel.wait(min(pause, self.deadline.remaining()))
            pause = min(pause * 2, POLL_S)

    def _try_claim(self, chosen: list[RaySlice]) -> list[PlacementGroup] | None:
        """Claims the heads of ``chosen`` one by one; on the first loss drops them all."""
        heads: list[PlacementGroup] = []
        for s in chosen:
            heads.append(self._head_group(s))
            if not self._claimed(heads[-1], s):
                remove_groups(heads)
                for group in heads:
                    self.groups.remove(group)
                self.emit("claim_lost", f"another request claimed {s.info.name} first")
                self.cancel.wait(random.uniform(0.0, 0.05))  # de-synchronise retries
                return None
        names = [s.info.name for s in chosen]
        self.emit("heads_claimed", f"claimed the head of {names}", names)
        return heads

    def _claimed(self, head: PlacementGroup, s: RaySlice) -> bool:
        """Waits for one head reservation; ``False`` as soon as another one holds that head."""
        deadline = Deadline(min(HEAD_CLAIM_TIMEOUT.seconds(), self.deadline.remaining()))
        ref = head.ready()
        while True:
            self._check_cancel()
            ready, _ = ray.wait([ref], timeout=min(0.02, deadline.remaining()))
            if ready:
                return self._landed_on(head, s)
            if deadline.expired() or _head_held_by_other(s, head):
                return False

    def _landed_on(self, head: PlacementGroup, s: RaySlice) -> bool:
        """Learns the slice the head reservation landed on; it must be the chosen one."""
        node = placement_group_table(head)["bundles_to_node_id"].get(0)
        if node != s.hosts[0].info.node_id:
            logger.warning("head of %s landed on node %s, not on its worker 0",
                           s.info.name, node)
            return False
        return True

    def _head_group(self, s: RaySlice) -> PlacementGroup:
        assert s.shape is not None
        return self._create(
            bundles=[{s.shape.head_resource: 1}],
            selectors=[{
                SLICE_NAME_LABEL: s.info.name,
                WORKER_ID_LABEL: "0",
                POD_TYPE_LABEL: s.info.accelerator_type,
            }],
            name=object_name(self.allocation_id, f"head-{s.info.name}"),
            strategy="PACK",
        )

    # -- step 3: reserve every host of each claimed slice ---------------------------

    def _host_group(self, index: int, s: RaySlice) -> PlacementGroup:
        bundle = {
            "TPU": float(s.info.chips_per_host),
            "CPU": self.request.cpus_per_host,
            s.info.name: 1.0,
            **self.request.extra_resources,
        }
        bundle = {k: v for k, v in bundle.items() if v > 0}
        return self._create(
            bundles=[dict(bundle) for _ in s.hosts],
            selectors=[{SLICE_NAME_LABEL: s.info.name, WORKER_ID_LABEL: str(h.info.worker_id)}
                       for h in s.hosts],
            name=object_name(self.allocation_id, f"slice-{index}"),
            strategy="STRICT_SPREAD",
        )

    def _create(self, *, bundles: list[dict[str, float]], selectors: list[dict[str, str]],
                name: str, strategy: str) -> PlacementGroup:
        group = placement_group(bundles=bundles, strategy=strategy, name=name,
                                bundle_label_selector=selectors)
        self.groups.append(group)
        return group

    def _wait_ready(self, groups: list[PlacementGroup], slices: list[RaySlice]) -> None:
        """Waits for the host groups to be placed, checking for cancel as it goes.

        Raises:
          AllocationTimeoutError: the overall deadline passed first.
        """
        refs = [g.ready() for g in groups]
        while True:
            self._check_cancel()
            ready, _ = ray.wait(refs, num_returns=len(refs),
                                timeout=min(POLL_S, self.deadline.remaining()))
            if len(ready) == len(refs):
                return
            if self.deadline.expired():
                self.emit("timed_out", "hosts did not become free")
                raise AllocationTimeoutError(self._hosts_timeout_message(slices))

    # -- cancel and messages -------------------------------------------------------

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            self.emit("cancelled", "cancelled by the caller")
            raise AllocationCancelledError(
                f"Allocation of {self.request.describe()} was cancelled; nothing is "
                "reserved."
            )

    def _note_waiting(self, slices: Sequence[RaySlice], idle: int) -> None:
        detail = (f"{idle}/{self.request.num_slices} idle {self.request.accelerator_type} "
                  f"slice(s); cluster: {describe_cluster(slices)}")
        if detail != self._last_wait:
            self._last_wait = detail
            self.emit("waiting", detail)

    def _timeout_message(self, slices: Sequence[RaySlice]) -> str:
        same = [s for s in slices if s.info.accelerator_type == self.request.accelerator_type]
        shape = same[0].info if same else None
        asked = self.request.describe(
            shape.chips_per_host if shape else None, shape.num_hosts if shape else None)
        return (
            f"Could not allocate {asked} within {self.deadline.total_s:g} s "
            f"({ALLOCATION_TIMEOUT.env_var}): "
            f"{sum(s.idle for s in same)} of the {len(same)} {self.request.accelerator_type} "
            f"slice(s) in the cluster are idle. The cluster has: {describe_cluster(slices)}. "
            "Fix: release other allocations, ask for fewer slices or a type the cluster "
            f"has, add slices to the cluster, or raise {ALLOCATION_TIMEOUT.env_var}."
        )

    def _hosts_timeout_message(self, slices: Sequence[RaySlice]) -> str:
        current, _ = snapshot()
        by_name = {s.info.name: s for s in current}
        lines = []
        for s in slices:
            now = by_name.get(s.info.name, s)
            busy = [f"worker {h.info.worker_id} has {h.tpu_free:g}/{h.info.chips} TPU free"
                    for h in now.hosts]
            lines.append(f"{s.info.name}: {', '.join(busy)}")
        asked = self.request.describe(slices[0].info.chips_per_host, slices[0].info.num_hosts)
        return (
            f"Could not allocate {asked} within {self.deadline.total_s:g} s "
            f"({ALLOCATION_TIMEOUT.env_var}): the head of each slice was reserved but not "
            f"all hosts became free ({'; '.join(lines)}). Something outside jaxpod holds "
            "TPUs on those hosts; free them, or raise the time-out. Nothing stays reserved."
        )


def _head_held_by_other(s: RaySlice, ours: PlacementGroup) -> bool:
    """Whether another placement group already holds the head resource of ``s``."""
    from ray._private.state import state as gcs_state

    assert s.shape is not None
    node = gcs_state.total_resources_per_node().get(s.hosts[0].info.node_id or "", {})
    prefix = f"{s.shape.head_resource}_group_"
    return any(k.startswith(prefix) and not k.endswith(ours.id.hex()) for k in node)


def describe_cluster(slices: Sequence[RaySlice]) -> str:
    """``v4-16: sim-0-v4-16 (busy), sim-2-v4-16 (idle); v4-8: sim-1-v4-8 (idle)``."""
    if not slices:
        return "no TPU slices"
    by_type: dict[str, list[str]] = {}
    for s in slices:
        state = s.state if s.healthy else f"unhealthy: {'; '.join(s.problems)}"
        by_type.setdefault(s.info.accelerator_type, []).append(f"{s.info.name} ({state})")
    return "; ".join(f"{t}: {', '.join(names)}" for t, names in sorted(by_type.items()))


def _build_slices(
    slices: Sequence[RaySlice],
    heads: Sequence[PlacementGroup],
    groups: Sequence[PlacementGroup],
    megascale_port: int,
) -> list[SliceAllocation]:
    """Pairs every bundle with its host and works out each host's environment."""
    total = sum(s.info.num_hosts for s in slices)
    coordinator = slices[0].hosts[0].info.address
    built = []
    for index, (s, head, group) in enumerate(zip(slices, heads, groups, strict=True)):
        placed = placement_group_table(group)["bundles_to_node_id"]
        hosts = []
        for h in s.hosts:
            if placed.get(h.info.worker_id) != h.info.node_id:
                raise RuntimeError(
                    f"Bundle {h.info.worker_id} of slice {s.info.name} was placed on node "
                    f"{placed.get(h.info.worker_id)}, not on worker {h.info.worker_id} "
                    f"({h.info.node_id}); the node labels of this cluster are inconsistent."
                )
            env, unset = _host_env(s.info, len(slices), index, coordinator, megascale_port)
            env["TPU_WORKER_ID"] = str(h.info.worker_id)
            hosts.append(HostAssignment(
                slice_index=index, slice_name=s.info.name, worker_id=h.info.worker_id,
                bundle_index=h.info.worker_id,
                process_id=index * s.info.num_hosts + h.info.worker_id,
                num_processes=total, node_id=h.info.node_id or "", node_ip=h.info.address,
                chips=h.info.chips, env=env, unset_env=unset,
            ))
        built.append(SliceAllocation(index, s.info, group, head, tuple(hosts)))
    return built


def _host_env(
    info: SliceInfo, num_slices: int, slice_index: int, coordinator: str, port: int
) -> tuple[dict[str, str], tuple[str, ...]]:
    """``TPU_*`` for the host's slice, plus ``MEGASCALE_*`` (or their removal)."""
    env = {
        "TPU_NAME": info.name,
        "TPU_ACCELERATOR_TYPE": info.accelerator_type,
        "TPU_TOPOLOGY": info.topology,
        "TPU_WORKER_HOSTNAMES": ",".join(info.host_addresses),
    }
    megascale, unset = megascale_env(num_slices, slice_index, coordinator, port)
    return {**env, **megascale}, unset
