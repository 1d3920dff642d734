"""Goodput: where a job's wall time went, partitioned into categories.

A :class:`GoodputClock` is always in exactly one category. :meth:`~GoodputClock.switch`
closes the running interval into the current category and opens one in the next, so the
categories partition the time since the clock started with no gap and no overlap. Time is
kept in integer nanoseconds: the per-category totals add up to the wall time exactly (the
sum telescopes), whatever the number of switches.

Some of an interval's time is only known to belong elsewhere once it is over (a loop
measured as a whole, of which the first call traced and compiled, or whose first steps
re-did work lost in a preemption): :meth:`~GoodputClock.reattribute` moves that part
between categories, keeping the sum.

The totals are stored with the job (:meth:`JobStore.set_goodput
<jaxpod.service.jobs.store.JobStore.set_goodput>`); a coordinator restarted on the same
state dir rebuilds the clock from them (:meth:`GoodputClock.from_totals`), and the time it
was down, like anything after the last stored totals, goes to ``recovering``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

#: Waiting in the queue for a free slice (PENDING).
QUEUED = "queued"
#: Acquiring a slice, including starting its workers on a cold slice (ALLOCATING).
ALLOCATING = "allocating"
#: On the slice, before the first step: defining functions, building state and input.
SETUP = "setup"
#: A resumed attempt restoring its state and input positions from its checkpoint.
RESTORING = "restoring"
#: The extra time of a loop that traced and compiled, beyond its steady-state time.
COMPILING = "compiling"
#: Steps run for the first time: the goodput proper.
PRODUCTIVE = "productive"
#: Steps waiting on their input: the longest wait of any host of the slice (the others
#: wait for it in the step's collectives), as the hosts measure it.
INPUT_WAIT = "input_wait"
#: Reducing the declared outputs after each loop and recording them as metrics (the
#: slice waits meanwhile).
METRICS = "metrics"
#: Reading the hosts' logs, input figures and preemption notices between loops.
MONITORING = "monitoring"
#: Time steps waited on a checkpoint save (its bytes leaving the devices).
CHECKPOINTING = "checkpointing"
#: Writing the final state's checkpoint until it is committed, storing the outputs.
RESULT = "result"
#: Steps run again after a preemption because their results were lost.
LOST_WORK = "lost_work"
#: An elastic job's move to another slice type: the setup, restoring and compiling of
#: the first attempt on the new type (elastic resizing, as ml-goodput-measurement
#: calls it), kept apart from the same costs of resuming on the same type.
RESIZING = "resizing"
#: Between an attempt's end and the next attempt's allocation (RETRYING, back-off), and
#: the time a coordinator was down.
RECOVERING = "recovering"
#: Suspended by a user (SUSPENDED), off its slice until resumed.
SUSPENDED = "suspended"
#: Anything not above (nothing the runner does on purpose).
OTHER = "other"

#: Every category, in the order a job's life meets them.
CATEGORIES: tuple[str, ...] = (QUEUED, ALLOCATING, SETUP, RESTORING, COMPILING, PRODUCTIVE,
                               INPUT_WAIT, METRICS, MONITORING, CHECKPOINTING, RESULT,
                               LOST_WORK, RESIZING, RECOVERING, SUSPENDED, OTHER)

#: The keys :func:`summary` adds to the totals (never categories).
WALL_S = "wall_s"
PRODUCTIVE_SHARE = "productive_share"

_NS = 1_000_000_000


def _ns(seconds: float) -> int:
    return round(seconds * _NS)


def _check_category(category: str) -> str:
    if category not in CATEGORIES:
        raise ValueError(f"Unknown goodput category {category!r}; expected one of "
                         f"{', '.join(CATEGORIES)}.")
    return category


def _check_seconds(category: str, seconds: float) -> float:
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Goodput seconds must be finite and >= 0; got {seconds!r} "
                         f"for {category!r}.")
    return value


class GoodputClock:
    """A job's wall time, partitioned into :data:`CATEGORIES`. Thread-safe.

    Args:
      category: the category the clock starts in (a new job is :data:`QUEUED`).
      clock: seconds from an arbitrary origin (``time.monotonic``; tests inject a fake).
    """

    def __init__(self, category: str = QUEUED, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._category = _check_category(category)
        self._since = _ns(clock())
        self._stopped = False

    @classmethod
    def from_totals(cls, totals: Mapping[str, float], *, wall_s: float | None = None,
                    category: str = RECOVERING,
                    clock: Callable[[], float] = time.monotonic) -> GoodputClock:
        """A clock that goes on from stored ``totals`` (seconds by category), now in
        ``category``.

        ``wall_s`` is the job's wall time up to now (for example ``time.time() -
        created_at``); what it has beyond the stored totals (the time a coordinator was
        down, and what it did not store before it went) goes to :data:`RECOVERING`, so
        the totals go on adding up to the job's wall time. The :func:`summary` keys in
        ``totals`` are ignored; unknown categories are refused.
        """
        clock_ = cls(category, clock=clock)
        for name, seconds in totals.items():
            if name in (WALL_S, PRODUCTIVE_SHARE):
                continue
            clock_._totals[_check_category(name)] = _ns(_check_seconds(name, seconds))
        if wall_s is not None:
            missing = _ns(_check_seconds(WALL_S, wall_s)) - sum(clock_._totals.values())
            clock_._totals[RECOVERING] += max(0, missing)
        return clock_

    @property
    def category(self) -> str:
        """The category the running interval goes to."""
        with self._lock:
            return self._category

    def switch(self, category: str) -> str:
        """Close the running interval into the current category and start counting
        ``category``; returns the category it left (switching to the same one is a
        no-op as far as the totals go)."""
        _check_category(category)
        with self._lock:
            self._check_running()
            self._close(_ns(self._clock()))
            previous, self._category = self._category, category
            return previous

    def stop(self) -> dict[str, float]:
        """Close the running interval for good (the job is over) and return the final
        :meth:`totals`; they stay as they are from then on. Stopping again is a no-op."""
        with self._lock:
            if not self._stopped:
                self._close(_ns(self._clock()))
                self._stopped = True
        return self.totals()

    @property
    def stopped(self) -> bool:
        with self._lock:
            return self._stopped

    @contextmanager
    def during(self, category: str) -> Iterator[None]:
        """Count the ``with`` block as ``category``, then go back to the category before
        it (also when the block raises)."""
        previous = self.switch(category)
        try:
            yield
        finally:
            self.switch(previous)

    def reattribute(self, parts: Mapping[str, float], *, source: str | None = None
                    ) -> dict[str, float]:
        """Move seconds out of ``source`` (default: the current category, its running
        interval included) into other categories, atomically; the sum stays the same.

        ``parts`` maps each target category to the seconds it takes, such as
        ``{COMPILING: loop_s - steps * steady_step_s}`` after a loop that compiled, or
        ``{LOST_WORK: redone_steps * step_s}`` after one that re-ran lost steps. When
        ``source`` holds less than asked, every part is scaled down alike (no category
        ever goes negative). Returns the seconds moved to each target.
        """
        wanted = {_check_category(to): _ns(_check_seconds(to, s)) for to, s in parts.items()}
        with self._lock:
            src = self._category if source is None else _check_category(source)
            if src == self._category and not self._stopped:
                self._close(_ns(self._clock()))
            asked = sum(n for to, n in wanted.items() if to != src)
            scale = 1.0 if asked <= self._totals[src] else self._totals[src] / asked
            moved: dict[str, float] = {}
            for to, n in wanted.items():
                n = 0 if to == src else min(math.floor(n * scale), self._totals[src])
                self._totals[src] -= n
                self._totals[to] += n
                moved[to] = n / _NS
            return moved

    def totals(self, now: float | None = None) -> dict[str, float]:
        """Seconds by category (every one of :data:`CATEGORIES`), the running interval
        included up to ``now`` (a reading of the clock; default: the clock now)."""
        with self._lock:
            at = _ns(self._clock() if now is None else now)
            totals = dict(self._totals)
            totals[self._category] += self._running(at)
        return {name: n / _NS for name, n in totals.items()}

    def wall_s(self, now: float | None = None) -> float:
        """The wall time the clock accounts for: the sum of :meth:`totals`, exactly as
        kept (integer nanoseconds)."""
        with self._lock:
            at = _ns(self._clock() if now is None else now)
            return (sum(self._totals.values()) + self._running(at)) / _NS

    def _running(self, at: int) -> int:
        # Under the lock: the running interval's nanoseconds up to ``at``.
        return 0 if self._stopped else max(0, at - self._since)

    def _check_running(self) -> None:
        if self._stopped:
            raise RuntimeError("This GoodputClock was stopped (its job is over); build "
                               "another with GoodputClock.from_totals to count on.")

    def _close(self, at: int) -> None:
        # Under the lock. A clock reading earlier than the last one adds nothing.
        if at > self._since:
            self._totals[self._category] += at - self._since
            self._since = at


def summary(totals: Mapping[str, float]) -> dict[str, float]:
    """``totals`` (seconds by category) plus :data:`WALL_S` (their sum) and
    :data:`PRODUCTIVE_SHARE` (productive / wall; 0 for no wall time): what a job's
    status reports."""
    seconds = {name: float(s) for name, s in totals.items()
               if name not in (WALL_S, PRODUCTIVE_SHARE)}
    wall = math.fsum(seconds.values())
    share = seconds.get(PRODUCTIVE, 0.0) / wall if wall > 0 else 0.0
    return {**seconds, WALL_S: wall, PRODUCTIVE_SHARE: share}
