"""``Stopping``: calls waiting on their clients end when the service stops; a call busy
with work finishes it first. (The service end to end: the graceful-shutdown test in
``test_coordinator.py``.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from jaxpod.errors import AllocationCancelledError, ServiceUnavailableError
from jaxpod.service.api.stopping import Stopping
from jaxpod.timeouts import Cancel

#: Generous: each wait below ends at once, or the behaviour is broken.
DEADLINE_S = 30.0


async def _items(queue: asyncio.Queue[int | None], asked: asyncio.Event | None = None
                 ) -> AsyncIterator[int]:
    """The client's messages; ``asked`` is set once a reader waits for one."""
    while True:
        if asked is not None:
            asked.set()
        if (item := await queue.get()) is None:
            return
        yield item


async def _serve(stopping: Stopping, queue: asyncio.Queue[int | None], done: list[int],
                 working: asyncio.Event, finish: asyncio.Event) -> None:
    """A stream handler: each item is work (``finish`` ends it), done in turn."""
    items = _items(queue)
    while (item := await stopping.next(items, "Test")) is not None:
        working.set()
        await finish.wait()
        done.append(item)


async def _ended(task: asyncio.Task[object]) -> None:
    """Waits for ``task`` to end by itself (``asyncio.wait_for`` would cancel it at its
    deadline, which is what ``Stopping`` turns into its error)."""
    await asyncio.wait({task}, timeout=DEADLINE_S)
    assert task.done(), "still running"


def test_a_waiting_call_ends_at_stop_and_a_busy_one_after_its_work() -> None:
    async def scenario() -> None:
        stopping = Stopping()
        idle_queue: asyncio.Queue[int | None] = asyncio.Queue()
        busy_queue: asyncio.Queue[int | None] = asyncio.Queue()
        idle_done: list[int] = []
        busy_done: list[int] = []
        finish = asyncio.Event()
        idle_working, busy_working = asyncio.Event(), asyncio.Event()
        idle = asyncio.create_task(_serve(stopping, idle_queue, idle_done, idle_working,
                                          asyncio.Event()))
        busy = asyncio.create_task(_serve(stopping, busy_queue, busy_done, busy_working,
                                          finish))
        busy_queue.put_nowait(1)
        # The busy call is in its work; the idle one waits for its client.
        await asyncio.wait_for(busy_working.wait(), DEADLINE_S)
        busy_queue.put_nowait(2)  # sent, not started: not run after the stop
        stopping.stop()
        await _ended(idle)
        with pytest.raises(ServiceUnavailableError, match="Test: the service is stopping"):
            idle.result()
        assert not busy.done()  # still working
        finish.set()
        await _ended(busy)
        with pytest.raises(ServiceUnavailableError, match="the service is stopping"):
            busy.result()
        assert busy_done == [1] and idle_done == []
        with pytest.raises(ServiceUnavailableError):  # a call opened after the stop
            await stopping.next(_items(asyncio.Queue()), "Later")

    asyncio.run(scenario())


def test_a_call_cancelled_otherwise_stays_cancelled() -> None:
    async def scenario() -> None:
        stopping = Stopping()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        asked = asyncio.Event()
        waiting = asyncio.create_task(stopping.next(_items(queue, asked), "Test"))
        await asyncio.wait_for(asked.wait(), DEADLINE_S)  # it waits inside Stopping.next
        waiting.cancel()  # as gRPC does when the client goes away
        await _ended(waiting)
        assert waiting.cancelled()
        queue.put_nowait(None)
        assert await stopping.next(_items(queue), "Test") is None  # the stream's end

    asyncio.run(scenario())


def _acquire_in_thread(cancel: Cancel, started: threading.Event) -> str:
    """Stands for an acquire waiting for a busy slice: gives up only when cancelled."""
    with cancel.waking(lambda: None):
        started.set()
        if cancel.event.wait(DEADLINE_S):
            raise AllocationCancelledError("cancelled while waiting; nothing is held")
    return "a slice"


def test_a_call_waiting_in_a_thread_gives_up_at_stop() -> None:
    async def scenario() -> None:
        stopping = Stopping()
        started = threading.Event()
        call = asyncio.create_task(stopping.during(
            lambda cancel: asyncio.to_thread(_acquire_in_thread, cancel, started),
            "AcquireSlice"))
        assert await asyncio.to_thread(started.wait, DEADLINE_S)
        stopping.stop()
        await _ended(call)
        with pytest.raises(ServiceUnavailableError, match=r"AcquireSlice: the service is "
                                                           r"stopping"):
            call.result()
        made: list[Cancel] = []

        async def never(cancel: Cancel) -> str:
            made.append(cancel)
            return "made after the stop"

        with pytest.raises(ServiceUnavailableError, match="the service is stopping"):
            await stopping.during(never, "AcquireSlice")
        assert made == []  # refused before it started

    asyncio.run(scenario())


def test_a_cancel_from_elsewhere_is_not_a_stop() -> None:
    async def scenario() -> None:
        stopping = Stopping()

        async def cancelled(cancel: Cancel) -> str:
            raise AllocationCancelledError("given up by the caller")

        with pytest.raises(AllocationCancelledError, match="given up by the caller"):
            await stopping.during(cancelled, "AcquireSlice")
        woken: list[str] = []
        cancel = Cancel()
        cancel.set()
        with cancel.waking(lambda: woken.append("at once")):  # set already: woken now
            pass
        assert woken == ["at once"]

    asyncio.run(scenario())
