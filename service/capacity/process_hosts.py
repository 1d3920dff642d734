"""Simulated hosts' workers as plain processes of this machine, and the hosts one
acquire holds: what ``jaxpod serve --local --provider processes`` needs before its slice
provider exists (see :mod:`jaxpod.service.capacity.process_slices`).

This module imports no JAX and no service stack, so that ``jaxpod serve --prewarm`` can
start a slice's workers (:func:`start_ahead`) before the service has imported those:
the workers import JAX on the other cores meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxpod.errors import WorkerStartError
from jaxpod.service.capacity.local_cluster import SimulatedSlice, plan_slices
from jaxpod.service.capacity.resolvers.base import megascale_env
from jaxpod.service.capacity.topology import slice_shape
from jaxpod.service.slices.replica_group import HostPlacement, not_answered
from jaxpod.worker.host_process import LOOPBACK, read_message, write_message


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
                # bounded: its pipe closed, so the process exited
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
    ``unset_env`` are its host's; its Ray fields are not used).

    Args:
      ahead: workers already started for the placements of the first :meth:`start`,
        which then takes them instead of starting its own (a restart starts anew).
    """

    def __init__(self, ahead: HostsStartedAhead | None = None) -> None:
        self._ahead = ahead

    def start(self, placements: Sequence[HostPlacement], devices_per_host: int,
              platform: str) -> list[HostProcess]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.started_for == (tuple(placements), devices_per_host, platform):
                return ahead.workers
            self.kill(ahead.workers)  # started for other hosts: of no use here
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
            worker.process.wait()  # bounded: SIGKILLed just now
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
            # A process group of its own: a terminal's Ctrl-C reaches the service, not
            # these. Not a session of its own: Linux's scheduler gives each session
            # (autogroup) an equal share, and simulated hosts in sessions of their own
            # preempted each other twice as often, slowing their collectives by a
            # quarter (a 2-layer transformer's steps ran at 0.72x plain JAX's).
            process_group=0)
    except BaseException:
        os.close(parent_writes)
        os.close(parent_reads)
        raise
    finally:
        os.close(child_reads)
        os.close(child_writes)
    return HostProcess(index, process, to_worker=parent_writes, from_worker=parent_reads)


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


@dataclass(eq=False)
class HostsStartedAhead:
    """A simulated slice's workers, started before anything asked for them
    (:func:`start_ahead`); a :class:`ProcessWorkers` given them takes them."""

    slice_names: tuple[str, ...]
    #: What they were started for: placements, devices per host, platform.
    started_for: tuple[tuple[HostPlacement, ...], int, str]
    workers: list[HostProcess]

    def kill(self) -> None:
        ProcessWorkers().kill(self.workers)


def prewarm_type(spec: str, requested: str) -> str:
    """The accelerator type ``jaxpod serve --prewarm`` names: ``requested``, or the
    first slice's of the simulated cluster ``spec`` if empty.

    Raises:
      ValueError: the cluster has no slice of that type (the message lists its types).
    """
    slices = plan_slices(spec)
    if not requested:
        return slices[0].shape.accelerator_type
    wanted = slice_shape(requested).accelerator_type
    if not any(s.shape.accelerator_type == wanted for s in slices):
        has = ", ".join(dict.fromkeys(s.shape.accelerator_type for s in slices))
        raise ValueError(f"--prewarm {requested}: the simulated cluster {spec!r} has no "
                         f"{wanted} slice (it has {has}). Prewarm one of those, or add "
                         "it to --slices.")
    return wanted


def start_ahead(spec: str, accelerator_type: str, platform: str) -> HostsStartedAhead:
    """Starts the workers of the first slice of ``accelerator_type`` (as
    :func:`prewarm_type` returns it) in the simulated cluster ``spec`` (``jaxpod serve
    --slices``), as the first acquire of it would."""
    first = next(s for s in plan_slices(spec) if s.shape.accelerator_type == accelerator_type)
    held = LocalHeld((first,), lambda _: None)
    placements = tuple(held.placements())
    devices = first.shape.devices_per_host
    workers = ProcessWorkers().start(placements, devices, platform)
    return HostsStartedAhead(tuple(held.names()), (placements, devices, platform), workers)
