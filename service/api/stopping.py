"""Open calls that wait on their client or on time end when the service stops.

``grpc.aio.Server.stop(grace)`` lets every open call run until the grace is over. Calls
doing work finish in it; but an operation stream between its client's batches and a
job watch between the job's changes wait on their client or on time, not on work, and
each held a stopping service for its whole grace (30 s after the last call in flight
had finished, in the graceful-shutdown test). Such a call awaits through
:meth:`Stopping.next`; at :meth:`Stopping.stop` the waits in progress are cancelled and
end their calls with :class:`ServiceUnavailableError` (``UNAVAILABLE``), which clients
treat as a service going away: a job watch re-opens on the restarted service, and an
operation stream's unanswered operations fail at the client's next synchronising call.
A call busy with work when the service stops finishes it, and ends at its next wait.

A call that waits in a worker thread (an acquire waiting for a slice another session
holds, or for one being prewarmed) runs through :meth:`Stopping.during` with a
:class:`Cancel`, which the stop sets: the wait gives up at once and the call ends as
above.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from jaxpod.errors import AllocationCancelledError, ServiceUnavailableError
from jaxpod.timeouts import Cancel

_T = TypeVar("_T")


class Stopping:
    """The service's stop, as the open calls waiting on their clients see it (one event
    loop uses it)."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[Any]] = set()
        self._cancels: set[Cancel] = set()
        self._stopped = False

    async def next(self, items: AsyncIterator[_T], what: str) -> _T | None:
        """``items``' next item (``None`` once it ends), awaited by the current task.

        Raises:
          ServiceUnavailableError: the service is stopping (also when it began to stop
            during the wait); ``what`` names the call.
        """
        if self._stopped:
            raise _stopped(what)
        task = asyncio.current_task()
        assert task is not None, "Stopping.next runs in a task"
        self._waiting.add(task)
        try:
            return await anext(items, None)
        except asyncio.CancelledError:
            if not self._stopped:  # the call was cancelled, as by its client
                raise
            task.uncancel()
            raise _stopped(what) from None
        finally:
            self._waiting.discard(task)

    async def during(self, call: Callable[[Cancel], Awaitable[_T]], what: str) -> _T:
        """What ``call`` returns: it waits in a worker thread, and gives up when its
        :class:`Cancel` is set, raising ``AllocationCancelledError``.

        Raises:
          ServiceUnavailableError: the service is stopping (``call`` then gave up, or
            was not made); ``what`` names the call.
        """
        if self._stopped:
            raise _stopped(what)
        cancel = Cancel()
        self._cancels.add(cancel)
        try:
            return await call(cancel)
        except AllocationCancelledError:
            if not self._stopped:
                raise
            raise _stopped(what) from None
        finally:
            self._cancels.discard(cancel)

    def stop(self) -> None:
        """Ends the calls waiting in :meth:`next` or :meth:`during` now, and every later
        wait at once."""
        self._stopped = True
        for task in self._waiting:
            task.cancel()
        for cancel in self._cancels:
            cancel.set()


def _stopped(what: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"{what}: the service is stopping; what this call carried that had not started "
        "was not run. Reconnect once the service is back.")
