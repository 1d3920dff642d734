"""No process aborts at exit, whatever iterators, infeeds and values are alive.

Each scenario runs in a fresh interpreter, ten times: a daemon infeed thread still in a
JAX call while the interpreter finalizes used to abort it ("terminate called after
throwing an instance of ''", exit 134).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUNS = 10
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
