"""Two real JAX processes on loopback (2 CPU devices each, gloo collectives).

Checks that the engine built from the global device list gives cross-process
``reduce`` and ``gather`` results equal to numpy on the whole dataset, with each host
feeding only its own replicas' rows of each global batch (TF's rebatching over all
replicas of all hosts).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from host_group import free_port

from jaxpod.worker.input import per_replica_sizes

PROGRAM = Path(__file__).with_name("two_host_program.py")
DEADLINE_S = 180


def _expected_steps() -> list[np.ndarray]:
    """Rows per global replica per step, by TF's rules, computed independently: each
    step splits one global batch of the whole stream over all 4 replicas of both hosts,
    the first replicas taking the extra rows."""
    data = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    replicas, global_batch = 4, 6
    sizes = [2, 2, 1, 1]  # 6 rows over 4 replicas
    assert sizes == per_replica_sizes(global_batch, replicas)
    steps = []
    for start in range(0, len(data), global_batch):
        bounds = np.minimum(start + np.cumsum([0, *sizes]), len(data))
        steps.append([data[a:b] for a, b in itertools.pairwise(bounds)])
    return steps


@pytest.mark.multiprocess
def test_cross_process_reduce_and_gather(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(PROGRAM), address, str(i), str(outs[i])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + DEADLINE_S
        logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"process exited {p.returncode}:\n{log}"

    results = [json.loads(o.read_text()) for o in outs]
    expected = _expected_steps()
    for proc, res in enumerate(results):
        assert res["process_index"] == proc
        assert (res["num_replicas"], res["hosts"]) == (4, 2)
        assert len(res["steps"]) == len(expected)
        for got, rows in zip(res["steps"], expected, strict=True):
            # Each host sees only its own replicas' rows, padding dropped.
            mine = rows[2 * proc:2 * proc + 2]
            for local, want in zip(got["local_rows"], mine, strict=True):
                np.testing.assert_array_equal(np.asarray(local).reshape(-1, 2), want)
            x = [r * 2.0 + rid for rid, r in enumerate(rows)]
            all_rows = np.concatenate(x)
            np.testing.assert_allclose(got["gather"], all_rows)
            np.testing.assert_allclose(got["sum0"], all_rows.sum(axis=0))
            np.testing.assert_allclose(got["mean0"], all_rows.mean(axis=0), rtol=1e-6)
            np.testing.assert_allclose(got["max0"], all_rows.max(axis=0))
            np.testing.assert_allclose(got["total"], np.concatenate(rows).sum(), rtol=1e-6)

    # Input positions at a save: process 0 gets every host's in order, the others
    # nothing, and no key outlives its exchange.
    for proc, res in enumerate(results):
        want = [[{"host": h, "save": seq} for h in range(2)] if proc == 0 else None
                for seq in range(3)]
        assert res["exchanges"] == want
        assert res["keys_left"] == []
