"""In-memory checkpoints against persistent ones: a host lost without notice.

Two jobs of the same state (``w``: float32, 256 MiB, 128 MiB with ``--quick``; every
replica's copy on its chip) and the same paced step (48 steps, 24 with ``--quick``) run
through ``jaxpod serve --local --provider processes`` on a simulated v4-16 (2 hosts x 4
chips), one after the other:

* **memory**: ``memory_checkpoint_every=2`` and a persistent checkpoint only at the end;
* **persistent**: ``checkpoint_every=2`` and no in-memory ones.

Each job's host 1 is SIGKILLed once the job has run ``KILL_AFTER`` steps; the next
attempt resumes from the hosts' memory or from storage. Figures:

1. ``restore_memory_vs_persistent`` (target <= 0.4): the resumed attempt's ``restoring``
   seconds (goodput), memory over persistent.
2. ``memory_steps_lost`` (target <= 2): steps the killed attempt had reached beyond
   the one the next started from (``persistent_steps_lost`` beside it).
3. ``stall_memory_vs_persistent`` (target <= 1.0): the steps' ``checkpointing`` seconds
   (goodput: the loop waiting while a save is set up), memory over persistent: both
   save every 2 steps, the persistent job's final checkpoint counted apart (result).

Each job's final state is opened with plain orbax and compared with numpy, or the
benchmark fails. The last line of output is the JSON report.

Usage: ``python benchmarks/memory_checkpoint.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ServeProcess, kept_log_on_failure, report, target, wait_until
from checkpoint import (
    ACCELERATOR,
    REPLICAS,
    big_init_fn,
    check_final_checkpoint,
    paced_step_fn,
    state_floats,
)

STEPS = 48  # 23 saves a job: the two that compile weigh little
QUICK_STEPS = 24  # 11 saves a job: the same comparison, half the time
KILL_AFTER = 9
PAUSE_S = 0.05
JOB_TIMEOUT_S = 900.0


def killed_job(client: Any, n: int, steps: int, name: str, **tiers: Any
               ) -> dict[str, float]:
    """The job, its host 1 killed after :data:`KILL_AFTER` steps; its figures."""
    job = client.submit(paced_step_fn(PAUSE_S), steps=steps, accelerator_type=ACCELERATOR,
                        init_fn=big_init_fn(n), dataset=[np.ones(REPLICAS, np.float32)],
                        max_retries_preemption=2, name=name, **tiers)
    pid = wait_until(lambda: job.status().step >= KILL_AFTER and len(job.hosts()) == 2
                     and job.hosts()[1].pid, JOB_TIMEOUT_S, f"{name} past step {KILL_AFTER}")
    os.kill(pid, signal.SIGKILL)
    final = job.wait(timeout=JOB_TIMEOUT_S, progress=False)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"job {job.id} ended {final.state}: {final.error}")
    check_final_checkpoint(job, n, steps)
    attempts = job.attempts()
    if len(attempts) != 2:
        raise RuntimeError(f"job {job.id} took {len(attempts)} attempts: {attempts}")
    goodput = dict(final.goodput or {})
    figures = {"restore_s": goodput.get("restoring", 0.0),
               "checkpointing_s": goodput.get("checkpointing", 0.0),
               "steps_lost": (attempts[0].step_reached or 0) - (attempts[1].start_step or 0),
               "resumed_at": attempts[1].start_step or 0}
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="128 MiB instead of 256 MiB, 24 steps instead of 48")
    args = parser.parse_args()
    import jaxpod

    # At 64 MiB the restores' fixed costs (the calls, the skeleton) are a third of
    # memory's and the ratio moves 0.26-0.42 from run to run.
    mib = 128 if args.quick else 256
    steps = QUICK_STEPS if args.quick else STEPS
    n = state_floats(mib)
    memory_dir = tempfile.mkdtemp(prefix="jaxpod-bench-memory-",
                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    log = os.path.join(tempfile.gettempdir(), f"jaxpod-bench-memory-{os.getpid()}.log")
    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "state_mib": mib,
                               "steps": steps, "cores": os.cpu_count()}
    start = time.perf_counter()
    try:
        with kept_log_on_failure(ServeProcess(
                log, ACCELERATOR, provider="processes",
                env={"JAXPOD_MEMORY_CHECKPOINT_DIR": memory_dir}), log) as service, \
                jaxpod.connect(service.address, token=service.token) as client:
            memory = killed_job(client, n, steps, "bench-memory", memory_checkpoint_every=2,
                                checkpoint_every=steps)
            persistent = killed_job(client, n, steps, "bench-persistent",
                                    memory_checkpoint_every=0, checkpoint_every=2)
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
    figures.update({f"memory_{k}": v for k, v in memory.items()})
    figures.update({f"persistent_{k}": v for k, v in persistent.items()})
    figures["restore_memory_vs_persistent"] = memory["restore_s"] / persistent["restore_s"]
    figures["stall_memory_vs_persistent"] = (memory["checkpointing_s"]
                                             / persistent["checkpointing_s"])
    figures["seconds"] = time.perf_counter() - start
    targets = {
        "restore_memory_vs_persistent": target(figures["restore_memory_vs_persistent"],
                                               "<=", 0.4),
        "memory_steps_lost": target(figures["memory_steps_lost"], "<=", 2),
        "stall_memory_vs_persistent": target(figures["stall_memory_vs_persistent"],
                                             "<=", 1.0),
    }
    report("memory_checkpoint", {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in figures.items()}, targets)


if __name__ == "__main__":
    main()
