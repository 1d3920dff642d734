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
        step_medians = medians_of_others([p.step_s for p in self.paces])
        input_medians = medians_of_others([p.input_s for p in self.paces])
        new = []
        for host, pace in enumerate(self.paces):
            why = slow_reason(pace, step_medians[host], input_medians[host])
            self._runs[host] = self._runs[host] + 1 if why else 0
            if why is None:
                self.flagged.pop(host, None)
            elif self._runs[host] >= STRAGGLER_REPORTS:
                if host not in self.flagged:
                    new.append(host)
                self.flagged[host] = why
        return new


def medians_of_others(values: Sequence[float]) -> list[float | None]:
    """For each position, the median of every other value (``None`` for a single
    value): one sort for all, not one per host, since a pod has hundreds of hosts and
    the runner asks at every report."""
    n = len(values)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=lambda i: values[i])
    ranked = [values[i] for i in order]
    rank = [0] * n
    for r, i in enumerate(order):
        rank[i] = r
    m = n - 1  # the others' count; their j-th smallest skips the value's own rank

    def nth(j: int, own: int) -> float:
        return ranked[j if j < own else j + 1]

    return [(nth((m - 1) // 2, rank[i]) + nth(m // 2, rank[i])) / 2 for i in range(n)]


def slow_reason(pace: HostPace, step: float | None, waited: float | None) -> str | None:
    """Why a host of this ``pace`` is slow against the other hosts' median seconds per
    step (``step``) and input wait per step (``waited``); ``None``: it is not, or it
    has no other host to be compared with."""
    if step is None or waited is None:
        return None
    if pace.step_s > STRAGGLER_RATIO * step:
        return (f"its loops take {pace.step_s:.3g} s per step, {_times(pace.step_s, step)} "
                f"the other hosts' median ({step:.3g} s)")
    if pace.input_s > STRAGGLER_RATIO * waited and pace.input_s >= INPUT_SHARE * pace.step_s:
        return (f"its steps wait {pace.input_s:.3g} s each for its input, "
                f"{_times(pace.input_s, waited)} the other hosts' median ({waited:.3g} s), "
                "while every host waits for it")
    return None


def _times(value: float, median: float) -> str:
    return f"{value / median:.1f}x" if median > 0 else "far over"
