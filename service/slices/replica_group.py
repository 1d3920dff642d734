"""``ReplicaGroup``: the coordinator's handle on one slice's host workers.

It starts one :class:`~jaxpod.worker.host_worker.HostWorker` per host through a
:class:`WorkerLauncher` (Ray actors pinned to the slice's placement-group bundles, or
plain processes of this machine), makes them join one ``jax.distributed`` group and
opens an operation channel to each (:mod:`jaxpod.worker.channel`), then sends every
engine operation to all hosts, one operation at a time and in the same order. Each
operation carries a per-group sequence number that the workers check, so a skipped or
reordered call fails loudly instead of deadlocking a collective. Every wait has a named
time-out that the environment can override.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from jaxpod import settings
from jaxpod.errors import (
    JaxpodError,
    OperationTimeoutError,
    PeerHostError,
    SliceResetError,
    WorkerLostError,
    WorkerStartError,
)
from jaxpod.operations import (
    Digest,
    Digested,
    DivergedError,
    Dropped,
    Envelope,
    Operation,
    RemoteError,
)
from jaxpod.pieces import PieceLayout
from jaxpod.worker import channel, channel_codec, channel_io
from jaxpod.worker.host_worker import SIMULATED_PLATFORM

START_TIMEOUT = settings.WORKER_START_TIMEOUT
OPERATION_TIMEOUT = settings.OPERATION_TIMEOUT
HOST_STACKS_TIMEOUT = settings.HOST_STACKS_TIMEOUT
STOP_TIMEOUT = settings.WORKER_STOP_TIMEOUT
#: Operations a pipeline sends ahead of their replies; 1: none ahead of another.
PIPELINE_DEPTH = settings.PIPELINE_DEPTH
#: Ids reserved per operation sent ahead: its objects' ids must be known before its
#: replies are (the hosts refuse to make more).
ID_BLOCK = 1 << 20
#: Bytes of messages a pipeline leaves unread on a host's channel at most.
AHEAD_BYTES = 32 * 1024

R = TypeVar("R")


@dataclass(frozen=True)
class HostPlacement:
    """Where one host worker runs and how its process is set up.

    Attributes:
      placement_group: the slice's placement group.
      bundle_index: this host's bundle in it.
      resources: custom resources the worker consumes from the bundle (e.g. TPU chips).
      num_cpus: CPUs it consumes from the bundle.
      env: variables set in the worker's process before JAX starts (``TPU_*``,
        ``MEGASCALE_*``).
      unset_env: variables removed from it (e.g. stale ``MEGASCALE_*``).
      name: the worker actor's Ray name, in jaxpod's Ray namespace, less a suffix
        that each launch adds (``None``: unnamed). Names let a later coordinator find
        the actors of a dead one (:mod:`jaxpod.service.capacity.orphans`).
    """

    placement_group: Any
    bundle_index: int
    resources: dict[str, float]
    num_cpus: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    name: str | None = None


class WorkerLauncher(Protocol):
    """Starts, calls and stops a group's :class:`HostWorker` processes: Ray actors
    (:class:`~jaxpod.service.capacity.ray_workers.RayWorkers`) or plain processes of
    this machine (:class:`~jaxpod.service.capacity.process_hosts.ProcessWorkers`).
    Everything after the start (operations, resets, faults) goes over the operation
    channels, the same whichever started the workers."""

    def start(self, placements: Sequence[HostPlacement], devices_per_host: int,
              platform: str) -> list[Any]:
        """One started worker per placement, in host order (constructed, not joined)."""
        ...

    def call(self, workers: Sequence[Any], method: str, args: Sequence[tuple[Any, ...]],
             deadline: float, what: str, limit: float) -> list[Any]:
        """``method(*args[i])`` on each worker at once; their results in order.

        Raises:
          WorkerStartError: some did not answer by ``deadline`` (monotonic; ``what``
            and ``limit`` word the message); what a call raised, as it raised it.
        """
        ...

    def stop(self, workers: Sequence[Any], limit: float) -> None:
        """Asks every worker to leave its group (``shutdown``), waits up to ``limit``
        seconds, then kills them."""
        ...

    def kill(self, workers: Sequence[Any]) -> None:
        """Kills the workers at once (those gone already are skipped)."""
        ...


def not_answered(missing: list[int], hosts: int, what: str, limit: float
                  ) -> WorkerStartError:
    return WorkerStartError(
        f"Hosts {missing} of {hosts} did not {what} within {limit:g}s "
        f"({START_TIMEOUT.env_var}). Check that every host of the slice is up and can "
        "reach host 0's coordinator port.")


@dataclass(frozen=True)
class _Recipe:
    """How a group's workers were started, to start them again in the same place."""

    placements: tuple[HostPlacement, ...]
    devices_per_host: int
    platform: str
    start_timeout_s: float | None
    launcher: WorkerLauncher


