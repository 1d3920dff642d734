"""Preemption notices in a worker process: SIGTERM records a notice, the process keeps
running for the grace (``JAXPOD_PREEMPTION_GRACE_S``), then exits as it would have.

Signals go only to fresh ``python -c`` children started here (never to pytest itself);
the flag's own behaviour is checked in-process without signals.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from jaxpod.operations import Notice
from jaxpod.timeouts import Deadline, wait_for
from jaxpod.worker import preemption
from jaxpod.worker.preemption import PreemptionFlag

GRACE_S = 1.5
LINE_TIMEOUT_S = 60.0  # a child's start-up imports JAX's dependencies: slow on a busy box
BACKSTOP_S = 0.5
EXIT_TIMEOUT_S = GRACE_S + 30.0

# argv[1]: the SIGTERM disposition before ours: "default", "exits" (a handler that
# exits with 3) or "returns" (a handler that lets the process live on). argv[2]:
# "native" starts jax.distributed after the install, whose preemption service puts a
# native SIGTERM handler in place of ours, then installs again (as HostWorker does).
CHILD = f"""
import signal, socket, sys
from jaxpod.timeouts import wait_for
from jaxpod.worker import preemption

def previous(signum, frame):
    print("previous handler", flush=True)
    if sys.argv[1] == "exits":
        sys.exit(3)

if sys.argv[1] != "default":
    signal.signal(signal.SIGTERM, previous)
preemption.EXIT_BACKSTOP_S = {BACKSTOP_S}
assert preemption.install_sigterm_handler()
assert preemption.install_sigterm_handler()  # a second install keeps the first
if sys.argv[2] == "native":
    import jax
    jax.config.update("jax_platforms", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jax.distributed.initialize(f"127.0.0.1:{{port}}", num_processes=1, process_id=0)
    assert preemption.install_sigterm_handler()
print("ready", flush=True)
notice = wait_for(preemption.notice, 120)
print("notice", notice.at, notice.reason, flush=True)
wait_for(lambda: False, 120)  # keeps running: only the grace may end it
print("outlived the grace", flush=True)
"""


@pytest.fixture
def start_child() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:  # only what this test started, by its own handle
        if child.poll() is None:
            child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()


def _child(started: list[subprocess.Popen[str]], previous: str, native: bool = False
           ) -> subprocess.Popen[str]:
    env = {**os.environ, preemption.PREEMPTION_GRACE.env_var: str(GRACE_S)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, previous,
                              "native" if native else "-"], env=env, text=True,
                             stdout=subprocess.PIPE)
    started.append(child)
    assert _line(child) == "ready"
    return child


def _line(child: subprocess.Popen[str], timeout_s: float = LINE_TIMEOUT_S) -> str:
    """The child's next line of output, within ``timeout_s``."""
    assert child.stdout is not None
    deadline = Deadline(timeout_s)
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while not deadline.expired():
            if selector.select(deadline.remaining()):
                return child.stdout.readline().rstrip("\n")
    raise AssertionError(f"no line from the child within {timeout_s:g}s")


def _terminate_and_check_notice(child: subprocess.Popen[str]) -> float:
    """Sends SIGTERM; checks the notice and that the child lives on. Returns when the
    signal was sent (monotonic)."""
    before, sent = time.time(), time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    word, at, reason = _line(child).split()
    assert (word, reason) == ("notice", "SIGTERM")
    assert before <= float(at) <= time.time()
    os.kill(child.pid, signal.SIGTERM)  # a second one neither ends it nor moves the grace
    assert child.poll() is None
    return sent


def _wait_exit(child: subprocess.Popen[str]) -> float:
    """The child's exit time (monotonic), within ``EXIT_TIMEOUT_S``."""
    assert wait_for(lambda: child.poll() is not None, EXIT_TIMEOUT_S), "outlived the grace"
    return time.monotonic()


def test_sigterm_records_a_notice_and_the_default_exit_comes_after_the_grace(
        start_child: list[subprocess.Popen[str]]) -> None:
    child = _child(start_child, "default")
    sent = _terminate_and_check_notice(child)
    assert _wait_exit(child) - sent >= GRACE_S
    assert child.returncode == -signal.SIGTERM  # as SIGTERM would have ended it


def test_installing_again_takes_sigterm_back_from_native_code(
        start_child: list[subprocess.Popen[str]]) -> None:
    child = _child(start_child, "default", native=True)
    sent = _terminate_and_check_notice(child)
    assert _wait_exit(child) - sent >= GRACE_S
    assert child.returncode == -signal.SIGTERM


def test_after_the_grace_the_previous_handler_gets_the_signal(
        start_child: list[subprocess.Popen[str]]) -> None:
    child = _child(start_child, "exits")  # as Ray's handler: it raises SystemExit
    sent = _terminate_and_check_notice(child)
    assert _line(child, EXIT_TIMEOUT_S) == "previous handler"
    assert _wait_exit(child) - sent >= GRACE_S
    assert child.returncode == 3


def test_a_worker_is_never_immortal(start_child: list[subprocess.Popen[str]]) -> None:
    child = _child(start_child, "returns")  # a previous handler that does not exit
    sent = _terminate_and_check_notice(child)
    assert _line(child, EXIT_TIMEOUT_S) == "previous handler"
    assert _wait_exit(child) - sent >= GRACE_S + BACKSTOP_S
    assert child.returncode == 128 + signal.SIGTERM


def test_the_first_notice_is_kept_whoever_records_it() -> None:
    flag = PreemptionFlag()
    assert flag.notice() is None
    kept: list[Notice] = []
    threads = [threading.Thread(target=lambda i=i: kept.append(flag.record(f"source {i}")))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = flag.notice()
    assert first is not None and all(k is first for k in kept)
    assert flag.record("instance/preempted", at=1.0) is first  # later sources add nothing


def test_the_hook_records_a_notice_from_another_source(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(preemption, "FLAG", PreemptionFlag())  # pytest's own stays clear
    assert preemption.notice() is None
    notice = preemption.record_notice("instance/maintenance-event", at=123.0)
    assert notice == Notice(123.0, "instance/maintenance-event")
    assert preemption.notice() is notice


def test_off_the_main_thread_nothing_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    results: list[bool | BaseException] = []

    def install() -> None:
        try:
            results.append(preemption.install_sigterm_handler(grace_s=5.0))
            monkeypatch.setenv(preemption.PREEMPTION_GRACE.env_var, "0")
            preemption.install_sigterm_handler()
        except BaseException as e:
            results.append(e)

    handler = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert results[0] is False
    assert isinstance(results[1], ValueError)  # a bad grace is refused, not ignored
    assert preemption.PREEMPTION_GRACE.env_var in str(results[1])
