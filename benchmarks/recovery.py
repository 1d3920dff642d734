"""Recovery of jobs: a lost host, a preemption notice, and what a checkpoint costs.

The job figures run on one simulated local TPU cluster (``LocalTPUCluster``: one v4-16,
2 hosts x 4 chips, JAX on CPU) that this script starts and stops itself, served by a
real ``jaxpod serve`` process joined to it through ``RAY_ADDRESS`` (its own token and
temporary ``JAXPOD_STATE_DIR``, default retry back-off: the service as users run it);
this process is the client. What a checkpoint costs against plain orbax is
``benchmarks/checkpoint.py``'s.

The job everybody runs: 60 steps of a deterministic update of a 1 MiB float32 state
(``w <- 0.97 w + 0.05 sin(sum(batch) + w)``, the sum all-reduced over the 8 replicas of
both hosts and held 20 ms by a callback), ``steps_per_run=2``, ``checkpoint_every=20``
(and in-memory checkpoints at the interval the service chooses, its default), a 3-batch
dataset read round and round; every 10th step prints its host worker's pid,
which is how the benchmark finds the process to kill (as
``tests/service/test_job_faults.py`` does). Every job's final state must equal,
``np.array_equal``, that of the first uninterrupted run, or the benchmark fails.

Figures (medians where repeated):

1. ``kill_to_first_step_s``: median over 3 jobs (1 with ``--quick``), each of which
   has its host 1 worker killed with SIGKILL once the job is seen ``RUNNING`` past step
   30. Measured from the client's wall clock just before ``os.kill`` to the moment the
   client's ``job.watch()`` stream first shows the job ``RUNNING`` (or ``SUCCEEDED``)
   in its second attempt with more steps done than the checkpoint it resumed from: the
   first loop (of 2 steps) completed after the resume, as the service reported it. Its
   parts, from the job's history (the service's timestamps; same machine, same clock):
   ``kill_detection_s`` (kill to ``RETRYING``: the attempt seen lost and ended),
   ``kill_backoff_s`` (``RETRYING`` to ``ALLOCATING``: the service's retry back-off, its
   default), ``kill_allocation_s`` (``ALLOCATING`` to ``RUNNING``: a whole slice
   acquired again, its workers started cold), ``kill_setup_and_first_loop_s``
   (``RUNNING`` to that first loop seen: the step shipped and compiled, the state
   restored from the checkpoint, the input rebuilt and skipped, the first loop run and
   recorded). ``kill_host0_*`` is one more job with its host 0 worker killed instead
   (host 0 runs JAX's coordination service and is the first host the coordinator reads
   from, so its loss may be seen by another path); ``notice_*`` the same for the
   notices of figure 2.
   ``kill_programs_loaded`` and ``kill_programs_compiled``: the programs the killed
   jobs' second attempts loaded from the compilation cache (their hosts are new
   processes) and compiled anew, as the attempt records them.
2. ``steps_lost_per_preemption_without_notice`` and ``..._with_notice``: the medians
   of the "N step(s) lost" of the first attempt's recorded cause, for the killed jobs
   above (SIGKILL: the steps since the last periodic checkpoint, at step 20, are lost)
   and for as many jobs whose host 1 worker was instead sent SIGTERM (the preemption
   notice: the job checkpoints at once and gives the slice up) at the same point (seen
   past step 30). Target: 0 with a notice.
3. ``job_checkpointing_s_per_checkpoint``: the warm uninterrupted job's goodput
   ``checkpointing`` seconds (the steps waiting while the hosts copy the state off the
   devices; orbax writes it in the background) per periodic checkpoint it took.
4. ``goodput_productive_share_uninterrupted`` (the job on a warm slice;
   ``..._uninterrupted_cold`` the first job, on the fresh cluster: it starts the
   workers), ``goodput_productive_share_preempted`` (median over the killed jobs) and
   ``..._preempted_with_notice``, from the job's ``status.goodput["productive_share"]``;
   ``goodput_preempted_<category>_s``: where the killed jobs' time went (medians per
   category).

The last line of output is the JSON report.

Usage: ``python benchmarks/recovery.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import follow_job, report
from jobs import rounded, running_service

ACCELERATOR = "v4-16"

STEPS = 60
STEPS_PER_RUN = 2
CHECKPOINT_EVERY = 20
INTERRUPT_AT = 30  # the kill or notice is sent once the job is seen past this step
STEP_PAUSE_S = 0.02
VICTIM_HOST = 1  # the host whose worker is killed or told of its preemption
PID_EVERY = 10  # steps between the pid lines the job prints
STATE_FLOATS = 1 << 18  # 1 MiB of float32
JOB_TIMEOUT_S = 300.0
PARTS_OF_RECOVERY = ("detection_s", "backoff_s", "allocation_s", "setup_and_first_loop_s")

MIB = 1 << 20


# ---------------------------------------------------------------------- the job
def print_pid(step: Any) -> None:
    if int(step) % PID_EVERY == 0:
        print(f"pid {os.getpid()}")


def pid_printing_step(state: Any, batch: Any) -> Any:
    """A deterministic, slightly slow update; every ``PID_EVERY`` steps it prints its
    host's pid (so even a warm slice's workers, which trace nothing again, say who they
    are)."""
    import jax
    import jax.numpy as jnp

    import jaxpod

    jax.debug.callback(print_pid, state["n"])

    def pause(x: Any) -> Any:
        time.sleep(STEP_PAUSE_S)
        return x

    ctx = jaxpod.get_replica_context()
    mask = ctx.valid_row_mask.astype(batch.dtype)
    total = ctx.all_reduce("SUM", (batch * mask).sum())
    # The pause holds a scalar the update depends on (a callback over the whole state
    # stalled the first loop on this setup).
    total = jax.pure_callback(pause, jax.ShapeDtypeStruct(total.shape, total.dtype), total)
    w = state["w"] * 0.97 + jnp.sin(total + state["w"]) * 0.05
    return {"w": w, "n": state["n"] + 1}, {"total": total, "w0": w[0]}


def dataset() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(size=n).astype(np.float32) for n in (16, 16, 8)]


def submit(client: Any, name: str, accelerator: str = ACCELERATOR) -> Any:
    return client.submit(
        pid_printing_step, steps=STEPS, accelerator_type=accelerator,
        steps_per_run=STEPS_PER_RUN,
        initial_state={"w": np.linspace(0, 1, STATE_FLOATS, dtype=np.float32),
                       "n": np.int32(0)},
        dataset=dataset(), outputs={"total": "MAX", "w0": "MEAN"},
        checkpoint_every=CHECKPOINT_EVERY, max_retries_preemption=3, name=name)


def checkpoints_taken(steps: int, steps_per_run: int, every: int) -> int:
    """How many periodic checkpoints an uninterrupted job takes (the runner's rule: at
    a loop boundary ``every`` or more steps after the last one, never at the end)."""
    taken, done, last = 0, 0, 0
    while done < steps:
        done += min(steps_per_run, steps - done)
        if done < steps and done - last >= every:
            taken, last = taken + 1, done
    return taken


def host_pids(job: Any, host: int) -> list[int]:
    """The pids the job's code printed on ``host``, in order of first appearance."""
    pids = [int(m.group(1)) for m in re.finditer(rf"^\[host {host}\] pid (\d+)$", job.logs(),
                                                  re.MULTILINE)]
    return list(dict.fromkeys(pids))


