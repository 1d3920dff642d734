"""The worker's busy clock: a union of intervals, with computations counted until ready."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from jaxpod.timeouts import wait_for
from jaxpod.worker.busy_clock import BusyClock


def test_overlapping_intervals_count_once() -> None:
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 900, size=40)
    ends = starts + rng.integers(1, 100, size=40)
    clock = BusyClock()
    for a, b in zip(starts, ends, strict=True):
        clock.add(float(a), float(b))
    covered = np.zeros(1000, bool)  # independent: unit cells covered by any interval
    for a, b in zip(starts, ends, strict=True):
        covered[a:b] = True
    assert clock.seconds() == covered.sum()
    clock.add(2000.0, 2010.0)  # folded earlier intervals still count
    assert clock.seconds() == covered.sum() + 10


def test_watched_computation_counts_until_its_outputs_are_ready() -> None:
    clock = BusyClock()
    t0 = time.perf_counter()
    clock.add(t0 - 1.0, t0)  # an operation that took a second and just ended
    out = jnp.ones((64, 64)) @ jnp.ones((64, 64))
    clock.watch(t0 - 0.5, [out])  # overlaps the operation, so only what lies beyond counts
    assert wait_for(lambda: clock.seconds() > 1.0, 30)  # the watcher closed its interval
    t1 = time.perf_counter()
    # The union runs from t0 - 1.0 to when the outputs were ready, no later than t1:
    # counting the overlap [t0 - 0.5, t0] twice would exceed that.
    assert 1.0 < clock.seconds() <= t1 - (t0 - 1.0)


def test_operations_that_watch_their_outputs_stay_bounded() -> None:
    # As run and run_steps do: the operation watches its outputs, then its own
    # interval is added while the watch is still open.
    clock = BusyClock()
    out = jnp.ones((4,)) + 1
    t0 = time.perf_counter() - 4000.0  # operations that started in the past, one a second
    for i in range(3000):
        clock.watch(t0 + i, [out])
        clock.add(t0 + i, t0 + i + 0.5)
    assert wait_for(lambda: clock._watching == 0, 30)
    assert len(clock._intervals) < 1024  # folded as the watches closed
    # Every watch runs from its start until now, so the union is [t0, its last end].
    assert 4000.0 <= clock.seconds() <= time.perf_counter() - t0
