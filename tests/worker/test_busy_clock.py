"""The worker's busy clock: a union of intervals, with computations counted until ready."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpod.timeouts import wait_for
from jaxpod.worker.busy_clock import MAX_OPEN_WATCHES, MAX_SEGMENTS, BusyClock, Held


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
    assert wait_for(lambda: clock.held().open_watches == 0, 30)
    assert clock.held().segments == 1  # every watch runs until now: one stretch
    # Every watch runs from its start until now, so the union is [t0, its last end].
    assert 4000.0 <= clock.seconds() <= time.perf_counter() - t0


class _Stalled:
    """A watched output whose computation finishes only when ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def block_until_ready(self) -> _Stalled:
        self.done.wait(60)
        return self


def test_an_open_watch_counts_what_is_known_busy_then_up_to_ready() -> None:
    clock = BusyClock()
    out = _Stalled()
    t = time.perf_counter()
    clock.watch(t - 10.0, [out])  # an operation that started 10 s ago dispatched it
    clock.add(t - 10.0, t - 9.0)  # and ended; the computation runs on
    assert clock.seconds() == pytest.approx(1.0, abs=1e-6)
    clock.add(t - 5.0, t - 4.0)  # a later operation: the device was busy in between
    assert clock.seconds() == pytest.approx(6.0, abs=1e-6)
    assert clock.held() == Held(segments=0, open_watches=1)  # nothing kept per operation
    out.done.set()
    assert wait_for(lambda: clock.held().open_watches == 0, 30)
    # Closed when the watcher saw it ready: after it was released, before now.
    assert 10.0 <= clock.seconds() <= time.perf_counter() - (t - 10.0)
    assert clock.held() == Held(segments=1, open_watches=0)


def test_disjoint_operations_are_summed_not_kept() -> None:
    clock = BusyClock()
    for i in range(10_000):
        clock.add(2.0 * i, 2.0 * i + 1.0)  # idle for a second between operations
        assert clock.held().segments <= MAX_SEGMENTS
    assert clock.seconds() == 10_000.0


def test_watch_waits_when_the_open_watches_reach_their_limit() -> None:
    clock = BusyClock()
    out = _Stalled()  # a device far behind: nothing it was given finishes
    for _ in range(MAX_OPEN_WATCHES):
        clock.watch(time.perf_counter(), [out])
    one_more = threading.Thread(target=clock.watch, args=(time.perf_counter(), [out]))
    one_more.start()
    one_more.join(0.5)
    assert one_more.is_alive()  # held back rather than holding more
    assert clock.held().open_watches == MAX_OPEN_WATCHES
    out.done.set()
    one_more.join(30)
    assert not one_more.is_alive()
    assert wait_for(lambda: clock.held().open_watches == 0, 30)


@jax.jit
def _device_step(x: jax.Array) -> jax.Array:
    """Device work that outlasts its dispatch (tens of microseconds on a CPU)."""
    return jax.lax.fori_loop(0, 40, lambda _, y: jnp.tanh(y @ y), x)


def _step_body(x: jax.Array) -> jax.Array:
    """``_device_step``'s work, as a step function the worker compiles itself."""
    return jax.lax.fori_loop(0, 40, lambda _, y: jnp.tanh(y @ y), x)


def test_device_bound_pipeline_holds_bounded_state() -> None:
    # As run_steps does: each operation dispatches a computation on the previous one's
    # output (so they queue on the device), watches its output and adds its interval.
    clock = BusyClock()
    out = _device_step(jnp.eye(16) * 0.5).block_until_ready()  # compiled beforehand
    most_segments = most_open = still_computing = 0
    known_busy = 0.0  # a lower bound of the union, measured here
    run_start = time.perf_counter()
    for _ in range(50_000):
        start = time.perf_counter()
        out = _device_step(out)
        clock.watch(start, [out])
        end = time.perf_counter()
        clock.add(start, end)
        checked = time.perf_counter()
        if out.is_ready():
            known_busy += end - start
        else:  # still computing at `checked`: its watch covers [start, checked]
            known_busy += checked - start
            still_computing += 1
        held = clock.held()
        most_segments = max(most_segments, held.segments)
        most_open = max(most_open, held.open_watches)
    out.block_until_ready()
    assert wait_for(lambda: clock.held().open_watches == 0, 30)
    run_end = time.perf_counter()
    assert still_computing > 25_000  # the premise: the device is the bottleneck
    assert most_segments <= MAX_SEGMENTS and most_open <= MAX_OPEN_WATCHES
    assert clock.held().segments <= MAX_SEGMENTS
    # The intervals [start, checked] are disjoint, so their sum cannot exceed the union;
    # counting any time twice would exceed the wall time.
    assert known_busy <= clock.seconds() <= run_end - run_start


#: Ten times the open watches the clock may hold: state kept per operation would
#: exceed its bounds tenfold.
WORKER_OPERATIONS = 10 * MAX_OPEN_WATCHES


def test_a_worker_running_device_bound_operations_holds_bounded_busy_state() -> None:
    """The same through a real HostOperations: ``WORKER_OPERATIONS`` Run operations, each
    a step on the previous one's output (freed with the next operation, as a client
    drops it)."""
    from jaxpod import operations as ops
    from jaxpod.shipping import ship
    from jaxpod.worker.engine import Engine
    from jaxpod.worker.host_operations import HostOperations

    run_start = time.perf_counter()
    host = HostOperations(0, Engine())
    seq = 0

    def execute(op: ops.Operation[object], dropped: ops.Dropped | None = None) -> object:
        nonlocal seq
        result = host.execute(ops.Envelope(seq, op, dropped, first_id=seq + 1))
        seq += 1
        assert not isinstance(result, ops.RemoteError), result
        return result

    step = execute(ops.Define(ship(_step_body)))
    start_ids = execute(ops.ValuesFromFunction(execute(ops.Define(ship(
        lambda ctx: np.eye(16, dtype=np.float32) * 0.5)))))
    older, previous = 0, start_ids.id
    most = Held(0, 0)
    for _ in range(WORKER_OPERATIONS):  # frees the output before the one it runs on
        info = execute(ops.Run(step, (ops.Handle(previous),), None),
                       ops.Dropped(values=(older,)))
        older, previous = previous, info.id
        held = host._busy.held()
        most = Held(max(most.segments, held.segments), max(most.open_watches,
                                                           held.open_watches))
    stats = execute(ops.Stats())
    assert wait_for(lambda: host._busy.held().open_watches == 0, 60)
    run_end = time.perf_counter()
    assert most.segments <= MAX_SEGMENTS and most.open_watches <= MAX_OPEN_WATCHES
    assert stats.num_values == 2 and stats.operations == WORKER_OPERATIONS + 3
    assert 0 < host._busy.seconds() <= run_end - run_start