def final_state(job: Any) -> dict[str, np.ndarray]:
    result = job.result(timeout=JOB_TIMEOUT_S)
    if result.steps != STEPS:
        raise RuntimeError(f"job {job.id} ran {result.steps} steps; expected {STEPS}")
    return {k: np.asarray(v) for k, v in result.state.items()}


def check_same(job: Any, got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for key in ("w", "n"):
        if got[key].dtype != expected[key].dtype or not np.array_equal(got[key], expected[key]):
            raise RuntimeError(f"job {job.id}: the final state's {key!r} differs from the "
                               "uninterrupted run's: the resume was not exact")


# ------------------------------------------------------------------ the job runs
def uninterrupted(client: Any, name: str, accelerator: str = ACCELERATOR
                  ) -> tuple[dict[str, np.ndarray], Any, float]:
    start = time.perf_counter()
    job = submit(client, name, accelerator)
    final = follow_job(job, lambda status: None, JOB_TIMEOUT_S)[-1][1]
    elapsed = time.perf_counter() - start
    if final.attempts != 1:
        raise RuntimeError(f"job {job.id} took {final.attempts} attempts uninterrupted")
    return final_state(job), final, elapsed


def interrupted(client: Any, name: str, sig: signal.Signals, host: int,
                expected: dict[str, np.ndarray], accelerator: str = ACCELERATOR
                ) -> dict[str, Any]:
    """One job whose ``host`` worker gets ``sig`` past ``INTERRUPT_AT``; its figures."""
    job = submit(client, name, accelerator)
    sent: list[tuple[float, int]] = []

    def interrupt(status: Any) -> None:
        if not sent and status.state == "RUNNING" and status.step >= INTERRUPT_AT:
            victim = host_pids(job, host)[-1]
            sent.append((time.time(), status.step))
            os.kill(victim, sig)

    seen = follow_job(job, interrupt, JOB_TIMEOUT_S)
    if not sent:
        raise RuntimeError(f"job {job.id} ended before it could be interrupted")
    check_same(job, final_state(job), expected)
    sent_at, seen_step = sent[0]

    first, *rest = job.attempts()
    if len(rest) != 1 or first.cause is None or not first.cause.startswith("preempted:"):
        raise RuntimeError(f"job {job.id}: expected one preemption and one more attempt; "
                           f"got {job.attempts()}")
    # Where the next attempt started: the persistent checkpoint, or the in-memory one
    # (the service's default tier beside it) when its copies survived.
    if first.step_reached is None or rest[0].start_step is None:
        raise RuntimeError(f"job {job.id}: attempts without steps: {job.attempts()}")
    resumed_at = rest[0].start_step
    lost = first.step_reached - resumed_at
    if (sig == signal.SIGTERM) != ("preemption notice" in first.cause):
        raise RuntimeError(f"job {job.id}: {sig.name} recorded as {first.cause!r}")

    history = job.history()
    retrying = next(i for i, t in enumerate(history) if t.to_state == "RETRYING")
    allocating = next(t.at for t in history[retrying:] if t.to_state == "ALLOCATING")
    running = next(t.at for t in history[retrying:] if t.to_state == "RUNNING")
    first_step = next(at for at, s in seen
                      if s.attempts >= 2 and s.state in ("RUNNING", "SUCCEEDED")
                      and s.step > resumed_at and at >= running)
    final = seen[-1][1]
    print(f"{sig.name} at step {seen_step} (reached {first.step_reached}): {lost} step(s) "
          f"lost, resumed at {resumed_at}; first step after {first_step - sent_at:.2f} s",
          flush=True)
    return {"to_first_step_s": first_step - sent_at,  # and PARTS_OF_RECOVERY:
            "detection_s": history[retrying].at - sent_at,
            "backoff_s": allocating - history[retrying].at,
            "allocation_s": running - allocating,
            "setup_and_first_loop_s": first_step - running,
            "steps_lost": lost, "step_reached": first.step_reached,
            "programs_loaded": rest[0].programs_loaded,
            "programs_compiled": rest[0].programs_compiled,
            "goodput": dict(final.goodput or {})}


def measure_jobs(client: Any, repeats: int) -> dict[str, Any]:
    expected, cold, cold_s = uninterrupted(client, "bench-uninterrupted-cold")
    print(f"first (cold) uninterrupted job {cold_s:.1f} s", flush=True)
    again, warm, warm_s = uninterrupted(client, "bench-uninterrupted")
    check_same(warm, again, expected)
    print(f"uninterrupted job (warm slice) {warm_s:.1f} s", flush=True)

    kills = [interrupted(client, f"bench-kill-{i}", signal.SIGKILL, VICTIM_HOST, expected)
             for i in range(repeats)]
    kill_host0 = interrupted(client, "bench-kill-host0", signal.SIGKILL, 0, expected)
    notices = [interrupted(client, f"bench-notice-{i}", signal.SIGTERM, VICTIM_HOST, expected)
               for i in range(repeats)]

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    def goodput_med(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r["goodput"].get(key, 0.0) for r in runs))

    warm_goodput = dict(warm.goodput or {})
    taken = checkpoints_taken(STEPS, STEPS_PER_RUN, CHECKPOINT_EVERY)
    figures: dict[str, Any] = {
        "job_steps": STEPS, "job_steps_per_run": STEPS_PER_RUN,
        "job_checkpoint_every": CHECKPOINT_EVERY, "job_state_mib": STATE_FLOATS * 4 / MIB,
        "interrupted_past_step": INTERRUPT_AT, "interrupted_host": VICTIM_HOST,
        "interruptions_each": repeats,
        "uninterrupted_cold_job_s": cold_s, "uninterrupted_job_s": warm_s,
        "kill_to_first_step_s": med(kills, "to_first_step_s"),
        "kill_to_first_step_s_all": [r["to_first_step_s"] for r in kills],
        # What the restarted hosts loaded from the compilation cache, and compiled.
        "kill_programs_loaded": med(kills, "programs_loaded"),
        "kill_programs_compiled": med(kills, "programs_compiled"),
    }
    for part in PARTS_OF_RECOVERY:
        figures[f"kill_{part}"] = med(kills, part)
    for part in ("to_first_step_s", *PARTS_OF_RECOVERY):
        figures[f"kill_host0_{part}"] = kill_host0[part]
    for part in ("to_first_step_s", *PARTS_OF_RECOVERY):
        figures[f"notice_{part}"] = med(notices, part)
    figures.update({
        "steps_lost_per_preemption_without_notice": med(kills, "steps_lost"),
        "steps_lost_without_notice_all": [r["steps_lost"] for r in kills],
        "steps_lost_per_preemption_with_notice": med(notices, "steps_lost"),
        "steps_lost_with_notice_all": [r["steps_lost"] for r in notices],
        "job_checkpoints_taken": taken,
        "job_checkpointing_s_per_checkpoint": warm_goodput.get("checkpointing", 0.0) / taken,
        "goodput_productive_share_uninterrupted": warm_goodput.get("productive_share", 0.0),
        "goodput_productive_share_uninterrupted_cold":
            dict(cold.goodput or {}).get("productive_share", 0.0),
        "goodput_productive_share_preempted": goodput_med(kills, "productive_share"),
        "goodput_productive_share_preempted_with_notice":
            goodput_med(notices, "productive_share"),
    })
    # Where the killed jobs' wall time went (medians per category: they need not add up).
    for category in sorted(kills[0]["goodput"]):
        if category != "productive_share":
            name = category if category.endswith("_s") else f"{category}_s"
            figures[f"goodput_preempted_{name}"] = goodput_med(kills, category)
    return figures


