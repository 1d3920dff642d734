"""Sessions: who owns which slice, value, dataset and uploaded tensor.

Every object the coordinator holds for a client belongs to exactly one session and is
reachable only through it, so one client can never name another's values. A session
lives as long as its client heartbeats (any call counts); the reaper closes sessions
whose lease ran out, which releases their slices and so their device memory.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxpod.errors import (
    DeadlineExceededError,
    DependencyFailedError,
    HandleError,
    PermissionDeniedError,
    SessionError,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto.tensors import op_of
from jaxpod.service.group_engine import GroupDataset, GroupEngine, GroupIterator, GroupValue
from jaxpod.service.profiles import SliceProfiler
from jaxpod.service.tokens import LOCAL, Principal
from jaxpod.timeouts import Timeout

#: How long a session survives without hearing from its client.
SESSION_LEASE = Timeout("JAXPOD_SESSION_LEASE_S", 30.0)
#: How long a call that follows a stream operation waits for a stream to bring it.
STREAM_JOIN_GRACE = Timeout("JAXPOD_STREAM_JOIN_GRACE_S", 5.0)
#: Failed operations a slice remembers, to say why a later one using their outputs
#: was not run.
MAX_FAILED_OPS = 4096


@dataclass(eq=False)
class HeldSlice:
    """One acquired slice: its allocation, replica group and the objects on it.

    Attributes:
      id: the slice's id within the service.
      engine: the strategy methods over the slice's replica group.
      release: stops the workers and gives the slice back (idempotent).
      description: accelerator type, hosts and slice names, for status replies.
    """

    id: str
    engine: GroupEngine
    release: Callable[[], None]
    description: dict[str, Any]
    values: dict[int, GroupValue] = field(default_factory=dict)
    datasets: dict[int, GroupDataset] = field(default_factory=dict)
    iterators: dict[int, GroupIterator] = field(default_factory=dict)
    #: Numbers of the stream's operations that failed (their outputs never existed),
    #: the most recent ``MAX_FAILED_OPS``.
    failed_ops: collections.OrderedDict[int, None] = field(
        default_factory=collections.OrderedDict)
    #: The stream's progress: the last operation received and applied, and the
    #: streams open; ``progress`` is notified as they change.
    received_op: int = 0
    applied_op: int = 0
    open_streams: int = 0
    progress: threading.Condition = field(default_factory=threading.Condition)
    #: Its ``strategy.profile`` traces (made on the first).
    profiler: SliceProfiler | None = None

    def wait_applied(self, op: int, timeout_s: float) -> None:
        """Waits until the stream has applied operation ``op``.

        Raises:
          HandleError: ``op`` never reached the service and no stream is open to bring it.
          DeadlineExceededError: it did not apply within ``timeout_s``.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        with self.progress:
            while self.applied_op < op:
                # A stream's first message may arrive after the call that follows it.
                if self.received_op < op and self.open_streams == 0 and \
                        time.monotonic() - start > STREAM_JOIN_GRACE.seconds():
                    raise HandleError(
                        f"Operation #{op} on slice {self.id} never reached the service "
                        "(its stream ended first), so this call cannot follow it. Call "
                        "again.")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(
                        f"Operation #{op} on slice {self.id} was not applied within "
                        f"{timeout_s:g}s; this call waits for it.")
                self.progress.wait(min(left, 0.5) if self.open_streams == 0 else left)

    def advanced(self, *, received: int = 0, applied: int = 0, streams: int = 0) -> None:
        with self.progress:
            self.received_op = max(self.received_op, received)
            self.applied_op = max(self.applied_op, applied)
            self.open_streams += streams
            self.progress.notify_all()

    def value(self, value_id: int) -> GroupValue:
        try:
            return self.values[value_id]
        except KeyError:
            op = op_of(value_id)
            if op in self.failed_ops:
                raise DependencyFailedError(
                    f"Not run: it uses value #{value_id}, an output of operation #{op} "
                    "on this slice, which failed.", op) from None
        return _lookup(self.values, value_id, "Value", self.id,
                       " Use values returned by this strategy while it is open.")

    def failed(self, op: int) -> None:
        self.failed_ops[op] = None
        if len(self.failed_ops) > MAX_FAILED_OPS:
            self.failed_ops.popitem(last=False)

    def dataset(self, dataset_id: int) -> GroupDataset:
        return _lookup(self.datasets, dataset_id, "Dataset", self.id)

    def iterator(self, iterator_id: int) -> GroupIterator:
        return _lookup(self.iterators, iterator_id, "Iterator", self.id)

    def keep_values(self, values: dict[int, GroupValue]) -> None:
        """Keeps new values by the ids the client gave them; an id in use is refused
        before any is kept."""
        self.check_new_ids(values.keys())
        self.values.update(values)

    def check_new_ids(self, ids: Iterable[int]) -> None:
        """Refuses ids for new values that name values already held."""
        taken = self.values.keys() & set(ids)
        if taken:
            raise HandleError(f"Value ids {sorted(taken)[:5]} are already in use on slice "
                              f"{self.id}: each operation number may be used once.")

    def drop(self, dropped: pb.Dropped) -> None:
        """Forgets what the client dropped; the workers free it with the slice's next
        operation. Unknown ids are ignored: dropping is idempotent."""
        for value_id in dropped.value_ids:
            self.values.pop(value_id, None)
        for iterator_id in dropped.iterator_ids:
            self.iterators.pop(iterator_id, None)
        for dataset_id in dropped.dataset_ids:
            dataset = self.datasets.pop(dataset_id, None)
            if dataset is not None:
                dataset.free()


