"""An infeed's figures: the chunks it has ready, and the time its caller waited for
input that was not ready. Real infeed threads on the in-process engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
import pytest

from jaxpod import operations as ops
from jaxpod.timeouts import wait_for
from jaxpod.worker.device_assignment import DeviceAssignment
from jaxpod.worker.engine import Engine
from jaxpod.worker.host_operations import HostOperations

ROWS = 4  # a global batch: 2 rows per replica


def _engine() -> Engine:
    return Engine(DeviceAssignment.build(jax.devices()[:2]), steps_per_run=2)


def _batch(i: int) -> np.ndarray:
    return np.full((ROWS, 3), i, np.float32)


def test_a_fed_infeed_keeps_its_queue_full_and_its_caller_never_waits() -> None:
    engine = _engine()
    iterator = engine.experimental_distribute_dataset([_batch(i) for i in range(12)]).iterate()
    assert wait_for(lambda: iterator.prefetched == 2, 30)  # the default prefetch depth
    for step in range(2):
        batch = iterator.next_steps(2)
        np.testing.assert_array_equal(np.asarray(batch.arrays[0])[0, :, 0, 0],
                                      [2 * step, 2 * step + 1])
        # The chunk was there already: nothing waited, to the nanosecond.
        assert engine.input_wait.seconds() == 0.0
        assert wait_for(lambda: iterator.prefetched == 2, 30)  # refilled behind it


class _Gated:
    """Two batches at once, then the rest once ``gate`` opens: an input source that
    falls behind."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def __iter__(self) -> Iterator[np.ndarray]:
        yield from (_batch(0), _batch(1))
        assert self.gate.wait(60), "the test never opened the gate"
        yield from (_batch(2), _batch(3))


def test_the_time_a_caller_waits_for_late_input_is_counted() -> None:
    engine = _engine()
    gate = threading.Event()
    iterator = engine.experimental_distribute_dataset(_Gated(gate)).iterate()
    iterator.next_steps(2)  # the first chunk (its thread may still have been making it)
    before = engine.input_wait.seconds()
    assert iterator.prefetched == 0  # the producer is held at the gate
    late_s = 0.5  # how long after the caller asks the input comes
    opener = threading.Timer(late_s, gate.set)
    started = time.perf_counter()
    opener.start()
    batch = iterator.next_steps(2)
    took = time.perf_counter() - started
    opener.join()
    np.testing.assert_array_equal(np.asarray(batch.arrays[0])[0, :, 0, 0], [2, 3])
    waited = engine.input_wait.seconds() - before
    # It waited inside next_steps for at least the gate's time less what next_steps
    # does besides waiting; never longer than next_steps took.
    assert took >= late_s
    assert 0.5 * took <= waited <= took, (waited, took)


def test_host_stats_count_input_wait_from_the_slices_current_holder() -> None:
    host = HostOperations(0, _engine())
    host.engine.input_wait.add(250_000_000)  # what the holder's steps waited
    stats = host.stats(ops.Stats())
    assert (stats.input_wait_s, stats.input_queue_depth) == (0.25, 0)
    host.reset_host(ops.ResetHost())  # the next holder starts from nothing
    assert host.stats(ops.Stats()).input_wait_s == 0.0
    host.engine.input_wait.add(10_000_000)
    assert host.stats(ops.Stats()).input_wait_s == 0.01


def test_full_steps_ahead_stop_before_a_short_step_and_an_error() -> None:
    """What a host tells a client it may take without waiting: the steps ready, up to
    the first one short of rows (the input's last) or the dataset's error."""
    engine = _engine()
    short = np.full((ROWS - 1, 3), 9, np.float32)  # the last replica gets one row
    iterator = engine.experimental_distribute_dataset(
        [*(_batch(i) for i in range(5)), short]).iterate(steps_per_run=1)
    next(iterator)
    # 4 full steps follow the first, then the short one: all read ahead, 2 of them
    # placed on the devices (the prefetch depth), the rest kept on the host.
    assert wait_for(lambda: iterator.full_steps_ahead() == 4, 30)
    assert wait_for(lambda: iterator.prefetched == 2, 30)
    next(iterator)
    assert wait_for(lambda: iterator.full_steps_ahead() == 3, 30)
    next(iterator), next(iterator)
    assert wait_for(lambda: iterator.prefetched == 2, 30)  # step 5 and the short one
    assert iterator.full_steps_ahead() == 1  # not the short one
    next(iterator)
    assert iterator.full_steps_ahead() == 0

    class Fails:
        def __iter__(self) -> Iterator[np.ndarray]:
            yield _batch(0)
            yield _batch(1)
            raise RuntimeError("the dataset's own error")

    failing = engine.experimental_distribute_dataset(Fails()).iterate(steps_per_run=1)
    next(failing)
    assert wait_for(lambda: failing.prefetched == 1, 30)
    assert failing.full_steps_ahead() == 1  # the error behind it does not count


def test_the_lookahead_reads_a_bounded_number_of_steps_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the chunks placed, the infeed reads ``JAXPOD_INFEED_LOOKAHEAD_STEPS``
    steps into host memory, and no more, however long the input."""
    monkeypatch.setenv("JAXPOD_INFEED_LOOKAHEAD_STEPS", "3")
    reads = []

    def counted() -> Iterator[np.ndarray]:
        for i in range(40):
            reads.append(i)
            yield _batch(i)

    iterator = _engine().experimental_distribute_dataset(counted()).iterate(steps_per_run=1)
    first = next(iterator)
    np.testing.assert_array_equal(np.asarray(first.array)[:, 0, 0], [0, 0])
    # 2 placed and 3 on the host; the producer then waits for the caller.
    assert wait_for(lambda: iterator.full_steps_ahead() == 5, 30)
    assert wait_for(lambda: iterator.prefetched == 2, 30)
    assert reads == list(range(6))
    for step in range(1, 4):  # each step taken lets one more be read
        np.testing.assert_array_equal(np.asarray(next(iterator).array)[:, 0, 0], [step] * 2)
        assert wait_for(lambda: iterator.full_steps_ahead() == 5, 30)
    assert reads == list(range(9))