class ReplicaGroup:
    """Sends engine operations to every host of one slice, in one global order.

    When some host does not answer an operation in time (one stuck in a collective
    that another never entered), the group restarts every worker in the same
    placements, forms a new ``jax.distributed`` group and raises ``SliceResetError``:
    the values, datasets and iterators on the slice are gone, the next call works.
    """

    def __init__(self, workers: list[Any], info: list[dict[str, int]],
                 channels: list[socket.socket], recipe: _Recipe | None = None) -> None:
        self._workers = workers
        self._channels = channels
        self.info = info
        self._recipe = recipe
        self._seq = 0
        self._next_id = 1  # the first id the next operation's new objects get
        self._lock = threading.Lock()
        #: One control call (stacks, stop) at a time: they share each worker's pipe.
        self._control = threading.Lock()
        self._broken: str | None = None
        #: What a call on the broken group raises: a lost host stays a lost host for
        #: every caller (a job's retry policy takes it as a preemption), whichever
        #: call saw it first.
        self._broken_as: type[JaxpodError] = JaxpodError
        self._stopped = False
        #: How many times the workers were restarted (callers drop what they cached).
        self.resets = 0

    @property
    def num_hosts(self) -> int:
        return len(self._workers)

    @property
    def broken(self) -> str | None:
        """Why the group can take no more operations (``None``: it can)."""
        return self._broken

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, in host order."""
        return [int(i["pid"]) for i in self.info]

    @property
    def num_replicas(self) -> int:
        return int(self.info[0]["num_replicas"])

    @classmethod
    def start(cls, placements: Sequence[HostPlacement], devices_per_host: int,
              launcher: WorkerLauncher, platform: str = SIMULATED_PLATFORM,
              start_timeout_s: float | None = None) -> ReplicaGroup:
        """Starts one worker per placement with ``launcher`` and forms the
        ``jax.distributed`` group.

        Raises:
          WorkerStartError: a worker did not start or some host did not join within
            the start time-out (``JAXPOD_WORKER_START_TIMEOUT_S``); every started
            worker is stopped first.
        """
        recipe = _Recipe(tuple(placements), devices_per_host, platform, start_timeout_s,
                         launcher)
        return cls(*_launch(recipe), recipe)

    def _reset(self, why: str, stacks: list[str] | None = None) -> SliceResetError:
        """Restarts every worker in its placement (the caller holds the lock); the
        error to raise, saying what happened to the slice's values (with ``stacks``,
        the hosts' Python stacks read before, as its ``host_stacks``)."""
        error = self._restart(why)
        error.host_stacks = stacks
        return error

    def _restart(self, why: str) -> SliceResetError:
        assert self._recipe is not None
        self._close_channels()
        self._recipe.launcher.kill(self._workers)
        try:
            self._workers, self.info, self._channels = _launch(self._recipe)
        except WorkerStartError as e:
            self._broken = f"{why}, and its workers did not start again: {e}"
            return SliceResetError(f"{why}. Restarting the slice's workers failed ({e}); "
                                   "release the slice and acquire a new one.")
        if self._stopped:  # released meanwhile
            self._close_channels()
            self._recipe.launcher.kill(self._workers)
            return SliceResetError(f"{why}; the slice was released meanwhile.")
        # Ids go on from where they were: a value from before the reset must never
        # name one made after it (nor its finalizer free that one).
        self._seq, self._broken, self._broken_as = 0, None, JaxpodError
        self.resets += 1
        return SliceResetError(
            f"{why}. The slice's workers were restarted and every value, dataset and "
            "iterator on it is gone (the next call works): create them again. A step "
            "function that takes a different path on some hosts (e.g. branching on "
            "jax.process_index()) causes this.")

    def stacks(self, timeout: float | None = None) -> list[str]:
        """Every host's Python stacks (each thread's), in host order, read over the
        workers' control calls, so a host busy in an operation answers too. A host
        that cannot answer within ``timeout`` (``JAXPOD_HOST_STACKS_TIMEOUT_S``) is
        reported so, in its place."""
        limit = HOST_STACKS_TIMEOUT.resolve(timeout)
        with self._control:
            workers = list(self._workers)
            if self._recipe is None:
                return ["(this group's workers are not processes it started)"] * len(workers)
            try:
                return [str(s) for s in self._recipe.launcher.call(
                    workers, "stacks", [()] * len(workers), time.monotonic() + limit,
                    "report its Python stacks", limit)]
            except WorkerStartError:  # some host did not answer in time
                return [f"(no answer from some host within {limit:g}s "
                        f"({HOST_STACKS_TIMEOUT.env_var}): a worker gone, or native code "
                        "holding its Python interpreter lock)"] * len(workers)
            except Exception as e:
                return [f"(not read: {type(e).__name__}: {e})"] * len(workers)

    def _close_channels(self) -> None:
        for sock in self._channels:  # wakes a call waiting on a reply, too
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()



    def call(self, op: Operation[R], *, timeout: float | None = None,
             drops: DropSource | None = None, layout: PieceLayout | None = None
             ) -> list[R]:
        """Runs ``op`` on every host; returns each host's result in host order.

        Args:
          timeout: the operation's limit, counted from when it has the group (waiting
            for the previous operation may take as long again).
          drops: what to free first, in the same round trip (what the caller dropped
            since its previous call); taken once the operation is about to be sent,
            given back if it is not.
          layout: how to receive the replies' ``Streamed`` buffers (as ``Pieces``).

        Raises:
          The first failed host's error (user exceptions keep their type; the remote
          traceback and the failed hosts are attached as notes); ``SliceResetError``
          when some host did not answer in time and the workers were restarted
          (``OperationTimeoutError`` where they cannot be).
        """
        limit = OPERATION_TIMEOUT.resolve(timeout)
        with self._holding(type(op).__name__, limit):
            sent = self._send(op, drops, limit, layout)
            assert sent is not None
            return self._finish(sent)

    @contextlib.contextmanager
    def pipeline(self, timeout: float | None = None) -> Iterator[Pipeline]:
        """Holds the group for operations sent ahead of the replies before them (one
        thread sends and receives). Replies not received when it closes are read
        and dropped, so the channels stay in step."""
        limit = OPERATION_TIMEOUT.resolve(timeout)
        with self._holding("a pipelined operation", limit):
            pipeline = Pipeline(self, limit)
            try:
                yield pipeline
            finally:
                pipeline.drain()

    @contextlib.contextmanager
    def _holding(self, what: str, limit: float) -> Iterator[None]:
        # One caller at a time: replies come back in the order they were asked for.
        if not self._lock.acquire(timeout=limit):
            raise OperationTimeoutError(
                f"Operation {what} waited {limit:g}s ({OPERATION_TIMEOUT.env_var}) for "
                "the group's previous operation to finish.")
        try:
            yield
        finally:
            self._lock.release()

    def _send(self, op: Operation[Any], drops: DropSource | None, limit: float,
              layout: PieceLayout | None = None, ahead: bool = False,
              max_bytes: int | None = None) -> _Sent | None:
        """Sends ``op`` to every host (the caller holds the group). ``ahead``: the next
        operation may be sent before this one's replies are read, so its objects get
        a block of ``ID_BLOCK`` ids of their own, and its replies lend no memory.
        ``None``: its message is over ``max_bytes``, and nothing was sent."""
        name = type(op).__name__
        if self._broken:
            raise self._broken_as(f"This replica group is broken ({self._broken}); restart it.")
        dropped = drops.take() if drops is not None else None
        first_id = self._next_id
        envelope = Envelope(self._seq, op, dropped, first_id,
                            id_limit=first_id + ID_BLOCK if ahead else None, ahead=ahead)
        try:  # a message that does not pickle is not sent, and uses no number
            encoded = channel_codec.encode(envelope)
        except BaseException:
            if dropped and drops is not None:
                drops.restore(dropped)
            raise
        nbytes = len(encoded[0]) + sum(memoryview(b).nbytes for b in encoded[1])
        if max_bytes is not None and nbytes > max_bytes:
            if dropped and drops is not None:
                drops.restore(dropped)
            return None
        self._seq += 1
        if ahead:
            self._next_id += ID_BLOCK
        try:
            channel_io.send(self._channels, encoded)
        except OSError as e:
            raise self._lost(e, name, 0) from e
        return _Sent(op, name, limit, drops, layout, first_id, nbytes)

    def _finish(self, sent: _Sent) -> list[Any]:
        """Reads every host's reply to ``sent`` (the caller holds the group), counting
        its limit from now: the operations before it are done."""
        op, name, limit = sent.op, sent.name, sent.limit
        try:
            results = self._receive(name, time.monotonic() + limit, limit, sent.layout)
        except OperationTimeoutError as e:
            if self._recipe is None or self._stopped:
                raise
            stacks = self.stacks()  # where each host was, before the restart loses it
            raise self._reset(f"Operation {name} did not finish on every host within "
                              f"{limit:g}s ({OPERATION_TIMEOUT.env_var})", stacks) from e
        results = undigest(results, name)
        failed = [h for h, r in enumerate(results) if isinstance(r, RemoteError)]
        # Once per distinct reply (identical ones are one object: channel_codec.Decoded).
        created = list({id(r): op.created(r) for r in results
                        if not isinstance(r, RemoteError)}.values())
        self._next_id = max([self._next_id - 1, *(i for c in created for i in c.ids)]) + 1
        if op.dispatches and 0 < len(failed) < len(results) and self._recipe is not None:
            # The others may wait for ever in a collective the failed hosts never
            # reached: only a restart brings them back in step.
            error = _host_error(results, failed, name)
            raise self._reset(
                f"Operation {name} failed on host(s) {failed} only "
                f"({type(error).__name__}: {error}), after the other hosts had "
                "dispatched its program") from error
        if failed:
            if sent.drops is not None:  # undone on the hosts where it took effect
                spoiled = op.spoils() if len(failed) < len(results) else Dropped()
                for undo in [*created, spoiled]:
                    sent.drops.restore(undo)
            raise _host_error(results, failed, name)
        return results

    def _receive(self, name: str, deadline: float, limit: float,
                 layout: PieceLayout | None) -> list[Any]:
        """Every host's reply, in host order. Every host's reply is read, even after
        one fails to unpickle, so that the next operation's replies are its own."""
        results: list[Any] = []
        try:
            unreadable = channel_io.read_replies(self._channels, deadline, layout, results,
                                                 channel_codec.Decoded())
        except TimeoutError:
            host = len(results)
            self._broken = f"operation {name} timed out after {limit:g}s"
            self._broken_as = OperationTimeoutError
            raise OperationTimeoutError(
                f"Operation {name} did not finish on host {host} within {limit:g}s "
                f"({OPERATION_TIMEOUT.env_var}); the group is now unusable."
            ) from None
        except OSError as e:
            raise self._lost(e, name, len(results)) from e
        if unreadable:
            host, why = unreadable[0]
            raise JaxpodError(
                f"Host {host}'s reply to operation {name} could not be unpickled here: "
                f"{type(why).__name__}: {why}. The coordinator and the workers must run "
                "the same versions of the packages whose objects the reply holds.") from why
        return results

    def _lost(self, e: OSError, name: str, host: int) -> WorkerLostError:
        # A later host's closed channel may be seen while an earlier one still worked.
        host = e.index if isinstance(e, channel_io.PeerClosedError) else host
        self._broken = f"host {host} went away during operation {name}"
        self._broken_as = WorkerLostError
        return WorkerLostError(
            f"Host {host} stopped answering during operation {name} ({e}): its worker "
            "process died or the group was stopped. The group is now unusable; "
            "release the slice and acquire a new one.")

    def kill(self) -> None:
        """Kills the workers without leaving the group first: for a group that lost a
        worker, whose others would wait for it in ``jax.distributed.shutdown``."""
        self._stopped = True
        self._close_channels()
        if self._recipe is not None:  # else it started no workers (a test's channels)
            self._recipe.launcher.kill(self._workers)
        self._broken = "stopped"

    def stop(self, timeout: float | None = None) -> None:
        """Shuts the group down (``jax.distributed.shutdown`` with a limit), then kills."""
        self._stopped = True  # a reset under way stops the workers it started
        self._close_channels()
        if self._recipe is not None:
            with self._control:
                self._recipe.launcher.stop(self._workers, STOP_TIMEOUT.resolve(timeout))
        self._broken = "stopped"