# ------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    args = parser.parse_args()
    interruptions = 1 if args.quick else 3

    import jaxpod
    from jaxpod.service.capacity.local_cluster import LocalTPUCluster

    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "cores": os.cpu_count()}
    start = time.perf_counter()
    # A fresh compilation cache that keeps every program: a CPU compiles these in
    # milliseconds (a TPU's programs take seconds, past the default threshold).
    cache = tempfile.mkdtemp(prefix="jaxpod-recovery-cache-")
    os.environ.update({"JAXPOD_COMPILATION_CACHE_DIR": cache,
                       "JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S": "0.001"})
    with LocalTPUCluster(ACCELERATOR) as cluster:
        figures["cluster_start_s"] = time.perf_counter() - start
        print(f"simulated {ACCELERATOR} up in {figures['cluster_start_s']:.1f} s "
              f"({cluster.address})", flush=True)
        with running_service(cluster.address, "recovery") as service, \
                jaxpod.connect(service.address, token=service.token) as client:
            figures.update(measure_jobs(client, interruptions))
    lost = figures["steps_lost_per_preemption_with_notice"]
    targets = {"steps_lost_per_preemption_with_notice": {
        "value": lost, "target": "== 0", "met": lost == 0}}
    shutil.rmtree(cache, ignore_errors=True)
    report("recovery", rounded(figures), targets)


if __name__ == "__main__":
    main()
