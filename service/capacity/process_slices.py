"""Simulated slices without Ray: host workers as plain processes of this machine.

``jaxpod serve --local --provider processes`` (see ``docs/design/cold-start.md``):

* :class:`~jaxpod.service.capacity.process_hosts.ProcessWorkers` starts each host as
  ``python -m jaxpod.worker.host_process``, with its host's environment, answering the
  calls :class:`~jaxpod.service.slices.replica_group.ReplicaGroup` makes of a worker over two
  pipes. Operations, resets and faults then go over the operation channels, as for
  Ray actors. A worker's read pipe is its tie to this process: when this process
  ends, however it ends, the workers exit.
* :class:`LocalProcessSlices` is the slice provider: the simulated slices of a
  ``--slices`` spec, held whole or not at all, with the same warm pool as
  :class:`~jaxpod.service.capacity.pools.RaySlices`.

No Ray process starts, which is most of a Ray cluster's start-up CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jaxpod.errors import AllocationCancelledError, AllocationTimeoutError
from jaxpod.service.capacity.local_cluster import SimulatedSlice, plan_slices
from jaxpod.service.capacity.pools import Held, PooledSlices, WarmKey
from jaxpod.service.capacity.process_hosts import HostsStartedAhead, LocalHeld, ProcessWorkers
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.capacity.resolvers.base import ALLOCATION_TIMEOUT, HostInfo, SliceInfo
from jaxpod.service.capacity.topology import slice_shape
from jaxpod.service.slices.replica_group import ReplicaGroup
from jaxpod.timeouts import Cancel
from jaxpod.worker.host_process import LOOPBACK
from jaxpod.worker.host_worker import SIMULATED_PLATFORM

logger = logging.getLogger(__name__)


class LocalProcessSlices(PooledSlices):
    """The slice provider of a simulated cluster without Ray.

    Args:
      spec: the simulated slices, as ``jaxpod serve --slices`` (``"v4-16,v4-8"``).
      start_timeout_s: overrides ``JAXPOD_WORKER_START_TIMEOUT_S``.
      ahead: workers already started for one of its slices
        (:func:`~jaxpod.service.capacity.process_hosts.start_ahead`): the first group started
        on that slice takes them.
    """

    def __init__(self, spec: str | Sequence[str], start_timeout_s: float | None = None,
                 ahead: HostsStartedAhead | None = None) -> None:
        super().__init__()
        self.slices = plan_slices(spec)
        self.start_timeout_s = start_timeout_s
        self._ahead = ahead
        self._free = {s.name for s in self.slices}
        self._changed = threading.Condition()

    def _allocate(self, request: SliceRequest, key: WarmKey,
                  cancel: Cancel | None) -> Held:
        wanted, count = slice_shape(request.accelerator_type).accelerator_type, key[1]
        of_type = [s for s in self.slices if s.shape.accelerator_type == wanted]
        limit = ALLOCATION_TIMEOUT.resolve(request.timeout_s or None)
        deadline = time.monotonic() + limit
        told = False
        with self._changed, (cancel.waking(self._wake) if cancel is not None
                             else contextlib.nullcontext()):
            while True:
                free = [s for s in of_type if s.name in self._free]
                if len(free) >= count:
                    taken = tuple(free[:count])
                    self._free.difference_update(s.name for s in taken)
                    return LocalHeld(taken, self._give_back)
                left = deadline - time.monotonic()
                if left <= 0 or len(of_type) < count:
                    raise AllocationTimeoutError(self._unavailable(wanted, of_type, count,
                                                                   limit))
                if cancel is not None and cancel.is_set():
                    raise AllocationCancelledError(
                        f"The acquire of {count} x {wanted} was cancelled while it "
                        "waited for a free slice; nothing is held.")
                if not told:
                    logger.info("an acquire of %d x %s waits for a free slice (%d of %d "
                                "idle)", count, wanted, len(free), len(of_type))
                    told = True
                self._changed.wait(left)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _unavailable(self, wanted: str, of_type: list[SimulatedSlice], count: int,
                     limit: float) -> str:
        """Why ``count`` slices of ``of_type`` could not be held (holding the lock)."""
        idle = sum(s.name in self._free for s in of_type)
        has = ", ".join(f"{s.name} ({'idle' if s.name in self._free else 'busy'})"
                        for s in self.slices)
        when = (f"within {limit:g} s ({ALLOCATION_TIMEOUT.env_var})"
                if len(of_type) >= count else "at all")  # too few: no wait would do
        return (f"Could not allocate {count} x {wanted} {when}: {idle} of the "
                f"{len(of_type)} {wanted} "
                f"slice(s) of this simulated cluster are idle. It has: {has}. Fix: release "
                "other slices, ask for a type it has, or start the service with more "
                "(jaxpod serve --local --slices).")

    def _give_back(self, held: LocalHeld) -> None:
        with self._changed:
            self._free.update(held.names())
            self._changed.notify_all()

    def _start_group(self, held: Held) -> ReplicaGroup:
        assert isinstance(held, LocalHeld)
        shape = held.slices[0].shape
        with self._changed:
            ahead = self._ahead
            if ahead is not None and ahead.slice_names == tuple(held.names()):
                self._ahead = None
            else:
                ahead = None
        return ReplicaGroup.start(held.placements(), shape.devices_per_host,
                                  ProcessWorkers(ahead), SIMULATED_PLATFORM,
                                  self.start_timeout_s)

    def close(self) -> None:
        """Stops the warm slices and workers started ahead that nothing took."""
        with self._changed:
            ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.kill()
        super().close()

    def _idle_slices(self, accelerator_type: str) -> int:
        with self._changed:
            return sum(1 for s in self.slices if s.name in self._free
                       and s.shape.accelerator_type == accelerator_type)

    def cluster(self) -> list[ClusterSlice]:
        return [ClusterSlice(name=s.name, accelerator_type=s.shape.accelerator_type,
                                num_hosts=s.shape.num_hosts) for s in self.slices]

    def snapshot(self) -> list[LocalSlice]:
        return [LocalSlice(SliceInfo.from_shape(
            s.name, s.shape, [HostInfo(w, LOOPBACK, s.shape.chips_per_host)
                              for w in range(s.shape.num_hosts)])) for s in self.slices]


@dataclass(frozen=True)
class LocalSlice:
    """A simulated slice as the status page shows it (always whole and healthy)."""

    info: SliceInfo
    problems: tuple[str, ...] = ()
