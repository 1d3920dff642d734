"""Watchers of jobs: each job's version, bumped by every change, and the asyncio
waiters of the RPC loop that a change wakes (``job.watch()``, the dashboard's event
streams)."""

from __future__ import annotations

import asyncio
import collections
import threading

from jaxpod.service.jobs.controller import StateChange


class JobEvents:
    """Tells watchers (asyncio tasks on the RPC loop) that a job changed.

    Each job has a version that every change bumps; a watcher reads the job, then
    waits for a version newer than the one it read, so no change is missed between
    reading and waiting. A controller callback: every state change is a change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: collections.Counter[str] = collections.Counter()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def version(self, job_id: str) -> int:
        with self._lock:
            return self._versions[job_id]

    def changed(self, job_id: str) -> None:
        with self._lock:
            self._versions[job_id] += 1
            waiters = self._waiters.pop(job_id, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future)

    def after_state_change(self, change: StateChange) -> None:
        self.changed(change.job_id)

    async def wait(self, job_id: str, version: int, timeout: float) -> None:
        """Returns once the job's version is past ``version``, or after ``timeout``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._versions[job_id] != version:
                return
            self._waiters.setdefault(job_id, []).append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            with self._lock:
                waiters = self._waiters.get(job_id, [])
                if (loop, future) in waiters:
                    waiters.remove((loop, future))


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
