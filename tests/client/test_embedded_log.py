"""The embedded service's log: removed when the service stops cleanly, named when it
does not (a month of runs leaves no ``jaxpod-embedded-<pid>.log`` behind)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpod.client import embedded

RUN_TIMEOUT_S = 180

CLIENT = """
import numpy as np
import jaxpod

with jaxpod.connect() as client, client.strategy() as strategy:
    print(float(strategy.reduce("SUM", strategy.run(lambda x: x + 1, args=(np.ones(2),)),
                                axis=None).sum()))
"""


def test_a_client_that_started_the_embedded_service_leaves_no_log_behind() -> None:
    env = {**os.environ, "JAXPOD_LOCAL_SLICES": "v4-8"}
    env.pop("JAXPOD_ADDRESS", None)  # the embedded service, as on a fresh machine
    done = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) == 4 * 2 * 2.0  # 4 replicas of [2, 2]
    named = re.search(r"log (\S+jaxpod-embedded-\d+\.log)\)", done.stderr)
    assert named, done.stderr  # where it said the log would be
    assert not Path(named.group(1)).exists(), "a clean stop left the embedded log behind"


def test_an_embedded_service_that_died_keeps_its_log_and_says_where(
        capsys: pytest.CaptureFixture[str]) -> None:
    service = embedded.launch(slices="v4-8", quiet=True)
    log = Path(service.log_path)
    try:
        os.kill(service.process.pid, signal.SIGKILL)
        service.process.wait(RUN_TIMEOUT_S)
        service.stop()
        said = capsys.readouterr().err
        assert f"exited with status {-signal.SIGKILL}; its log is {log}" in said, said
        assert log.exists()
    finally:
        service.stop()
        log.unlink(missing_ok=True)
