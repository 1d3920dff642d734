"""``examples/``, run as a user runs them: a fresh interpreter, one command, the embedded
local service it starts itself.

The transformer example runs shortened: it trains a flax nnx model sharded FSDP x
tensor-parallel as a global-view job on a simulated v4-16, SIGKILLs a host after the
first checkpoint, restores the last checkpoint with plain orbax, and (``--one-device``)
trains the same steps on one device in its own process: the held-out losses of the two
must agree (the script exits non-zero otherwise, and this test compares them again).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_TIMEOUT_S = 600
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_transformer_example_survives_a_killed_host_and_matches_one_device(
        tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("JAXPOD_ADDRESS", None)  # the embedded service, as on a fresh machine
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "transformer_lm.py"), "--steps", "20",
         "--steps-per-run", "5", "--checkpoint-every", "10", "--kill-host", "--one-device",
         "--plot", str(plot)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-4000:]
    assert re.search(r"SIGKILLed host 1's worker \(pid \d+\)", out), out
    assert re.search(r"SUCCEEDED after [2-9] attempt", out), out  # it resumed
    curve = [float(x) for x in re.findall(r"loss (\d+\.\d+)  attempt", out)]
    assert len(curve) >= 3 and curve[-1] < curve[0], out  # it learned
    held_out = float(re.search(r"held-out loss (\d+\.\d+) nats", out).group(1))  # type: ignore[union-attr]
    one_device = float(re.search(r"one-device run .*: held-out loss (\d+\.\d+)", out).group(1))  # type: ignore[union-attr]
    assert math.isclose(held_out, one_device, rel_tol=1e-3), out
    assert held_out < math.log(256), out  # better than uniform over bytes
    assert plot.read_bytes().startswith(PNG_MAGIC)
