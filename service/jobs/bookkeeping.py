"""What every state change of a job updates besides its watchers: the store (its
state, attempts and result), the job's goodput clock and, once a fork has finished, the
pin on its source's checkpoint. Each is a controller callback
(:class:`~jaxpod.service.jobs.controller.StateCallback`): nothing else writes a job's
state."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from jaxpod.jobs import JobState
from jaxpod.service.jobs import goodput
from jaxpod.service.jobs.checkpoints import ForkPins
from jaxpod.service.jobs.controller import StateChange
from jaxpod.service.jobs.goodput import GoodputClock
from jaxpod.service.jobs.states import Succeeded
from jaxpod.service.jobs.store import JobStore

logger = logging.getLogger(__name__)

#: How often, at most, a running job's goodput totals are written to the store.
GOODPUT_SAVE_EVERY_S = 1.0


@dataclass(frozen=True)
class StoreWriter:
    """Writes every state change to the store: a finished job's outputs first, then
    the attempt that ended, then the state (so a SUCCEEDED job always has a result)."""

    store: JobStore

    def after_state_change(self, change: StateChange) -> None:
        new, store = change.new, self.store
        if isinstance(new, Succeeded):  # its state is its last checkpoint
            store.save_result(change.job_id, new.result.outputs)
        if change.ended is not None:
            ended = change.ended
            store.end_attempt(change.job_id, ended.number, cause=ended.cause,
                              step_reached=ended.step_reached)
        if new is not None:
            store.transition(change.job_id, new, change.reason)
            if new.state.is_terminal:
                logger.info("job %s %s", change.job_id, new.state.value)


@dataclass(frozen=True)
class ForkPinRelease:
    """Lets a source's clean-up have the checkpoint a fork started from again once the
    fork has finished (:class:`~jaxpod.service.jobs.checkpoints.ForkPins`)."""

    store: JobStore
    pins: ForkPins

    def after_state_change(self, change: StateChange) -> None:
        if change.new is not None and change.new.state.is_terminal:
            self.finished(change.job_id)

    def finished(self, job_id: str) -> None:
        """``job_id`` has finished (also one cancelled in the queue)."""
        origin = self.store.fork_origin(job_id)
        if origin is not None:
            try:
                self.pins.unpin(origin[0], job_id)
            except Exception as e:  # the step stays until retention prunes the source
                logger.warning("job %s: cannot release its source's checkpoint %s/%d "
                               "(%s: %s)", job_id, origin[0], origin[1], type(e).__name__, e)


#: The goodput category each state starts (``RUNNING``'s runner switches within it).
_STATE_CATEGORIES: Mapping[JobState, str] = {
    JobState.ALLOCATING: goodput.ALLOCATING, JobState.RUNNING: goodput.SETUP,
    JobState.RETRYING: goodput.RECOVERING, JobState.PENDING: goodput.QUEUED,
    JobState.SUSPENDED: goodput.SUSPENDED}


class GoodputKeeper:
    """Each unfinished job's goodput clock, on the store's clock (``time.time``), so its
    categories add up to ``finished_at - created_at``; switched by state changes and
    written to the store with each (and every second while a job runs)."""


    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._clocks: dict[str, GoodputClock] = {}
        self._saved: dict[str, float] = {}  # job -> when last written (monotonic)

    def start(self, job_id: str, totals: dict[str, float] | None = None,
              created_at: float = 0.0) -> GoodputClock:
        """A new job's clock (queued), or a recovered job's from its stored totals: the
        time the last coordinator did not record (its downtime) goes to recovering."""
        clock = (GoodputClock(goodput.QUEUED, clock=time.time) if totals is None else
                 GoodputClock.from_totals(totals, wall_s=time.time() - created_at,
                                          category=goodput.QUEUED, clock=time.time))
        self._clocks[job_id] = clock
        return clock

    def clock(self, job_id: str) -> GoodputClock:
        clock = self._clocks.get(job_id)
        if clock is None:  # not expected: a job gets one when queued
            clock = self._clocks[job_id] = GoodputClock(goodput.OTHER, clock=time.time)
        return clock

    def totals(self, job_id: str) -> dict[str, float] | None:
        """The live totals of an unfinished job (``None``: it has no clock here)."""
        clock = self._clocks.get(job_id)
        return clock.totals() if clock is not None else None

    def after_state_change(self, change: StateChange) -> None:
        new = change.new
        if new is not None and new.state.is_terminal:
            self.stop(change.job_id)
            return
        category = _STATE_CATEGORIES.get(new.state) if new is not None else None
        if category is not None:
            self.clock(change.job_id).switch(category)
        self.save(change.job_id)

    def progressed(self, job_id: str) -> None:
        """A loop was recorded: the totals are written at most every second."""
        now = time.monotonic()
        if now - self._saved.get(job_id, 0.0) >= GOODPUT_SAVE_EVERY_S:
            self.save(job_id)
            self._saved[job_id] = now

    def save(self, job_id: str) -> None:
        with contextlib.suppress(Exception):  # accounting must never fail a job
            self._store.set_goodput(job_id, self.clock(job_id).totals())

    def stop(self, job_id: str) -> None:
        self._saved.pop(job_id, None)
        clock = self._clocks.pop(job_id, None)
        if clock is not None:
            with contextlib.suppress(Exception):
                self._store.set_goodput(job_id, clock.stop())
