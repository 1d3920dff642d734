"""The worker's busy clock: the union of its operations' intervals, bounded."""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxpod.worker.busy_clock import MAX_SEGMENTS, BusyClock


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


def test_disjoint_operations_are_summed_not_kept() -> None:
    clock = BusyClock()
    for i in range(10_000):
        clock.add(2.0 * i, 2.0 * i + 1.0)  # idle for a second between operations
        assert clock.segments() <= MAX_SEGMENTS
    assert clock.seconds() == 10_000.0


def _step_body(x: jax.Array) -> jax.Array:
    """Device work that outlasts its dispatch (tens of microseconds on a CPU)."""
    return jax.lax.fori_loop(0, 40, lambda _, y: jax.numpy.tanh(y @ y), x)


#: Operations a worker runs in the test below: state kept per operation would show.
WORKER_OPERATIONS = 5_000


def test_a_worker_counts_its_operations_and_the_wait_of_the_one_that_syncs() -> None:
    """Through a real HostOperations: ``WORKER_OPERATIONS`` Run operations, each a step on
    the previous one's output (freed with the next, as a client drops it), dispatched
    without waiting; then a reduce, which waits for them. The clock stays bounded, and
    counts the reduce's wait for the devices (the work the runs only dispatched)."""
    from jaxpod import operations as ops
    from jaxpod.shipping import ship
    from jaxpod.worker.engine import Engine
    from jaxpod.worker.host_operations import HostOperations

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
    execute(ops.Run(step, (ops.Handle(previous),), None))  # compiles
    run_start = time.perf_counter()
    busy_before = host._busy.seconds()
    most_segments = 0
    for _ in range(WORKER_OPERATIONS):  # frees the output before the one it runs on
        info = execute(ops.Run(step, (ops.Handle(previous),), None),
                       ops.Dropped(values=(older,)))
        older, previous = previous, info.id
        most_segments = max(most_segments, host._busy.segments())
    dispatched = time.perf_counter()
    total = execute(ops.Reduce("SUM", (ops.Handle(previous),), None))
    run_end = time.perf_counter()
    busy = host._busy.seconds() - busy_before
    stats = execute(ops.Stats())
    assert np.all(np.isfinite(total))
    assert most_segments <= MAX_SEGMENTS
    # The warm-up's output and the last two steps' are kept; two definitions, the
    # start values, the warm-up, the steps and the reduce counted.
    assert stats.num_values == 3 and stats.operations == WORKER_OPERATIONS + 5
    # Counted once at most (never over the wall time), and the reduce's wait is in it.
    assert busy <= run_end - run_start
    assert busy >= run_end - dispatched - 1e-3
