"""A shared cluster's queue: how fast a high-priority job gets a slice a low-priority job
holds, and what the preempted job loses.

A real ``jaxpod serve --local --slices v4-16`` (2 hosts x 4 chips; its own token and
state dir) runs a long low-priority job: a paced SGD step (30 ms per step held by a
host callback), ``steps_per_run=2``, ``checkpoint_every=20``. Once it is past step 10,
this process submits a short job of priority 5 and follows it (``job.watch()``). Each
round repeats that on a fresh low-priority job (3 rounds; 1 with ``--quick``).

Figures (medians over rounds):

* ``high_submit_to_first_step_s``: from the client's clock just before ``submit`` to
  the high job's first recorded loop as its watch stream shows it: the victim told, its
  checkpoint at its next loop boundary, its slice released, the high job's allocation
  (a warm slice), start and first loop. Target: <= 2 s plus one loop of the victim
  (``victim_loop_s``, from its rate while it ran).
* ``steps_lost_per_priority_preemption``: the victim's steps done before it yielded
  minus the step its next attempt started from (target 0). Its
  ``max_retries_preemption`` is 0: had the preemption been charged as a retry, it
  would have failed instead of resuming (the benchmark then fails).

The last line of output is the JSON report.

Usage: ``python benchmarks/job_queue.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _common import ServeProcess, kept_log_on_failure, report, target

import jaxpod
from jaxpod.timeouts import wait_for

STEPS_PER_RUN = 2
PACE_S = 0.03


def paced_step(state: Any, batch: Any) -> Any:
    """One SGD step of y ~ x @ w, held ``PACE_S`` on the host."""
    import jax

    ctx = jaxpod.get_replica_context()
    x, y = batch["x"], batch["y"]
    mask = ctx.valid_row_mask.astype(x.dtype)
    err = (x @ state["w"] - y) * mask
    grad = ctx.all_reduce("SUM", x.T @ err) / ctx.all_reduce("SUM", mask.sum())

    def pause(v: Any) -> Any:
        time.sleep(PACE_S)
        return v

    wait = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
    return {"w": state["w"] - 0.05 * grad + wait}, {"loss": err ** 2}


def count_step(state: Any, batch: Any) -> Any:
    ctx = jaxpod.get_replica_context()
    return {"n": state["n"] + ctx.all_reduce("SUM", batch.sum())}, {}


def one_round(client: Any, index: int) -> dict[str, float]:
    rng = np.random.default_rng(index)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    low = client.submit(paced_step, steps=10**6, steps_per_run=STEPS_PER_RUN,
                        checkpoint_every=20, accelerator_type="v4-16",
                        initial_state={"w": np.zeros(3, np.float32)},
                        dataset=[{"x": x, "y": x @ np.ones(3, np.float32)}],
                        max_retries_preemption=0, name=f"low-{index}")
    try:
        if not wait_for(lambda: low.status().step >= 10, 180, max_poll_s=0.2):
            raise RuntimeError(f"the low-priority job did not get going: {low.status()}")
        rate = low.status().steps_per_s or float("nan")
        started = time.time()
        high = client.submit(count_step, steps=4, steps_per_run=STEPS_PER_RUN,
                             accelerator_type="v4-16", priority=5,
                             initial_state={"n": np.float32(0)},
                             dataset=[np.ones((8, 1), np.float32)], name=f"high-{index}")
        first_step = None
        for status in high.watch():
            if first_step is None and status.step >= STEPS_PER_RUN:
                first_step = time.time()
        if high.status().state != "SUCCEEDED" or first_step is None:
            raise RuntimeError(f"the high-priority job ended {high.status()}")
        if not wait_for(lambda: len(low.attempts()) >= 2 and low.status().state == "RUNNING",
                        180, max_poll_s=0.2):
            raise RuntimeError(f"the preempted job did not resume: {low.status()}")
        first, second = low.attempts()[:2]
        return {"high_submit_to_first_step_s": first_step - started,
                "victim_loop_s": STEPS_PER_RUN / rate,
                "steps_lost": float((first.step_reached or 0) - (second.start_step or 0))}
    finally:
        low.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round instead of 3")
    args = parser.parse_args()
    rounds = 1 if args.quick else 3
    log_path = os.path.join(tempfile.gettempdir(), f"jaxpod-bench-queue-{os.getpid()}.log")
    print(f"starting jaxpod serve --local (log {log_path})", file=sys.stderr, flush=True)
    with kept_log_on_failure(ServeProcess(log_path, "v4-16"), log_path) as service, \
            jaxpod.connect(service.address, token=service.token) as client:
        samples = []
        for index in range(rounds):
            samples.append(one_round(client, index))
            print(f"round {index}: " + ", ".join(f"{k} {v:.3f}"
                                                 for k, v in samples[-1].items()),
                  file=sys.stderr, flush=True)
    median = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    figures = {"rounds": rounds,
               "high_submit_to_first_step_s": round(median["high_submit_to_first_step_s"], 3),
               "victim_loop_s": round(median["victim_loop_s"], 4),
               "steps_lost_per_priority_preemption": median["steps_lost"]}
    report("job_queue", figures, {
        "high_submit_to_first_step_s": target(
            figures["high_submit_to_first_step_s"], "<=", 2.0 + figures["victim_loop_s"]),
        "steps_lost_per_priority_preemption": target(
            figures["steps_lost_per_priority_preemption"], "<=", 0)})


if __name__ == "__main__":
    main()
