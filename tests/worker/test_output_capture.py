"""OutputCapture keeps what this process prints as lines, and HostOperations exposes it:
threads printing at once, unfinished lines, the bound, the streams put back; then
``print`` at trace time and ``jax.debug.print`` at run time through a real worker."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxpod import operations as ops
from jaxpod.shipping import ship
from jaxpod.worker.engine import Engine
from jaxpod.worker.host_operations import HostOperations
from jaxpod.worker.output_capture import OutputCapture


@contextlib.contextmanager
def plain_streams() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Plain streams as sys.stdout and sys.stderr, to see what is written through (set
    inside the test: pytest puts its own capture back before each test runs)."""
    saved = sys.stdout, sys.stderr
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = saved


def test_threads_printing_at_once_keep_their_lines_whole_and_in_order() -> None:
    threads, lines_each = 8, 500
    go = threading.Barrier(threads)

    def printer(t: int) -> None:
        go.wait()
        for i in range(lines_each):
            # print writes its arguments, separators and end separately
            print("thread", t, "line", i, file=sys.stderr if t % 2 else sys.stdout)
            if t == 0:  # a line written in pieces
                sys.stdout.write(f"piece-a {i} ")
                sys.stdout.write(f"piece-b {i}\n")

    with plain_streams() as (out, err):
        capture = OutputCapture()
        capture.start()
        workers = [threading.Thread(target=printer, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        capture.stop()
    lines = capture.take()
    assert len(lines) == threads * lines_each + lines_each
    for t in range(threads):
        assert [x for x in lines if x.startswith(f"thread {t} ")] == [
            f"thread {t} line {i}" for i in range(lines_each)]
    assert [x for x in lines if x.startswith("piece")] == [
        f"piece-a {i} piece-b {i}" for i in range(lines_each)]
    # Written through: each original stream got its own text.
    assert out.getvalue().count("\n") == threads // 2 * lines_each + lines_each
    assert err.getvalue().count("\n") == threads // 2 * lines_each


def test_unfinished_lines_wait_until_completed_or_capture_stops() -> None:
    with plain_streams() as (out, err):
        capture = OutputCapture()
        capture.start()
        sys.stdout.write("abc")
        sys.stderr.write("err-start")  # another stream's unfinished line is its own
        assert capture.take() == []
        sys.stdout.write("def\nghi")
        assert capture.take() == ["abcdef"]
        sys.stdout.write("\n\n")
        assert capture.take() == ["ghi", ""]
        sys.stdout.write("tail")
        capture.stop()
    assert capture.take() == ["err-start", "tail"]  # oldest unfinished line first
    assert capture.take() == []
    assert (out.getvalue(), err.getvalue()) == ("abcdef\nghi\n\ntail", "err-start")


def test_the_buffer_is_bounded_and_says_how_many_lines_it_dropped() -> None:
    with plain_streams():
        capture = OutputCapture(max_lines=5, max_chars=1000, max_line_chars=100)
        capture.start()
        for i in range(12):
            print(f"line {i}")
        lines = capture.take()
        assert lines[0].startswith("[jaxpod: 7 earlier lines of output dropped")
        assert lines[1:] == [f"line {i}" for i in range(7, 12)]
        assert capture.take() == []  # the count starts over with each take
        sys.stdout.write("x" * 250 + "\n")  # longer than a line may be: cut
        assert capture.take() == ["x" * 100, "x" * 100, "x" * 50]
        capture.stop()

        capture = OutputCapture(max_lines=100, max_chars=1000, max_line_chars=100)
        capture.start()
        sys.stdout.write("y" * 950)  # never ended: cut at the line limit, the rest waits
        print("z" * 40)
        print("w" * 50)  # over the character bound: the oldest line goes
        lines = capture.take()
        capture.stop()
    assert lines[0].startswith("[jaxpod: 1 earlier lines")
    assert lines[1:] == ["y" * 100] * 8 + ["y" * 50 + "z" * 40, "w" * 50]


def test_the_original_streams_come_back_exactly() -> None:
    with plain_streams() as (out, err):
        capture = OutputCapture()
        capture.start()
        tee = sys.stdout
        assert tee is not out and sys.stderr is not err
        capture.start()  # already capturing: the same one capture
        assert sys.stdout is tee
        print("once")
        assert capture.take() == ["once"]
        assert out.getvalue() == "once\n"
        assert tee.closed is out.closed  # anything else is the original's
        capture.stop()
        assert sys.stdout is out and sys.stderr is err
        print("after")
        assert capture.take() == []
        capture.stop()  # stopping twice is harmless
        assert sys.stdout is out

        # Someone who replaced a stream while capturing keeps it; the tee they hold
        # only writes through once capture stops.
        capture.start()
        tee = sys.stdout
        other = io.StringIO()
        with contextlib.redirect_stdout(other):
            capture.stop()
            assert sys.stdout is other and sys.stderr is err
        assert sys.stdout is tee
        print("through")
        assert capture.take() == [] and out.getvalue().endswith("through\n")


def _host() -> tuple[HostOperations, Callable[[ops.Operation[Any]], Any]]:
    host = HostOperations(0, Engine())
    seq = 0

    def execute(op: ops.Operation[Any]) -> Any:
        nonlocal seq
        result = host.execute(ops.Envelope(seq, op, first_id=seq + 1))
        seq += 1
        assert not isinstance(result, ops.RemoteError), result
        return result

    return host, execute


def test_a_worker_captures_trace_time_print_and_run_time_debug_print() -> None:
    host, execute = _host()
    replicas = host.engine.num_replicas_in_sync
    original = sys.stdout, sys.stderr

    def step(x: jax.Array) -> jax.Array:
        print("tracing step")  # once, while it is traced
        jax.debug.print("ran with total {t}", t=x.sum())  # per replica, per run
        return x * 2

    def run_once() -> None:
        info = execute(ops.Run(step_id, (np.arange(4, dtype=np.float32),), None))
        assert isinstance(info, ops.HandleInfo)
        execute(ops.FetchParts(ops.Handle(info.id)))  # waits until it ran

    step_id = execute(ops.Define(ship(step)))
    assert execute(ops.CaptureOutput(True)) is None
    run_once()
    assert execute(ops.TakeOutput()) == ["tracing step"] + ["ran with total 6.0"] * replicas
    run_once()  # compiled already: only the run-time text
    assert execute(ops.TakeOutput()) == ["ran with total 6.0"] * replicas
    assert execute(ops.Stats()).operations == 5  # neither counts as work

    execute(ops.CaptureOutput(False))
    assert (sys.stdout, sys.stderr) == original
    run_once()
    assert execute(ops.TakeOutput()) == []

    # reset_host stops a capture and forgets it: the next holder sees nothing of it.
    execute(ops.CaptureOutput(True))
    run_once()
    print("unfinished", end="")
    execute(ops.ResetHost())
    assert (sys.stdout, sys.stderr) == original
    run_once()
    assert execute(ops.TakeOutput()) == []
