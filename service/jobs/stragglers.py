"""Which hosts of a running job straggle.

Every host report (:class:`~jaxpod.operations.HostNews`) carries the steps and seconds
of the loops the host ran to their end and the seconds its steps waited for input, as
running totals. Between two reports the runner gets, per host, the seconds per step of
its loops and of its input wait (:class:`HostPace`). A host straggles when, for
:data:`STRAGGLER_REPORTS` reports running, either is over :data:`STRAGGLER_RATIO` times
the median of the other hosts':

* its loops took longer: a host whose steps are slower, where the hosts do not wait
  for each other inside a step;
* its input wait is, and is a quarter of its step or more: in lockstep every host's
  loop takes the slowest one's time, and the host whose own input held the step is
  the one that made the others wait.

A slow chip or link inside a lockstep step shows on every host alike; its stacks and a
profile (``job.profile()``) tell it, not these figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: How many times the other hosts' median a straggler's figure is.
STRAGGLER_RATIO = 3.0
#: For how many host reports running (each after at least one loop).
STRAGGLER_REPORTS = 3
#: The least share of its step a straggler's input wait is.
INPUT_SHARE = 0.25


@dataclass(frozen=True)
class HostPace:
    """One host's seconds per step between two reports: of its loops (start to outputs
    computed) and of its steps' wait for input."""

    step_s: float
    input_s: float


@dataclass(frozen=True)
class HostCounters:
    """A host's running totals, as its report has them."""

    loop_steps: int
    loop_s: float
    input_wait_s: float


class Stragglers:
    """Follows a running attempt's hosts from report to report (see the module)."""

    def __init__(self) -> None:
        self._last: list[HostCounters] | None = None
        self._runs: list[int] = []
        #: Each host's pace over the last window with a loop (empty before one).
        self.paces: tuple[HostPace, ...] = ()
        #: The hosts straggling now, each with why.
        self.flagged: dict[int, str] = {}

    def update(self, counters: Sequence[HostCounters]) -> list[int]:
        """Takes every host's new totals; returns the hosts flagged just now."""
        last, self._last = self._last, list(counters)
        if last is None or len(last) != len(counters):
            self._runs = [0] * len(counters)
            return []
        deltas = [(c.loop_steps - b.loop_steps, c.loop_s - b.loop_s,
                   c.input_wait_s - b.input_wait_s) for c, b in zip(counters, last, strict=True)]
        if any(steps < 0 for steps, _, _ in deltas):  # the hosts started over
            self._runs = [0] * len(counters)
            return []
        if any(steps == 0 for steps, _, _ in deltas):  # no loop since: nothing to say
            self._last = last
            return []
        self.paces = tuple(HostPace(seconds / steps, max(0.0, waited) / steps)
                           for steps, seconds, waited in deltas)
        new = []
        for host in range(len(self.paces)):
            why = slow_reason(host, self.paces)
            self._runs[host] = self._runs[host] + 1 if why else 0
            if why is None:
                self.flagged.pop(host, None)
            elif self._runs[host] >= STRAGGLER_REPORTS:
                if host not in self.flagged:
                    new.append(host)
                self.flagged[host] = why
        return new


def slow_reason(host: int, paces: Sequence[HostPace]) -> str | None:
    """Why ``host`` is slow against the other hosts' median in this window (``None``:
    it is not; a single host has nothing to be compared with)."""
    others = [p for h, p in enumerate(paces) if h != host]
    if not others:
        return None
    pace = paces[host]
    step = statistics.median(p.step_s for p in others)
    if pace.step_s > STRAGGLER_RATIO * step:
        return (f"its loops take {pace.step_s:.3g} s per step, {_times(pace.step_s, step)} "
                f"the other hosts' median ({step:.3g} s)")
    waited = statistics.median(p.input_s for p in others)
    if pace.input_s > STRAGGLER_RATIO * waited and pace.input_s >= INPUT_SHARE * pace.step_s:
        return (f"its steps wait {pace.input_s:.3g} s each for its input, "
                f"{_times(pace.input_s, waited)} the other hosts' median ({waited:.3g} s), "
                "while every host waits for it")
    return None


def _times(value: float, median: float) -> str:
    return f"{value / median:.1f}x" if median > 0 else "far over"
