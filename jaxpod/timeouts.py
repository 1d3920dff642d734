"""Deadline-bounded waits and the :class:`Cancel` that ends a wait early.

Every wait in jaxpod (service and workers) has a named time-out, declared with every
other setting in :mod:`jaxpod.settings`, so an operator can lengthen it without a code
change and an error can say which knob to turn; so has every bound on how much is kept
in flight. Polling loops go through :func:`wait_for`, which always has a deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Cancel:
    """Tells a call waiting in a worker thread to give up; set from any thread. A wait
    on a condition of its own registers how to wake it (:meth:`waking`)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._wakes: list[Callable[[], None]] = []

    @property
    def event(self) -> threading.Event:
        """Set once cancelled (for waits that take an event)."""
        return self._event

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        with self._lock:
            self._event.set()
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    @contextlib.contextmanager
    def waking(self, wake: Callable[[], None]) -> Iterator[None]:
        """Calls ``wake`` when cancelled while the block runs (at once if already)."""
        with self._lock:
            self._wakes.append(wake)
            now = self._event.is_set()
        if now:
            wake()
        try:
            yield
        finally:
            with self._lock:
                self._wakes.remove(wake)


class Deadline:
    """A point in monotonic time that a multi-step operation must finish by."""

    def __init__(self, seconds: float) -> None:
        self.total_s = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self._end


def wait_for(
    condition: Callable[[], T | None],
    timeout_s: float,
    *,
    poll_s: float = 0.02,
    max_poll_s: float = 0.25,
) -> T | None:
    """Polls ``condition`` until it returns a truthy value or ``timeout_s`` passes.

    The poll interval doubles from ``poll_s`` up to ``max_poll_s`` so short waits
    react fast and long ones stay cheap.

    Args:
      condition: returns a truthy value when the wait is over.
      timeout_s: the deadline; ``condition`` is evaluated at least once.
      poll_s: the first pause between evaluations.
      max_poll_s: the longest pause between evaluations.

    Returns:
      The first truthy value ``condition`` returned, or ``None`` on time-out (the
      caller decides how to report it, naming its own time-out).
    """
    deadline = Deadline(timeout_s)
    pause = poll_s
    while True:
        value = condition()
        if value:
            return value
        if deadline.expired():
            return None
        time.sleep(min(pause, deadline.remaining()))
        pause = min(pause * 2, max_poll_s)