@dataclass
class _Sent:
    """An operation sent to every host whose replies are not read yet."""

    op: Operation[Any]
    name: str
    limit: float
    drops: DropSource | None
    layout: PieceLayout | None
    first_id: int
    nbytes: int


class Pipeline:
    """Operations sent to a group's hosts ahead of the replies before them.

    The hosts still run them one at a time, in the order sent (DESIGN §1); the sender
    prepares the next while they run. Only an operation whose class is
    ``followable`` may have another sent behind it before its replies are read, and
    the messages unread stay under ``AHEAD_BYTES``: far less than a socket holds, so
    sending never waits on a host that waits to send a reply. One thread sends and
    receives; it holds the group meanwhile (:meth:`ReplicaGroup.pipeline`).
    """

    def __init__(self, group: ReplicaGroup, limit: float) -> None:
        self._group = group
        self._limit = limit
        self._depth = PIPELINE_DEPTH.value()
        self._sent: collections.deque[_Sent] = collections.deque()
        #: Why the operations still unread never ran (a reset, a lost host).
        self._void: BaseException | None = None

    @property
    def pending(self) -> int:
        """Operations sent whose replies are not read yet."""
        return len(self._sent)

    def can_follow(self) -> bool:
        """Whether an operation may be sent now without reading a reply first."""
        return (len(self._sent) < self._depth
                and all(type(s.op).followable for s in self._sent))

    def send(self, op: Operation[Any], drops: DropSource | None = None) -> int | None:
        """Sends ``op``; returns the first id of the objects it creates (its block
        ends ``ID_BLOCK`` later), or ``None`` if its message is too large to go ahead
        of the replies unread (receive one, then send again). Raises what sending
        raises: ``op`` was not sent."""
        if not self.can_follow():
            raise JaxpodError(f"Operation {type(op).__name__} may not be sent behind "
                              "the ones unread; receive their replies first.")
        if self._void is not None:
            raise self._void
        budget = AHEAD_BYTES - sum(s.nbytes for s in self._sent) if self._sent else None
        sent = self._group._send(op, drops, self._limit, ahead=True, max_bytes=budget)
        if sent is None:
            return None
        self._sent.append(sent)
        return sent.first_id

    def receive(self) -> list[Any]:
        """The oldest unread operation's result per host, or its error. After a reset
        or a lost host, the ones sent behind it raise without having run."""
        sent = self._sent.popleft()
        if self._void is not None:
            raise self._void
        try:
            return self._group._finish(sent)
        except (SliceResetError, WorkerLostError, OperationTimeoutError) as e:
            # The workers the rest was sent to are gone; new ones take nothing more
            # from this pipeline (their set-up comes first).
            kind = SliceResetError if isinstance(e, SliceResetError) else type(e)
            self._void = kind(f"Not run: the slice's workers were lost while it waited "
                              f"behind operation {sent.name} ({e}).")
            raise

    def drain(self) -> None:
        """Reads the replies still unread, dropping them (their errors too)."""
        while self._sent:
            with contextlib.suppress(Exception):
                self.receive()


