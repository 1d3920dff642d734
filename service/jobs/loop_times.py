"""How an attempt's loops are timed: its step rate over recent loops
(:class:`StepRate`, what a progress bar shows) and each loop's time split into first-run
steps, re-run steps and compilation, with the limit past which a loop is hung
(:class:`LoopTimes`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from jaxpod import settings
from jaxpod.service.jobs import goodput

#: How much longer than the slowest loop of its length a loop may run (then: hung).
HANG_TIMEOUT = settings.JOB_HANG_TIMEOUT


class StepRate:
    """A running attempt's steps per wall-clock second, over its loops of the last
    ``window_s`` (counted from the attempt's start until a loop is that old): what a
    progress bar shows, compilation and input waits included.

    Args:
      start_step: the step the attempt started from.
      window_s: the span of recent loops measured.
      clock: wall-clock seconds (tests inject a fake).
    """

    def __init__(self, start_step: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque(
            [(clock(), start_step)])
        self._lock = threading.Lock()

    def add(self, step: int) -> None:
        """A loop ended: ``step`` steps are done."""
        now = self._clock()
        with self._lock:
            self._samples.append((now, step))
            while len(self._samples) > 2 and self._samples[1][0] <= now - self._window_s:
                self._samples.popleft()

    def steps_per_s(self) -> float | None:
        """Steps per second over the window (``None`` before the first loop ended). A
        job whose loops stopped coming slows down by the time since the last one."""
        now = self._clock()
        with self._lock:
            (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        if s1 == s0:
            return None
        span = max(t1, now - self._window_s) - t0
        return (s1 - s0) / span if span > 0 else None


class LoopTimes:
    """Splits each loop's measured time into first-run steps, steps re-run after a
    preemption (lost work) and, for a loop that compiled, the compilation: the excess
    of the first loop of each length over the same length's steady time, known once a
    second loop of that length ran (and then moved out of what was counted productive).

    Args:
      redo_until: steps up to this one were done before and are being re-done.
    """

    def __init__(self, redo_until: int) -> None:
        self._redo_until = redo_until
        self._first: dict[int, float] = {}  # loop length -> its first loop's seconds
        self._settled: set[int] = set()
        self._slowest: dict[int, float] = {}  # loop length -> its slowest loop's seconds

    def limit(self, k: int) -> float | None:
        """How long the next loop of ``k`` steps may run before it counts as hung:
        ``JAXPOD_JOB_HANG_TIMEOUT_S`` past the slowest one so far (``None``: none ran
        yet, it compiles: the operation time-out holds)."""
        slowest = self._slowest.get(k)
        return None if slowest is None else slowest + HANG_TIMEOUT.seconds()

    def attribute(self, start: int, k: int, seconds: float) -> dict[str, float]:
        """Seconds to move out of productive for the loop of ``k`` steps from ``start``."""
        parts: dict[str, float] = {}
        self._slowest[k] = max(seconds, self._slowest.get(k, 0.0))
        redone = max(0, min(start + k, self._redo_until) - start)
        if redone:
            parts[goodput.LOST_WORK] = seconds * redone / k
        if k not in self._first:
            self._first[k] = seconds
        elif k not in self._settled:
            self._settled.add(k)
            parts[goodput.COMPILING] = max(0.0, self._first[k] - seconds)
        return parts
