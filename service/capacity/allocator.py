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
:meth:`~jaxpod.service.capacity.allocation.Allocation.release` removes them at once
and returns when the hosts show the chips free again. Placement groups are not
detached: if the coordinator dies, Ray frees them too. They are named
``jaxpod:<instance>:<allocation>:slice-<index>`` and ``...:head-<slice name>``
(:mod:`jaxpod.service.capacity.orphans`), so a coordinator started later can tell a
dead one's leftovers from a live one's.

``SliceAllocator`` keeps the allocations it made until they are released;
:mod:`~jaxpod.service.capacity.allocation_steps` runs the steps above for one request,
and :mod:`~jaxpod.service.capacity.allocation` holds what it hands out
(:class:`~jaxpod.service.capacity.allocation.Allocation`).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from jaxpod.service.capacity.allocation import Allocation, EventCallback, SliceRequest
from jaxpod.service.capacity.allocation_steps import AllocationAttempt
from jaxpod.service.capacity.resolvers.base import ALLOCATION_TIMEOUT, DEFAULT_MEGASCALE_PORT
from jaxpod.service.capacity.resolvers.ray import connect
from jaxpod.timeouts import Deadline


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
        attempt = AllocationAttempt(
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
