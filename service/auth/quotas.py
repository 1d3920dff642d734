"""Slice quotas: a token's ``max_slices`` caps the slices its strategies and jobs hold at
once (DESIGN §6, §9).

A strategy over its owner's quota is refused (:class:`~jaxpod.errors.QuotaExceededError`);
a job over it stays queued, its status saying why, and starts once the owner holds
fewer. Checks and the commitments they allow happen under one lock, so two requests of
one owner cannot both pass on the same free room.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from jaxpod.errors import QuotaExceededError
from jaxpod.service.auth.tokens import TokenBook


class SliceHolders(Protocol):
    """What holds slices for their owners (the service's sessions)."""

    def slices_of(self, owner: str) -> int:
        """How many slices ``owner``'s holders hold now."""
        ...


class SliceQuotas:
    """Counts each owner's slices (its sessions', its running jobs', and those being
    acquired) against its token's ``max_slices``."""

    def __init__(self, tokens: TokenBook | None, sessions: SliceHolders) -> None:
        self._tokens = tokens
        self._sessions = sessions
        self._job_slices: Callable[[str], int] = lambda owner: 0
        self._pending: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def count_jobs_with(self, job_slices: Callable[[str], int]) -> None:
        """How many slices an owner's started jobs hold (the job manager's count)."""
        self._job_slices = job_slices

    def limit(self, owner: str) -> int | None:
        who = self._tokens.principal(owner) if self._tokens is not None else None
        return who.max_slices if who is not None else None

    def held(self, owner: str) -> int:
        """The slices ``owner``'s strategies and jobs hold or are acquiring now."""
        return (self._sessions.slices_of(owner) + self._job_slices(owner)
                + self._pending[owner])

    def check_fits(self, owner: str, wanted: int, what: str) -> None:
        """Refuses what could never run: more slices than the owner's whole quota.

        Raises:
          QuotaExceededError: ``wanted`` is over ``owner``'s ``max_slices``.
        """
        limit = self.limit(owner)
        if limit is not None and wanted > limit:
            raise QuotaExceededError(
                f"{what}: it needs {wanted} slice(s), over the max_slices {limit} of the "
                f"token {owner!r}, so it could never run. Ask fewer slices, or an admin of "
                "this service for a larger max_slices.")

    def over(self, owner: str, wanted: int) -> str | None:
        """Why ``owner`` may not take ``wanted`` more slices now (``None``: it may)."""
        limit = self.limit(owner)
        if limit is None:
            return None
        held = self.held(owner)
        if held + wanted <= limit:
            return None
        return (f"the token {owner!r} holds {held} slice(s) of its max_slices {limit} and "
                f"this needs {wanted} more")

    @contextlib.contextmanager
    def reserve(self, owner: str, wanted: int, what: str) -> Iterator[None]:
        """Holds room for ``wanted`` slices while ``what`` acquires them.

        Raises:
          QuotaExceededError: ``owner`` has no room for them.
        """
        with self._lock:
            why = self.over(owner, wanted)
            if why is not None:
                raise QuotaExceededError(
                    f"{what}: {why}. Close a strategy or cancel a job of this token first, "
                    "or ask an admin of this service for a larger max_slices.")
            self._pending[owner] += wanted
        try:
            yield
        finally:
            with self._lock:
                self._pending[owner] -= wanted

    def admit(self, owner: str, wanted: int, start: Callable[[], None]) -> str | None:
        """Runs ``start`` (a job taking ``wanted`` slices) if ``owner`` has room, under
        the lock; returns why not otherwise."""
        with self._lock:
            why = self.over(owner, wanted)
            if why is None:
                start()
            return why
