"""Host workers for held slices: the bridge from capacity to a replica group.

:class:`PooledSlices` is a slice provider's common part: it starts one host worker per
host of the slices an acquire holds and forms their ``jax.distributed`` group. A
released slice keeps its workers warm (everything on them freed, their functions
kept) for the next acquire of the same shape, which then skips allocation, worker
start-up and ``jax.distributed``; a slice where some host has a preemption notice is
stopped instead. :class:`RaySlices` takes capacity from the Ray allocator (placement
groups, one bundle per host, with the environment each host's JAX process needs) and
starts the workers as Ray actors
(:class:`~jaxpod.service.capacity.ray_workers.RayWorkers`);
:class:`~jaxpod.service.capacity.process_slices.LocalProcessSlices` simulates slices
with plain processes.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from jaxpod import settings
from jaxpod.errors import AllocationCancelledError, SliceResetError
from jaxpod.service.capacity.ray_workers import RayWorkers
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.capacity.resolvers.base import ALLOCATION_TIMEOUT
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.held import HeldSlice
from jaxpod.service.slices.replica_group import HostPlacement, ReplicaGroup
from jaxpod.timeouts import Cancel
from jaxpod.worker.host_worker import SIMULATED_PLATFORM

if TYPE_CHECKING:  # the allocator imports Ray: a provider without it never does
    from jaxpod.service.capacity.allocation import Allocation
    from jaxpod.service.capacity.allocator import SliceAllocator

logger = logging.getLogger(__name__)

#: How long a released slice's workers may take to free what its holder left there.
WARM_RESET_TIMEOUT = settings.WARM_RESET_TIMEOUT

#: What a warm slice can serve: (accelerator type, number of slices). The device
#: assignment and steps per run are configured again on every acquire.
WarmKey = tuple[str, int]


def placements(allocation: Allocation) -> list[HostPlacement]:
    """One placement per allocated host, in JAX process-id order; each worker is named
    ``jaxpod:<instance>:<allocation>:host-<process id>`` (plus a per-launch suffix)."""
    from jaxpod.service.capacity.orphans import object_name  # imports Ray

    cpus = allocation.request.cpus_per_host
    return [
        HostPlacement(placement_group=s.placement_group, bundle_index=h.bundle_index,
                      resources={"TPU": float(h.chips)}, num_cpus=cpus, env=dict(h.env),
                      unset_env=tuple(h.unset_env),
                      name=object_name(allocation.id, f"host-{h.process_id}"))
        for s in allocation.slices for h in s.hosts
    ]


def start_replica_group(allocation: Allocation, platform: str = SIMULATED_PLATFORM,
                        start_timeout_s: float | None = None) -> ReplicaGroup:
    """Starts the host workers of ``allocation`` as one replica group.

    Args:
      allocation: whole slices from :class:`~jaxpod.service.capacity.allocator.SliceAllocator`.
      platform: ``"cpu"`` on simulated hosts (one CPU device per chip), ``"tpu"`` on
        real TPU hosts.
      start_timeout_s: overrides ``JAXPOD_WORKER_START_TIMEOUT_S``.

    Raises:
      jaxpod.WorkerStartError: a host did not start or join in time.
    """
    first = allocation.slices[0].info
    devices_per_host = first.chips_per_host * first.devices_per_chip
    return ReplicaGroup.start(placements(allocation), devices_per_host, RayWorkers(),
                              platform, start_timeout_s)


class Held(Protocol):
    """The capacity one acquire holds: a Ray :class:`Allocation`, or a local one."""

    def names(self) -> list[str]:
        """Its slices' names."""
        ...

    def describe(self) -> dict[str, Any]:
        """What a ``HeldSlice`` reports of it (type, slices, hosts, names)."""
        ...

    def release(self) -> None: ...


@dataclass(eq=False)
class WarmSlice:
    """A released slice whose workers were reset and wait for the next acquire; it
    keeps its capacity (so no other acquire can take it) but has no holder."""

    key: WarmKey
    group: ReplicaGroup
    allocation: Held
    functions: weakref.WeakKeyDictionary[Any, str]

    def stop(self) -> None:
        """Stops the workers and releases the allocation."""
        try:
            if self.group.broken:  # a lost worker: the others would wait for it
                self.group.kill()
            else:
                self.group.stop()
        finally:
            self.allocation.release()


