"""Simulated slices without Ray: host workers as plain processes of this machine.

``jaxpod serve --local --provider processes`` (see ``docs/design/cold-start.md``):

* :class:`ProcessWorkers` starts each host as ``python -m jaxpod.worker.host_process``,
  with its host's environment, answering the calls
  :class:`~jaxpod.service.replica_group.ReplicaGroup` makes of a worker over two
  pipes. Operations, resets and faults then go over the operation channels, as for
  Ray actors. A worker's read pipe is its tie to this process: when this process
  ends, however it ends, the workers exit.
* :class:`LocalProcessSlices` is the slice provider: the simulated slices of a
  ``--slices`` spec, held whole or not at all, with the same warm pool as
  :class:`~jaxpod.service.workers.RaySlices`.

No Ray process starts, which is most of a Ray cluster's start-up CPU.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxpod.errors import AllocationTimeoutError, WorkerStartError
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.local_cluster import SimulatedSlice, plan_slices
from jaxpod.service.replica_group import HostPlacement, ReplicaGroup, not_answered
from jaxpod.service.resolvers.base import (
    ALLOCATION_TIMEOUT,
    HostInfo,
    SliceInfo,
    megascale_env,
)
from jaxpod.service.topology import slice_shape
from jaxpod.service.workers import Held, PooledSlices, WarmKey
from jaxpod.worker.host_process import LOOPBACK, read_message, write_message
from jaxpod.worker.host_worker import SIMULATED_PLATFORM


@dataclass(eq=False)
class HostProcess:
    """One started worker process and its two pipe ends."""

    index: int
    process: subprocess.Popen[bytes]
    to_worker: int
    from_worker: int
    owed: int = 0  # replies sent for and not yet read (the constructor's, then calls')
    closed: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        write_message(self.to_worker, (method, args))
        self.owed += 1

    def reply(self, deadline: float) -> tuple[bool, Any] | None:
        """The next reply, ``None`` if it did not come by ``deadline``.

        Raises:
          WorkerStartError: the process exited first.
        """
        ready, _, _ = select.select([self.from_worker], [], [],
                                    max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            ok, value = read_message(self.from_worker)
        except EOFError:
            raise WorkerStartError(
                f"Host {self.index}'s worker process {self.pid} exited (status "
                f"{self.process.wait()}) before it answered; its output is in the "
                "service's log.") from None
        self.owed -= 1
        return ok, value

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.to_worker, self.from_worker):
                with contextlib.suppress(OSError):
                    os.close(fd)


class ProcessWorkers:
    """Starts host workers as processes of this machine (a placement's ``env`` and
    ``unset_env`` are its host's; its Ray fields are not used)."""

    def start(self, placements: Sequence[HostPlacement], devices_per_host: int,
              platform: str) -> list[HostProcess]:
        workers: list[HostProcess] = []
        try:
            for index, placement in enumerate(placements):
                worker = _spawn(index)
                workers.append(worker)
                worker.send("__init__", (index, len(placements), devices_per_host, platform,
                                         placement.env, placement.unset_env))
        except BaseException:
            self.kill(workers)
            raise
        return workers

    def call(self, workers: Sequence[Any], method: str, args: Sequence[tuple[Any, ...]],
             deadline: float, what: str, limit: float) -> list[Any]:
        for worker, call_args in zip(workers, args, strict=True):
            worker.send(method, call_args)
        results = []
        for worker in workers:
            answer: tuple[bool, Any] | None = None
            while worker.owed:  # the constructor's reply first, if still owed
                answer = worker.reply(deadline)
                if answer is None:
                    missing = [w.index for w in workers if w.owed]
                    raise not_answered(missing, len(workers), what, limit)
                if not answer[0]:
                    raise answer[1]
            assert answer is not None
            results.append(answer[1])
        return results

    def stop(self, workers: Sequence[Any], limit: float) -> None:
        deadline = time.monotonic() + limit
        with contextlib.suppress(Exception):  # a worker that cannot leave is killed
            self.call(workers, "shutdown", [()] * len(workers), deadline, "stop", limit)
        self.kill(workers)

    def kill(self, workers: Sequence[Any]) -> None:
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.process.kill()
            worker.process.wait()
            worker.close()


def _spawn(index: int) -> HostProcess:
    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "jaxpod.worker.host_process", str(child_reads),
             str(child_writes)],
            pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL,
            # The service's stdout may be a protocol (the embedded service's
            # announcement): what a worker prints goes to the service's log.
            stdout=sys.stderr,
            start_new_session=True)  # a terminal's Ctrl-C reaches the service, not these
    except BaseException:
        os.close(parent_writes)
        os.close(parent_reads)
        raise
    finally:
        os.close(child_reads)
        os.close(child_writes)
    return HostProcess(index, process, to_worker=parent_writes, from_worker=parent_reads)


# -------------------------------------------------------------------- the provider
@dataclass(eq=False)
class LocalHeld:
    """Simulated slices held by one acquire."""

    slices: tuple[SimulatedSlice, ...]
    on_release: Callable[[LocalHeld], None]
    released: bool = False

    def names(self) -> list[str]:
        return [s.name for s in self.slices]

    def describe(self) -> dict[str, Any]:
        return {"accelerator_type": self.slices[0].shape.accelerator_type,
                "num_slices": len(self.slices),
                "num_hosts": sum(s.shape.num_hosts for s in self.slices),
                "slice_names": self.names()}

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.on_release(self)

    def placements(self) -> list[HostPlacement]:
        """Every host, in JAX process-id order, with its host's environment (and, for
        several slices, MegaScale's, as the Ray allocator gives)."""
        out = []
        for index, s in enumerate(self.slices):
            megascale, unset = megascale_env(len(self.slices), index, LOOPBACK)
            out += [HostPlacement(None, worker_id, {}, env={**s.host_env(worker_id),
                                                           **megascale}, unset_env=unset)
                    for worker_id in range(s.shape.num_hosts)]
        return out


class LocalProcessSlices(PooledSlices):
    """The slice provider of a simulated cluster without Ray.

    Args:
      spec: the simulated slices, as ``jaxpod serve --slices`` (``"v4-16,v4-8"``).
      start_timeout_s: overrides ``JAXPOD_WORKER_START_TIMEOUT_S``.
    """

    def __init__(self, spec: str | Sequence[str], start_timeout_s: float | None = None
                 ) -> None:
        super().__init__()
        self.slices = plan_slices(spec)
        self.start_timeout_s = start_timeout_s
        self._free = {s.name for s in self.slices}
        self._changed = threading.Condition()

    def _allocate(self, request: pb.AcquireSliceRequest, key: WarmKey) -> Held:
        wanted, count = slice_shape(request.accelerator_type).accelerator_type, key[1]
        of_type = [s for s in self.slices if s.shape.accelerator_type == wanted]
        limit = ALLOCATION_TIMEOUT.resolve(request.timeout_s or None)
        deadline = time.monotonic() + limit
        with self._changed:
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
                self._changed.wait(left)

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
        return ReplicaGroup.start(held.placements(), shape.devices_per_host,
                                  SIMULATED_PLATFORM, self.start_timeout_s,
                                  launcher=ProcessWorkers())

    def _idle_slices(self, accelerator_type: str) -> int:
        with self._changed:
            return sum(1 for s in self.slices if s.name in self._free
                       and s.shape.accelerator_type == accelerator_type)

    def cluster(self) -> list[pb.ClusterSlice]:
        return [pb.ClusterSlice(name=s.name, accelerator_type=s.shape.accelerator_type,
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