def undigest(replies: list[Any], name: str) -> list[Any]:
    """Each host's result from its reply to operation ``name``: a host's
    :class:`Digest` that matches the first host's :class:`Digested` stands for the
    same result (the same object); one that does not is a :class:`DivergedError`.
    Where the first host failed, the others' digests stay: nothing is there to
    compare them with, and a uniform operation that failed on some hosts only
    restarts the slice."""
    first = replies[0] if replies else None
    if not isinstance(first, Digested):
        return replies
    results: list[Any] = [first.result]
    for host, reply in enumerate(replies[1:], start=1):
        if not isinstance(reply, Digest):
            results.append(reply)
        elif first.digest is not None and reply.digest == first.digest:
            results.append(first.result)
        else:
            results.append(RemoteError.of(DivergedError(
                f"Host {host}'s result of operation {name} differs from host 0's: the "
                "hosts are out of lockstep. A step function whose outputs (their tree, "
                "shapes or dtypes) depend on the host, e.g. on jax.process_index(), "
                "causes this; make them the same on every host."), ""))
    return results


def _host_error(results: list[Any], failed: list[int], name: str) -> BaseException:
    """The first failed host's exception (user exceptions keep their type), with its
    remote traceback and which hosts failed attached as notes. Hosts that stopped only
    because another host failed (``PeerHostError``) are not the ones to report."""
    own = [h for h in failed if not isinstance(results[h].error, PeerHostError)]
    failed = own or failed
    remote: RemoteError = results[failed[0]]
    error = remote.error
    if remote.traceback:
        error.add_note(f"Remote traceback (host {failed[0]}):\n{remote.traceback}")
    if len(results) > 1:
        where = (f"Operation {name} failed on host(s) {failed} of {len(results)}; it "
                 "took effect on no host.")
        error.add_note(where)
        # The coordinator forwards the worker's pickle and traceback: say it there too.
        remote = dataclasses.replace(remote, traceback=f"{remote.traceback}\n{where}")
    with contextlib.suppress(AttributeError):  # for the coordinator to forward
        error.jaxpod_remote = remote  # type: ignore[attr-defined]
    return error