class PooledSlices(abc.ABC):
    """A slice provider's common part: acquire, release, and the warm pool.

    Released slices stay warm, one pool per :data:`WarmKey`, until an acquire of the
    same shape takes them, an acquire that finds no free capacity needs them, or
    :meth:`close`. Subclasses say where capacity and workers come from.
    """

    def __init__(self) -> None:
        self._warm: list[WarmSlice] = []
        self._waiting: collections.Counter[str] = collections.Counter()  # by type
        self._prewarming: dict[WarmKey, object] = {}  # a token per prewarm under way
        self._lock = threading.Lock()
        self._prewarm_ended = threading.Condition(self._lock)
        self._closed = False

    @abc.abstractmethod
    def _allocate(self, request: SliceRequest, key: WarmKey,
                  cancel: Cancel | None) -> Held:
        """Holds ``key[1]`` whole slices of ``key[0]`` (waiting as the request allows;
        ``AllocationCancelledError`` once ``cancel`` is set)."""

    @abc.abstractmethod
    def _start_group(self, held: Held) -> ReplicaGroup:
        """Starts the held slices' host workers as one replica group."""

    @abc.abstractmethod
    def _idle_slices(self, accelerator_type: str) -> int:
        """Slices of the type that nothing holds, warm ones excluded."""

    @abc.abstractmethod
    def cluster(self) -> list[ClusterSlice]:
        """Every slice of the cluster."""

    @abc.abstractmethod
    def snapshot(self) -> Sequence[Any]:
        """Every slice with its hosts and health (see ``SliceProvider.snapshot``)."""

    def warm(self) -> list[WarmSlice]:
        """The warm slices now, oldest first."""
        with self._lock:
            return list(self._warm)

    def prewarm(self, accelerator_type: str, num_slices: int = 1) -> threading.Thread:
        """Starts the workers of that many slices of the type on a thread of their own
        and keeps them warm, so that the first acquire of that shape takes them
        instead of starting its own; one that comes meanwhile waits for them. A
        failure is logged: acquires then start workers as they otherwise would.

        Returns:
          The thread (joined by tests; the service does not wait for it).
        """
        request = SliceRequest(accelerator_type=accelerator_type, num_slices=num_slices)
        key = _key(request)
        token = object()
        with self._lock:
            self._prewarming[key] = token
        thread = threading.Thread(target=self._prewarm, args=(request, key, token),
                                  name=f"jaxpod-prewarm-{key[0]}", daemon=True)
        thread.start()
        return thread

    def _prewarm(self, request: SliceRequest, key: WarmKey,
                 token: object) -> None:
        try:
            allocation, group = self._start_workers(request, key)
            logger.info("slice %s prewarmed", allocation.names())
            self._park(WarmSlice(key, group, allocation, GroupEngine(group).functions))
        except Exception as e:
            logger.warning("prewarming %d x %s failed (%s: %s); acquires start their own "
                           "workers", key[1], key[0], type(e).__name__, e)
        finally:
            with self._prewarm_ended:
                if self._prewarming.get(key) is token:  # not a later prewarm's
                    del self._prewarming[key]
                self._prewarm_ended.notify_all()

    def acquire(self, request: SliceRequest, slice_id: str,
                cancel: Cancel | None = None) -> HeldSlice:
        """A warm slice of the request's shape if one still works (after waiting for
        one being prewarmed), else allocates, starts and configures; on any failure
        nothing stays held. A wait for a free slice, or for the prewarm, gives up once
        ``cancel`` is set (``AllocationCancelledError``)."""
        key = _key(request)
        self._await_prewarm(request, key, cancel)
        while (warm := self._take_warm(key)) is not None:
            held = self._reuse(warm, request, slice_id)
            if held is not None:
                return held
        # Counted before making room: a slice released from here on is stopped, not
        # kept warm, so its capacity reaches this acquire if it has to wait for some.
        with self._lock:
            self._waiting[key[0]] += 1
        try:
            self._make_room(key)
            return self._start(request, slice_id, key, cancel)
        finally:
            with self._lock:
                self._waiting[key[0]] -= 1

    def _await_prewarm(self, request: SliceRequest, key: WarmKey,
                       cancel: Cancel | None) -> None:
        """Waits for a prewarm of ``key`` under way, if any: its capacity is held
        meanwhile, and its slice is the acquire's to take. Gives up at the request's
        allocation time-out (the acquire then starts its own workers), or raises
        ``AllocationCancelledError`` once ``cancel`` is set."""
        limit = ALLOCATION_TIMEOUT.resolve(request.timeout_s or None)
        with (cancel.waking(self._wake_prewarm_waiters) if cancel is not None
              else contextlib.nullcontext()), self._prewarm_ended:
            token = self._prewarming.get(key)
            if token is None:
                return
            logger.info("an acquire of %d x %s waits for that slice's workers being "
                        "prewarmed", key[1], key[0])
            self._prewarm_ended.wait_for(
                lambda: self._prewarming.get(key) is not token
                or (cancel is not None and cancel.is_set()), limit)
            if cancel is not None and cancel.is_set():
                raise AllocationCancelledError(
                    f"The acquire of {key[1]} x {key[0]} was cancelled while it waited "
                    "for that slice's workers to be prewarmed; nothing is held.")

    def _wake_prewarm_waiters(self) -> None:
        with self._prewarm_ended:
            self._prewarm_ended.notify_all()

    def waiting(self, accelerator_type: str) -> int:
        """Acquires of the type that found no warm slice and allocate (or wait to)."""
        with self._lock:
            return self._waiting[accelerator_type]

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        """Whether an acquire of that shape would get slices without waiting (but for a
        prewarm under way): a warm one of that shape, or one being prewarmed, or
        enough idle (or warm, which an acquire stops to make room) slices of the
        type."""
        key = (accelerator_type.strip().lower(), num_slices)
        with self._lock:
            if key in self._prewarming or any(w.key == key for w in self._warm):
                return True
            warm = sum(w.key[1] for w in self._warm if w.key[0] == key[0])
        return warm + self._idle_slices(key[0]) >= num_slices

    def _start(self, request: SliceRequest, slice_id: str, key: WarmKey,
               cancel: Cancel | None = None) -> HeldSlice:
        allocation, group = self._start_workers(request, key, cancel)
        try:
            engine = GroupEngine(group)
            _configure(engine, request)
        except BaseException:
            group.stop()
            allocation.release()
            raise
        return self._held(slice_id, engine, allocation, key)

    def _start_workers(self, request: SliceRequest, key: WarmKey,
                       cancel: Cancel | None = None) -> tuple[Held, ReplicaGroup]:
        """Allocates and starts the workers; on a failure nothing stays held."""
        allocation = self._allocate(request, key, cancel)
        try:
            return allocation, self._start_group(allocation)
        except BaseException:
            allocation.release()
            raise

    def _reuse(self, warm: WarmSlice, request: SliceRequest, slice_id: str
               ) -> HeldSlice | None:
        """``warm`` configured for ``request``; ``None`` when its workers are lost
        (they are stopped and released: the caller tries the next or starts fresh)."""
        engine = GroupEngine(warm.group, functions=warm.functions)
        try:
            _configure(engine, request)  # also tells whether every worker still answers
        except Exception as e:
            if warm.group.broken is None and not isinstance(e, SliceResetError):
                self._park(warm)  # every worker answered: the request itself is wrong
                raise
            logger.warning("warm slice %s is lost (%s: %s); stopping it and starting "
                           "fresh workers", warm.allocation.names(), type(e).__name__, e)
            _stop_quietly(warm)
            return None
        notices = [n for n in engine.preemption_notices() if n is not None]
        if notices:  # told of its preemption while it waited warm: about to be killed
            logger.warning("warm slice %s has a preemption notice (%s); stopping it and "
                           "starting fresh workers", warm.allocation.names(),
                           notices[0].reason)
            _stop_quietly(warm)
            return None
        return self._held(slice_id, engine, warm.allocation, warm.key)

    def _held(self, slice_id: str, engine: GroupEngine, allocation: Held,
              key: WarmKey) -> HeldSlice:
        return HeldSlice(slice_id, engine, self._releaser(engine, allocation, key),
                         allocation.describe())

    def _releaser(self, engine: GroupEngine, allocation: Held, key: WarmKey
                  ) -> Callable[[], None]:
        """The slice's release (idempotent): its workers reset and kept warm."""
        lock = threading.Lock()
        done = [False]

        def release() -> None:
            with lock:
                if done[0]:
                    return
                done[0] = True
            self._keep_warm(WarmSlice(key, engine.group, allocation, engine.functions),
                            engine)

        return release

    def _keep_warm(self, warm: WarmSlice, engine: GroupEngine) -> None:
        """Resets ``warm``'s workers and pools them; stops them where that fails."""
        if self._closed:
            warm.stop()
            return
        try:
            # A host with a preemption notice is about to be killed: not worth keeping.
            notices = engine.preemption_notices(WARM_RESET_TIMEOUT.seconds())
            resets = None if any(notices) else engine.reset_workers(WARM_RESET_TIMEOUT.seconds())
        except Exception as e:
            logger.warning("slice %s failed its reset (%s: %s); stopping its workers",
                           warm.allocation.names(), type(e).__name__, e)
            warm.stop()
            return
        if resets is None:
            logger.warning("slice %s has preemption notices %s; stopping its workers",
                           warm.allocation.names(), notices)
            warm.stop()
            return
        logger.info("slice %s kept warm; freed per host: %s", warm.allocation.names(),
                    [(r.values, r.datasets, r.iterators) for r in resets])
        self._park(warm)

    def _park(self, warm: WarmSlice) -> None:
        with self._lock:
            if not self._closed and not self._waiting[warm.key[0]]:
                self._warm.append(warm)
                return
        # The service closed meanwhile, or an acquire waits for this type's capacity
        # (kept warm, the slice would hold it until that acquire timed out).
        warm.stop()

    def _take_warm(self, key: WarmKey) -> WarmSlice | None:
        with self._lock:
            for i in reversed(range(len(self._warm))):  # the most recently used first
                if self._warm[i].key == key:
                    return self._warm.pop(i)
        return None

    def _make_room(self, key: WarmKey) -> None:
        """Stops the warm slices that hold the capacity this acquire needs, when the
        cluster has too little free: warm slices must never make an acquire wait. Only
        those of the same accelerator type (kept for another number of slices) can
        free any: slices of other types are other hosts."""
        with self._lock:
            blocking = [w for w in self._warm if w.key[0] == key[0]]
        if not blocking or self._idle_slices(key[0]) >= key[1]:
            return
        with self._lock:
            evicted = [w for w in blocking if w in self._warm]
            self._warm = [w for w in self._warm if w not in evicted]
        for w in evicted:
            logger.info("stopping warm slice %s to make room for %s", w.allocation.names(),
                        key)
            _stop_quietly(w)

    def close(self) -> None:
        """Stops every warm slice; slices released from now on are stopped at once
        (service shutdown)."""
        with self._lock:
            self._closed = True
            warm, self._warm = self._warm, []
        for w in warm:
            _stop_quietly(w)



class RaySlices(PooledSlices):
    """The coordinator's slice provider on a Ray cluster: whole-slice allocation
    (placement groups), host workers as Ray actors, device assignment.

    Args:
      allocator: whole-slice allocation on the Ray cluster this process joined.
      platform: ``"cpu"`` for simulated hosts, ``"tpu"`` on real ones.
      start_timeout_s: overrides ``JAXPOD_WORKER_START_TIMEOUT_S``.
    """

    def __init__(self, allocator: SliceAllocator | None = None,
                 platform: str = SIMULATED_PLATFORM,
                 start_timeout_s: float | None = None) -> None:
        from jaxpod.service.capacity.allocator import SliceAllocator

        super().__init__()
        self.allocator = allocator or SliceAllocator()
        self.platform = platform
        self.start_timeout_s = start_timeout_s

    def _allocate(self, request: SliceRequest, key: WarmKey,
                  cancel: Cancel | None) -> Held:
        return self.allocator.allocate(request.accelerator_type, key[1],
                                       timeout_s=request.timeout_s or None,
                                       cancel=cancel.event if cancel is not None else None)

    def _start_group(self, held: Held) -> ReplicaGroup:
        return start_replica_group(cast("Allocation", held), self.platform,
                                   self.start_timeout_s)

    def _idle_slices(self, accelerator_type: str) -> int:
        from jaxpod.service.capacity.resolvers.ray import snapshot

        slices, _ = snapshot()
        return sum(1 for s in slices if s.idle and s.info.accelerator_type == accelerator_type)

    def snapshot(self) -> Sequence[Any]:
        from jaxpod.service.capacity.resolvers.ray import snapshot

        return snapshot()[0]

    def cluster(self) -> list[ClusterSlice]:
        return [ClusterSlice(name=s.info.name, accelerator_type=s.info.accelerator_type,
                             num_hosts=len(s.hosts)) for s in self.snapshot()]


def _key(request: SliceRequest) -> WarmKey:
    return request.accelerator_type.strip().lower(), request.num_slices or 1


def _configure(engine: GroupEngine, request: SliceRequest) -> None:
    engine.configure(request.steps_per_run or 1, list(request.computation_shape) or None,
                     request.num_replicas or None)


def _stop_quietly(warm: WarmSlice) -> None:
    """Stops a warm slice; a failure is logged (nobody waits on it, and the next one
    must still be stopped)."""
    try:
        warm.stop()
    except Exception:
        logger.exception("stopping warm slice %s failed", warm.allocation.names())
