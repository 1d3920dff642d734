"""The steps of one allocation on Ray placement groups, all of them or none.

:class:`AllocationAttempt` is one run of
:meth:`~jaxpod.service.capacity.allocator.SliceAllocator.allocate`: it finds idle
slices of the requested type, claims each one's head resource (claims of several
slices are made together or dropped together), reserves every host of each claimed
slice with one placement group per slice, and waits for them to be placed. It owns
every placement group it creates and removes them all on error, time-out or cancel
(:meth:`AllocationAttempt.abandon`). Its time-out messages say what was asked for and
what the cluster has (:func:`describe_cluster`); once placed, each bundle is paired
with its host and that host's ``TPU_*`` and ``MEGASCALE_*`` environment.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from jaxpod import settings
from jaxpod.errors import AllocationCancelledError, AllocationTimeoutError
from jaxpod.service.capacity.allocation import (
    AllocationEvent,
    EventCallback,
    HostAssignment,
    SliceAllocation,
    SliceRequest,
    remove_groups,
)
from jaxpod.service.capacity.orphans import object_name
from jaxpod.service.capacity.resolvers.base import ALLOCATION_TIMEOUT, SliceInfo, megascale_env
from jaxpod.service.capacity.resolvers.ray import (
    POD_TYPE_LABEL,
    SLICE_NAME_LABEL,
    WORKER_ID_LABEL,
    RaySlice,
    snapshot,
)
from jaxpod.timeouts import Deadline

logger = logging.getLogger(__name__)

#: How long a head reservation on a slice that looked idle may stay pending before
#: the claim counts as lost to a concurrent request (and is retried elsewhere).
HEAD_CLAIM_TIMEOUT = settings.HEAD_CLAIM_TIMEOUT
#: Longest pause between looks at the cluster while waiting for idle slices.
POLL_S = 0.25


class AllocationAttempt:
    """One run of :meth:`~jaxpod.service.capacity.allocator.SliceAllocator.allocate`;
    owns every group it creates."""

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
