"""No process aborts at exit, whatever iterators, infeeds and values are alive.

Each scenario runs in a fresh interpreter, five times: a daemon infeed thread still in a
JAX call while the interpreter finalizes used to abort it ("terminate called after
throwing an instance of ''", exit 134). The last one is a client of a real service
that exits holding a slice whose host worker was killed (SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxpod.client import embedded
from jaxpod.service.capacity.local_cluster import descendants
from jaxpod.timeouts import wait_for

RUNS = 5
ABORTED = ("terminate called", "FATAL: exception not rethrown", "Fatal Python error")

_PRELUDE = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
import numpy as np
import jaxpod

strategy = jaxpod.TPUStrategy()
batches = [np.full((512, 256), i, np.float32) for i in range(64)]
"""

#: name -> (file, the command's arguments after the interpreter, expected exit status)
SCENARIOS = {
    # The case: a failing test's traceback keeps a live iterator; another test
    # runs a step; pytest exits.
    "pytest_module": ("test_scenario.py", ["-m", "pytest", "-q", "-p", "no:cacheprovider"],
                      1, _PRELUDE + """
def test_first_fails_keeping_an_iterator():
    short = [np.full((8, 2), i, np.float32) for i in range(3)]
    it = iter(strategy.experimental_distribute_dataset(short))
    next(it)
    assert False, "fails on purpose: its traceback keeps `it` alive"

def test_second_runs_a_step():
    out = strategy.run(lambda x: x * 2, args=(np.ones(3, np.float32),))
    np.testing.assert_allclose(strategy.reduce("SUM", out, axis=None), np.full(3, 16.0))
"""),
    # An iterator whose infeed is mid-prefetch when the script ends.
    "mid_prefetch": ("scenario.py", [], 0, _PRELUDE + """
it = iter(strategy.experimental_distribute_dataset(batches))
first = next(it)
assert strategy.reduce("SUM", first, axis=0).shape == (256,)
"""),
    # run_steps inputs still alive (an iterator, its state and outputs) at exit.
    "run_steps_inputs": ("scenario.py", [], 0, _PRELUDE + """
it = iter(strategy.experimental_distribute_dataset(batches))
state, out = strategy.run_steps(lambda s, x: (s + 1, x * 2), it, steps=3,
                                initial_state=np.zeros((), np.float32))
assert strategy.reduce("MAX", state, axis=None) == 3.0
"""),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_exit_does_not_abort(tmp_path: Path, scenario: str) -> None:
    name, args, expected, source = SCENARIOS[scenario]
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    for run in range(RUNS):
        result = subprocess.run([sys.executable, *args, str(script)], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        output = result.stdout + result.stderr
        assert not any(sign in output for sign in ABORTED), f"run {run}:\n{output[-3000:]}"
        assert result.returncode == expected, f"run {run}:\n{output[-3000:]}"


_HOLDS_A_BROKEN_SLICE = """
import sys
import numpy as np
import jaxpod

client = jaxpod.connect(sys.argv[1])
strategy = client.strategy("v4-8")
value = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.full((4,), ctx.replica_id_in_sync_group, np.float32))
it = iter(strategy.experimental_distribute_dataset([np.ones((64, 8), np.float32)] * 32))
next(it)
print("HOLDING", flush=True)
sys.stdin.readline()  # the test kills the slice's worker meanwhile
try:
    strategy.run(lambda x: x + 1, args=(value,))
except jaxpod.JaxpodError as e:
    print("LOST", type(e).__name__, flush=True)
# exits holding the strategy, its value and its iterator
"""


@pytest.fixture(scope="module")
def service() -> Iterator[embedded.EmbeddedService]:
    started = embedded.start(slices="v4-8", quiet=True)
    try:
        yield started
    finally:
        started.stop()


def _host_workers(service_pid: int) -> list[int]:
    """The service's host worker processes (Ray names them after the actor's class; the
    embedded service's are ``python -m jaxpod.worker.host_process``)."""
    found = []
    for pid in descendants(service_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if b"HostWorker" in command or b"jaxpod.worker.host_process" in command:
            found.append(pid)
    return found


def test_a_client_holding_a_slice_whose_worker_was_killed_exits_cleanly(
        tmp_path: Path, service: embedded.EmbeddedService) -> None:
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(_HOLDS_A_BROKEN_SLICE))
    for run in range(RUNS):
        child = subprocess.Popen([sys.executable, str(script), service.address],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, JAXPOD_TOKEN=service.token))
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "HOLDING"
        workers = _host_workers(service.process.pid)
        assert len(workers) == 1, workers  # v4-8: one host, held by this client
        os.kill(workers[0], signal.SIGKILL)
        out, err = child.communicate("go\n", timeout=120)
        assert not any(sign in out + err for sign in ABORTED), f"run {run}:\n{err[-3000:]}"
        assert child.returncode == 0 and "LOST WorkerLostError" in out, \
            f"run {run}: {child.returncode}\n{out}\n{err[-3000:]}"
        # The service released the slice with the session: the next run acquires it.
        assert wait_for(lambda: not _host_workers(service.process.pid), 60)
