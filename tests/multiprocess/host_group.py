"""Starting a group of real JAX processes on loopback, as a slice's hosts are started,
and reading what each printed last."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(program: Path, args: Sequence[str], env: Mapping[str, str],
              processes: int = 2, deadline_s: float = 120) -> list[dict[str, object]]:
    """``program ADDRESS PROCESS_ID *args`` in ``processes`` new processes joined by
    ``jax.distributed`` at a free loopback port (``env`` added to this environment,
    less ``XLA_FLAGS``); the last JSON line each printed, in process order."""
    address = f"127.0.0.1:{free_port()}"
    full = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full.update(env)
    procs = [subprocess.Popen([sys.executable, str(program), address, str(i), *args],
                              env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(processes)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=deadline_s)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads([line for line in out.splitlines()
                                       if line.startswith("{")][-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports
