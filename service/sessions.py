"""Sessions: who owns which slice, value, dataset and uploaded tensor.

Every object the coordinator holds for a client belongs to exactly one session and is
reachable only through it, so one client can never name another's values. A session
lives as long as its client heartbeats (any call counts); the reaper closes sessions
whose lease ran out, which releases their slices and so their device memory.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time

import numpy as np

from jaxpod import settings
from jaxpod.errors import (
    HandleError,
    PermissionDeniedError,
    SessionError,
)
from jaxpod.service.auth.tokens import LOCAL, Principal
from jaxpod.service.slices.held import HeldSlice

#: How long a session survives without hearing from its client.
SESSION_LEASE = settings.SESSION_LEASE
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

    def slices_of(self, owner: str) -> int:
        """How many slices ``owner``'s sessions hold now (quotas count them)."""
        return sum(held.description["num_slices"] for session in self.all()
                   if session.owner == owner for held in list(session.slices.values()))

    def all(self) -> list[Session]:
        return list(self._sessions.values())