class DropSource(Protocol):
    """Where a caller's dropped handles wait for its next operation."""

    def take(self) -> Dropped | None: ...

    def restore(self, dropped: Dropped) -> None: ...


def _launch(recipe: _Recipe) -> tuple[list[Any], list[dict[str, int]], list[socket.socket]]:
    """Starts the recipe's workers and connects to them: workers, info, channels."""
    placements, launcher = recipe.placements, recipe.launcher
    limit = START_TIMEOUT.resolve(recipe.start_timeout_s)
    deadline = time.monotonic() + limit
    workers: list[Any] = []
    channels: list[socket.socket] = []
    try:
        workers = launcher.start(placements, recipe.devices_per_host, recipe.platform)

        def on_all(method: str, *args: Any, what: str) -> list[Any]:
            return launcher.call(workers, method, [args] * len(workers), deadline, what,
                                 limit)

        first = workers[:1]
        (address,) = launcher.call(first, "node_address", [()], deadline, "start", limit)
        (port,) = launcher.call(first, "reserve_port", [()], deadline, "start", limit)
        info = on_all("initialize", f"{address}:{port}",
                      max(1.0, deadline - time.monotonic()),
                      what="join the jax.distributed group")
        key = channel.new_key()
        for where in on_all("open_channel", key, what="open their operation channel"):
            channels.append(channel.connect(
                where, key, max(1.0, deadline - time.monotonic())))
    except BaseException as e:
        for sock in channels:
            sock.close()
        launcher.kill(workers)
        if isinstance(e, WorkerStartError):
            raise
        raise WorkerStartError(
            f"The {len(placements)} host workers did not start within {limit:g}s "
            f"({START_TIMEOUT.env_var}): {type(e).__name__}: {e}"
        ) from e
    return workers, info, channels