def _lookup(table: dict[int, Any], key: int, what: str, slice_id: str,
            advice: str = "") -> Any:
    try:
        return table[key]
    except KeyError:
        raise HandleError(f"{what} #{key} is not held on slice {slice_id}: it was freed, or "
                          f"it belongs to another strategy.{advice}") from None


class Session:
    """One client's slices and uploads; every access renews its lease."""

    def __init__(self, session_id: str, lease_s: float, owner: str = LOCAL.name) -> None:
        self.id = session_id
        self.lease_s = lease_s
        self.owner = owner  # the name of the token that opened it
        self.slices: dict[str, HeldSlice] = {}
        self.blobs: dict[int, np.ndarray] = {}
        self.closed = False
        self._deadline = time.monotonic() + lease_s
        self._lock = threading.Lock()
        self._blob_ids = itertools.count(1)

    def touch(self) -> None:
        self._deadline = time.monotonic() + self.lease_s

    def expired(self, now: float) -> bool:
        return now > self._deadline

    def slice(self, slice_id: str) -> HeldSlice:
        try:
            return self.slices[slice_id]
        except KeyError:
            raise HandleError(
                f"Slice {slice_id!r} is not held by this session: it was released, or it "
                "belongs to another client.") from None

    def add_slice(self, held: HeldSlice) -> None:
        """Raises ``SessionError`` if the session closed meanwhile (the caller then
        releases ``held``: releasing blocks, and must not under this lock)."""
        with self._lock:
            if self.closed:
                raise SessionError(f"Session {self.id} closed while its slice was starting.")
            self.slices[held.id] = held

    def pop_slice(self, slice_id: str) -> HeldSlice:
        with self._lock:
            held = self.slice(slice_id)
            del self.slices[slice_id]
            return held

    def add_blob(self, array: np.ndarray) -> int:
        blob = next(self._blob_ids)
        self.blobs[blob] = array
        return blob

    def blob(self, blob: int) -> np.ndarray:
        try:
            return self.blobs[blob]
        except KeyError:
            raise HandleError(f"Uploaded tensor #{blob} is not held by this session; upload "
                              "it again.") from None

    def close(self) -> list[HeldSlice]:
        """Marks the session closed; returns the slices the caller must release."""
        with self._lock:
            self.closed = True
            slices = list(self.slices.values())
            self.slices.clear()
            self.blobs.clear()
            return slices


class SessionManager:
    """Opens, finds and reaps sessions."""

    def __init__(self, lease_s: float | None = None) -> None:
        self.default_lease_s = SESSION_LEASE.resolve(lease_s)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, lease_s: float = 0.0, owner: str = LOCAL.name) -> Session:
        if lease_s < 0:
            raise ValueError(f"lease_s must be >= 0 (0: the service default). Got {lease_s}.")
        session = Session(secrets.token_hex(16), lease_s or self.default_lease_s, owner)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise SessionError(
                f"Session {session_id!r} is not open on this service: it was closed, its "
                "lease expired (no heartbeat), or the service restarted. Connect again.")
        session.touch()
        return session

    def check_owner(self, session_id: str, caller: Principal) -> None:
        """Raises :class:`PermissionDeniedError` if the session is open and ``caller``
        neither opened it nor is an admin (an unknown id is left to :meth:`get`)."""
        session = self._sessions.get(session_id)
        if session is not None and not caller.owns(session.owner):
            raise PermissionDeniedError(
                f"Session {session_id!r} was opened by another token; the token "
                f"{caller.name!r} ({caller.role}) may use only the sessions it opened. "
                "Open your own with jaxpod.connect().")

    def close(self, session_id: str) -> list[HeldSlice]:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        return session.close() if session else []

    def expired(self) -> list[str]:
        now = time.monotonic()
        return [s.id for s in list(self._sessions.values()) if s.expired(now)]

    def all(self) -> list[Session]:
        return list(self._sessions.values())
