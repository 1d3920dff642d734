"""Restarts: what the hosts' compilation cache saves a resumed attempt and a new submit.

The benchmarks' transformer (``transformer_model.py``: a 2-layer flax nnx transformer
with optax AdamW, FSDP over a simulated v4-16's 8 chips, 2 hosts) runs as a job
through ``jaxpod serve --local --provider processes`` (the embedded service's hosts:
plain processes), once with the hosts' compilation cache on, in a fresh folder, and
once with it off (``JAXPOD_COMPILATION_CACHE_DIR=off``). Each time:

1. ``first_submit_to_first_step_s``: submit to the job's first loop done (its
   attempt's record), on cold hosts; the cache starts empty.
2. Host 1's worker (its pid from ``job.hosts()``) is SIGKILLed once the job has a
   committed checkpoint: ``kill_to_first_step_s`` runs to the resumed attempt's first
   loop done, ``kill_setup_and_first_loop_s`` is its part after the slice was held
   again (``RUNNING``: the step defined, the state restored, the first loop compiled
   and run), and ``kill_programs_loaded`` / ``..._compiled`` are what the new hosts
   (every host of a resumed attempt is a new process) loaded from the cache and
   compiled.
3. The service is stopped and a new one started (new host processes; the same cache
   folder), and the same job submitted again: ``second_submit_to_first_step_s`` and
   its programs loaded and compiled.

The figures carry the mode's prefix (``cache_`` or ``no_cache_``). The hosts cache
every program here (``JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S=0.001``): a CPU compiles
this model's programs in under a second, a TPU a real model's in far more than the
default threshold. Targets, with the cache: the resumed attempt and the second submit
compile nothing, and the first new step comes at most 3 s after the kill.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformer_model
from _common import ServeProcess, kept_log_on_failure, report, target, wait_until

ACCELERATOR = "v4-16"
STEPS = 24
STEPS_PER_RUN = 4
CHECKPOINT_EVERY = 8
BATCHES = 4
JOB_TIMEOUT_S = 600.0
SEEN_TIMEOUT_S = 300.0


def submit(client: Any, name: str) -> Any:
    return client.submit(transformer_model.step, steps=STEPS, accelerator_type=ACCELERATOR,
                         init_fn=transformer_model.init,
                         dataset=transformer_model.batches(BATCHES), mesh={"data": -1},
                         steps_per_run=STEPS_PER_RUN, checkpoint_every=CHECKPOINT_EVERY,
                         outputs={"loss": "MEAN"}, max_retries_preemption=3, name=name)




def finished(job: Any) -> Any:
    final = job.wait(timeout=JOB_TIMEOUT_S, progress=False)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"job {job.id} ended {final.state}: {final.error}")
    return final


def host_pid(job: Any, host: int) -> int | None:
    hosts = job.hosts()
    return hosts[host].pid if len(hosts) > host and hosts[host].pid else None


def killed_job(client: Any, prefix: str) -> dict[str, Any]:
    """Figures 1 and 2: the first submit, then host 1 killed and the job resumed."""
    job = submit(client, f"bench-restart-{prefix}first")
    pid = wait_until(lambda: job.checkpoints() and host_pid(job, 1), SEEN_TIMEOUT_S,
               "a committed checkpoint and host 1's pid")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    final = finished(job)
    first, *rest = job.attempts()
    if not rest or rest[0].first_step_at is None or rest[0].running_at is None:
        raise RuntimeError(f"job {job.id}: no resumed attempt that ran a loop: "
                           f"{job.attempts()}")
    resumed = rest[0]
    if first.first_step_at is None:
        raise RuntimeError(f"job {job.id}: the first attempt never ran a loop")
    return {"first_submit_to_first_step_s": first.first_step_at - final.created_at,
            "first_programs_compiled": first.programs_compiled,
            "kill_to_first_step_s": resumed.first_step_at - killed_at,
            "kill_setup_and_first_loop_s": resumed.first_step_at - resumed.running_at,
            "kill_programs_loaded": resumed.programs_loaded,
            "kill_programs_compiled": resumed.programs_compiled}


def second_job(client: Any, prefix: str) -> dict[str, Any]:
    """Figure 3: the same job on new hosts."""
    job = submit(client, f"bench-restart-{prefix}second")
    final = finished(job)
    attempt = job.attempts()[0]
    if attempt.first_step_at is None:
        raise RuntimeError(f"job {job.id}: its attempt never ran a loop")
    return {"second_submit_to_first_step_s": attempt.first_step_at - final.created_at,
            "second_programs_loaded": attempt.programs_loaded,
            "second_programs_compiled": attempt.programs_compiled}


def measure(cache: str, prefix: str) -> dict[str, Any]:
    """Both jobs, each on a service of its own, with the hosts' cache in ``cache``."""
    import jaxpod

    os.environ.update({"JAXPOD_COMPILATION_CACHE_DIR": cache,
                       "JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S": "0.001"})
    figures: dict[str, Any] = {}
    log = os.path.join(tempfile.gettempdir(), f"jaxpod-bench-restart-{os.getpid()}.log")
    for measure_one in (killed_job, second_job):
        with kept_log_on_failure(ServeProcess(log, ACCELERATOR, provider="processes"),
                                 log) as service, \
                jaxpod.connect(service.address, token=service.token) as client:
            got = measure_one(client, prefix)
        print(f"{prefix}{measure_one.__name__}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()),
            flush=True)
        # With the cache off the hosts count nothing (the attempt records None).
        figures.update({f"{prefix}{k}": v for k, v in got.items() if v is not None})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the cache on only (the off side is the full run's)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="jaxpod-restart-cache-")
    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "steps": STEPS,
                               "steps_per_run": STEPS_PER_RUN, "cores": os.cpu_count()}
    try:
        figures.update(measure(folder, "cache_"))
        if not args.quick:
            figures.update(measure("off", "no_cache_"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if "no_cache_kill_to_first_step_s" in figures:
        figures["kill_to_first_step_saved_s"] = (figures["no_cache_kill_to_first_step_s"]
                                                 - figures["cache_kill_to_first_step_s"])
    targets = {
        "cache_kill_to_first_step_s": target(figures["cache_kill_to_first_step_s"], "<=", 3.0),
        "cache_kill_programs_compiled": target(figures["cache_kill_programs_compiled"],
                                               "<=", 0),
        "cache_second_programs_compiled": target(figures["cache_second_programs_compiled"],
                                                 "<=", 0),
    }
    report("restart", {k: round(v, 4) if isinstance(v, float) else v
                       for k, v in figures.items()}, targets)


if __name__ == "__main__":
    main()
