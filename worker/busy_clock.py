"""How long a host worker spent working, for its stats.

JAX dispatches asynchronously: an operation such as ``run_steps`` returns once its
computation is queued, and the devices keep computing while the worker waits for its
next operation. The clock therefore counts the union of two kinds of intervals: each
operation's own, and, for operations that dispatch computations, from the operation's
start until its outputs are ready.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

#: Intervals kept before they are summed (each operation adds one).
_FOLD_AT = 1024


class BusyClock:
    """The union of the intervals a worker was busy, in seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._folded_s = 0.0
        self._watching = 0
        self._pending: queue.SimpleQueue[tuple[float, list[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(self, start: float, end: float) -> None:
        """Counts ``[start, end]`` (``time.perf_counter`` readings)."""
        with self._lock:
            self._intervals.append((start, end))
            self._fold_if_long()

    def watch(self, start: float, arrays: list[Any]) -> None:
        """Counts ``[start, the moment every one of arrays is ready]``, once it is."""
        if not arrays:
            return
        with self._lock:
            self._watching += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._wait_for_outputs,
                                                name="jaxpod-busy-clock", daemon=True)
                self._thread.start()
        self._pending.put((start, arrays))

    def _wait_for_outputs(self) -> None:
        import jax

        while True:
            start, arrays = self._pending.get()
            with contextlib.suppress(Exception):  # its caller hears of a failure
                jax.block_until_ready(arrays)
            end = time.perf_counter()
            del arrays
            with self._lock:
                self._intervals.append((start, end))
                self._watching -= 1
                self._fold_if_long()  # an operation's own add ran while it was watched

    def seconds(self) -> float:
        """Busy time so far. Call between operations (intervals still open are not
        counted until they close)."""
        with self._lock:
            return self._fold()

    def _fold_if_long(self) -> None:
        """Keeps the intervals bounded, whether or not anyone reads the stats."""
        if len(self._intervals) >= _FOLD_AT and not self._watching:
            self._fold()

    def _fold(self) -> float:
        """The total so far; the intervals are summed into it and dropped when no
        watched computation is open (later intervals all start after these end)."""
        total = self._folded_s + _union_length(self._intervals)
        if not self._watching:
            self._folded_s = total
            self._intervals.clear()
        return total


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
