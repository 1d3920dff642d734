"""How long a host worker spent running operations, for its stats (``busy_s``).

The union of the operations' intervals, nothing more: a computation an operation
dispatched and did not wait for counts in the operation that next waits for it (a
fetch, a reduce), not while the devices run it unobserved. Watching each operation's
outputs until they were ready took a thread woken on every step, on the step path, for
a figure only benchmarks read; they measure the devices from outside now.

What it holds is bounded: a total and at most ``MAX_SEGMENTS`` disjoint segments.
"""

from __future__ import annotations

import bisect
import threading

#: Disjoint busy segments kept, so that intervals added out of order still merge; older
#: ones are summed into a total (a worker's operations arrive in order).
MAX_SEGMENTS = 64


class BusyClock:
    """The union of the intervals a worker was busy, in seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: list[tuple[float, float]] = []  # sorted, disjoint
        self._folded_s = 0.0  # length of the segments summed away
        self._horizon = float("-inf")  # where the summed segments end

    def add(self, start: float, end: float) -> None:
        """Counts ``[start, end]`` (``time.perf_counter`` readings)."""
        with self._lock:
            start = max(start, self._horizon)
            _merge_into(self._segments, (start, max(start, end)))
            while len(self._segments) > MAX_SEGMENTS:
                a, b = self._segments.pop(0)
                self._folded_s += b - a
                self._horizon = b

    def seconds(self) -> float:
        """Busy time so far."""
        with self._lock:
            return self._folded_s + sum(b - a for a, b in self._segments)

    def segments(self) -> int:
        """How many segments the clock keeps, to check that it stays bounded."""
        with self._lock:
            return len(self._segments)


def _merge_into(segments: list[tuple[float, float]], interval: tuple[float, float]) -> None:
    """Adds ``interval`` to the sorted disjoint ``segments``, merging those it touches."""
    a, b = interval
    if b <= a:
        return
    i = bisect.bisect_left(segments, (a, a))
    if i > 0 and segments[i - 1][1] >= a:  # the one before reaches into it
        i -= 1
        a = segments[i][0]
    j = i
    while j < len(segments) and segments[j][0] <= b:
        b = max(b, segments[j][1])
        j += 1
    segments[i:j] = [(a, b)]
