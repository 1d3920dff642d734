"""How long a host worker spent working, for its stats.

JAX dispatches asynchronously: an operation such as ``run_steps`` returns once its
computation is queued, and the devices keep computing while the worker waits for its
next operation. The clock therefore counts the union of two kinds of intervals: each
operation's own, and, for operations that dispatch computations, from the operation's
start until its outputs are ready.

What it holds is bounded whatever the pipeline: a total, at most ``MAX_SEGMENTS``
disjoint busy segments, and the outputs of the watches still open, at most
``MAX_OPEN_WATCHES``. Watches open back to back cover one contiguous stretch (each
starts no later than it is registered, and is registered while the others are still
open), so of those the clock keeps only where that stretch began and the last moment
known busy in it.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from typing import Any, NamedTuple

#: Disjoint busy segments kept, so that intervals added out of order still merge; older
#: ones are summed into a total (a worker's operations arrive in order).
MAX_SEGMENTS = 64

#: Watches open at once. The watcher thread lags the worker by about what the devices
#: have queued plus what the worker dispatches while the watcher waits for the GIL (a
#: few hundred tiny computations); beyond this ``watch`` waits for it to catch up.
MAX_OPEN_WATCHES = 1024


class Held(NamedTuple):
    """What a clock keeps: its busy segments and the watches still open."""

    segments: int
    open_watches: int


class BusyClock:
    """The union of the intervals a worker was busy, in seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._has_pending = threading.Condition(self._lock)
        self._has_room = threading.Condition(self._lock)
        self._segments: list[tuple[float, float]] = []  # sorted, disjoint
        self._folded_s = 0.0  # length of the segments summed away
        self._horizon = float("-inf")  # where the summed segments end
        self._pending: list[list[Any]] = []  # watched outputs the watcher has not taken
        self._in_wait = 0  # watches the watcher is waiting on now
        self._open_since = 0.0  # start of the stretch the open watches cover
        self._known_until = 0.0  # last moment known busy in that stretch
        self._thread: threading.Thread | None = None

    def add(self, start: float, end: float) -> None:
        """Counts ``[start, end]`` (``time.perf_counter`` readings)."""
        with self._lock:
            if self._open() and self._open_since <= start and end <= time.perf_counter():
                # Inside the open stretch, busy until now: nothing to keep but its end.
                self._known_until = max(self._known_until, end)
            else:
                self._insert(start, end)

    def watch(self, start: float, arrays: list[Any]) -> None:
        """Counts ``[start, the moment every one of arrays is ready]``, once it is."""
        if not arrays:
            return
        with self._lock:
            # Bounds what is held; the devices are that far behind, so the worker would
            # soon wait for them anyway.
            self._has_room.wait_for(lambda: self._open_watches() < MAX_OPEN_WATCHES)
            if not self._open():
                self._open_since = self._known_until = start
            else:  # the stretch is busy until now, so it also covers this earlier start
                self._open_since = min(self._open_since, start)
            self._pending.append(arrays)
            self._has_pending.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._wait_for_outputs,
                                                name="jaxpod-busy-clock", daemon=True)
                self._thread.start()

    def seconds(self) -> float:
        """Busy time so far: the closed intervals and, of the stretch the open watches
        cover, the part known busy (up to the last operation or watch that ended)."""
        with self._lock:
            segments = list(self._segments)
            if self._open():
                _merge_into(segments, self._clip(self._open_since, self._known_until))
            return self._folded_s + sum(b - a for a, b in segments)

    def held(self) -> Held:
        """How much the clock keeps, to check that it stays bounded."""
        with self._lock:
            return Held(len(self._segments), self._open_watches())

    def _open_watches(self) -> int:
        return len(self._pending) + self._in_wait

    def _open(self) -> bool:
        return self._open_watches() > 0

    def _wait_for_outputs(self) -> None:
        while True:
            with self._lock:
                self._has_pending.wait_for(lambda: bool(self._pending))
                # All at once: the open watches form one stretch, which only needs the
                # moment the last of them is ready.
                batch, self._pending = self._pending, []
                self._in_wait = len(batch)
            _block_on_each(batch)
            self._close_batch()
            del batch  # lets the buffers go, after the end is read: freeing takes time

    def _close_batch(self) -> None:
        with self._lock:
            # Read under the lock: an add let in before this saw the stretch open and
            # ended earlier, so the stretch must reach at least this far.
            end = time.perf_counter()
            self._in_wait = 0
            self._has_room.notify_all()
            self._known_until = max(self._known_until, end)
            if not self._pending:  # no watch keeps the stretch open
                self._insert(self._open_since, end)

    def _insert(self, start: float, end: float) -> None:
        """Merges ``[start, end]`` into the segments; sums the oldest beyond the limit."""
        _merge_into(self._segments, self._clip(start, end))
        while len(self._segments) > MAX_SEGMENTS:
            a, b = self._segments.pop(0)
            self._folded_s += b - a
            self._horizon = b

    def _clip(self, start: float, end: float) -> tuple[float, float]:
        """The part of ``[start, end]`` not already summed into the total."""
        start = max(start, self._horizon)
        return start, max(start, end)


def _block_on_each(batch: list[list[Any]]) -> None:
    """Waits until every watched output is ready or has failed."""
    import jax

    try:
        jax.block_until_ready(batch)  # one call for the lot: cheap per watch
    except Exception:  # a failed computation (its caller hears of it) cut the wait short
        for arrays in batch:
            with contextlib.suppress(Exception):
                jax.block_until_ready(arrays)


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
