"""Named, environment-overridable time-outs and counts, deadline-bounded waits, and the
:class:`Cancel` that ends a wait early.

Every wait in jaxpod (service and workers) has a name (an environment variable) and a default,
so an operator can lengthen it without a code change and an error can say which knob
to turn; so has every bound on how much is kept in flight (:class:`Count`). Polling
loops go through :func:`wait_for`, which always has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Timeout:
    """A named time-out whose value can be overridden by an environment variable.

    Attributes:
      env_var: the variable that overrides the default, e.g. ``JAXPOD_ALLOCATION_TIMEOUT_S``.
      default_s: seconds used when the variable is unset.
    """

    env_var: str
    default_s: float

    def seconds(self, environ: Mapping[str, str] | None = None) -> float:
        """The effective time-out in seconds.

        Args:
          environ: where to look the override up (``os.environ`` when ``None``);
            injectable so tests need not mutate the process environment.

        Returns:
          The override when set, else the default.

        Raises:
          ValueError: the override is not a positive number.
        """
        env = os.environ if environ is None else environ
        raw = env.get(self.env_var)
        if raw is None or raw.strip() == "":
            return self.default_s
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(
                f"{self.env_var}={raw!r} is not a valid time-out. Expected a positive "
                f"number of seconds (default {self.default_s:g}). Fix: set it to e.g. "
                f"{self.env_var}={self.default_s:g} or unset it."
            )
        return value

    def resolve(self, explicit_s: float | None) -> float:
        """``explicit_s`` when given (validated), else :meth:`seconds`.

        Args:
          explicit_s: a per-call override, which beats the environment.

        Returns:
          The time-out in seconds.
        """
        if explicit_s is None:
            return self.seconds()
        if not explicit_s > 0:
            raise ValueError(
                f"timeout_s must be a positive number of seconds. Got {explicit_s!r}."
            )
        return float(explicit_s)


@dataclass(frozen=True)
class Count:
    """A named positive count (a depth, a window) that an environment variable can
    override.

    Attributes:
      env_var: the variable that overrides the default.
      default: used when the variable is unset.
      what: what it counts, for the error a bad value gets.
    """

    env_var: str
    default: int
    what: str

    def value(self, explicit: int | None = None) -> int:
        """``explicit`` when given, else the override when set, else the default.

        Raises:
          ValueError: the value is not a positive int, naming the variable.
        """
        raw = explicit if explicit is not None else os.environ.get(self.env_var, "").strip()
        if raw == "":
            return self.default
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"{self.env_var} ({self.what}) must be a positive int. Got {raw!r}. Fix: "
                f"set it to e.g. {self.env_var}={self.default} or unset it.")
        return value


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
