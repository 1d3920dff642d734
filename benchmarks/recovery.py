"""Recovery of jobs: a lost host, a preemption notice, and what a checkpoint costs.

The job figures run on one simulated local TPU cluster (``LocalTPUCluster``: one v4-16,
2 hosts x 4 chips, JAX on CPU) that this script starts and stops itself, served by a
real ``jaxpod serve`` process joined to it through ``RAY_ADDRESS`` (its own token and
temporary ``JAXPOD_STATE_DIR``, default retry back-off: the service as users run it);
this process is the client. The checkpoint figure needs no cluster: it calls the
service's ``JobCheckpoints`` directly.

The job everybody runs: 60 steps of a deterministic update of a 1 MiB float32 state
(``w <- 0.97 w + 0.05 sin(sum(batch) + w)``, the sum all-reduced over the 8 replicas of
both hosts and held 20 ms by a callback), ``steps_per_run=2``, ``checkpoint_every=20``,
a 3-batch dataset read round and round; every 10th step prints its host worker's pid,
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
2. ``steps_lost_per_preemption_without_notice`` and ``..._with_notice``: the medians
   of the "N step(s) lost" of the first attempt's recorded cause, for the killed jobs
   above (SIGKILL: the steps since the last periodic checkpoint, at step 20, are lost)
   and for as many jobs whose host 1 worker was instead sent SIGTERM (the preemption
   notice: the job checkpoints at once and gives the slice up) at the same point (seen
   past step 30). Target: 0 with a notice.
3. ``checkpoint_save_vs_np_save`` (target <= 1.5): ``JobCheckpoints.save(step,
   state)`` on a nest of float32 arrays (``{"params": {w0, w1}, "opt": {m, v},
   "step"}``, four equal arrays) of 64 MiB and 256 MiB (16 MiB and 64 MiB with
   ``--quick``), against writing the same arrays with ``np.save`` (one ``.npy`` file
   each) to the same file system, each file then fsynced (``np.save + fsync``). A
   checkpoint is durable when ``save`` returns (every file and folder fsynced, the
   commit marker last), so the fair baseline is the one that also reaches the disk;
   plain ``np.save`` (left in the page cache) is reported beside it
   (``..._vs_np_save_no_fsync``). Each candidate writes fresh files; between timed
   calls ``os.sync()`` runs untimed, so no candidate pays for another's write-back.
   Median of 5 repeats (3 with ``--quick``), the candidates in alternation; the figure
   is the largest ratio over the sizes (each size is also reported).
   ``job_checkpointing_s_per_checkpoint`` is the end-to-end cost inside a job: the
   warm uninterrupted job's goodput ``checkpointing`` seconds (the steps waiting while
   the state is fetched from the slice; the write itself runs in the background) per
   checkpoint it took.
4. ``goodput_productive_share_uninterrupted`` (the job on a warm slice;
   ``..._uninterrupted_cold`` the first job, on the fresh cluster: it starts the
   workers), ``goodput_productive_share_preempted`` (median over the killed jobs) and
   ``..._preempted_with_notice``, from the job's ``status.goodput["productive_share"]``;
   ``goodput_preempted_<category>_s``: where the killed jobs' time went (medians per
   category).

The last line of output is the JSON report.

Usage: ``python benchmarks/recovery.py [--quick] [--parts checkpoint,jobs]``
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_parts, report, target
from jobs import rounded, running_service

ACCELERATOR = "v4-16"
PARTS = ("checkpoint", "jobs")

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

SAVE_RATIO_TARGET = 1.5
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


def submit(client: Any, name: str) -> Any:
    return client.submit(
        pid_printing_step, steps=STEPS, accelerator_type=ACCELERATOR,
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


def watched(job: Any, on_status: Any) -> list[tuple[float, Any]]:
    """Follows ``job`` to its end: ``(client wall time, status)`` per change; calls
    ``on_status(status)`` on each. Cancels the job if it takes over ``JOB_TIMEOUT_S``."""
    timer = threading.Timer(JOB_TIMEOUT_S, job.cancel)
    timer.daemon = True
    timer.start()
    seen: list[tuple[float, Any]] = []
    try:
        for status in job.watch():
            seen.append((time.time(), status))
            on_status(status)
    finally:
        timer.cancel()
    final = seen[-1][1]
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"job {job.id} ended {final.state}: {final.error}")
    return seen


# ------------------------------------------------------------------ the job runs
def uninterrupted(client: Any, name: str) -> tuple[dict[str, np.ndarray], Any, float]:
    start = time.perf_counter()
    job = submit(client, name)
    final = watched(job, lambda status: None)[-1][1]
    elapsed = time.perf_counter() - start
    if final.attempts != 1:
        raise RuntimeError(f"job {job.id} took {final.attempts} attempts uninterrupted")
    return final_state(job), final, elapsed


def interrupted(client: Any, name: str, sig: signal.Signals, host: int,
                expected: dict[str, np.ndarray]) -> dict[str, Any]:
    """One job whose ``host`` worker gets ``sig`` past ``INTERRUPT_AT``; its figures."""
    job = submit(client, name)
    sent: list[tuple[float, int]] = []

    def interrupt(status: Any) -> None:
        if not sent and status.state == "RUNNING" and status.step >= INTERRUPT_AT:
            victim = host_pids(job, host)[-1]
            sent.append((time.time(), status.step))
            os.kill(victim, sig)

    seen = watched(job, interrupt)
    if not sent:
        raise RuntimeError(f"job {job.id} ended before it could be interrupted")
    check_same(job, final_state(job), expected)
    sent_at, seen_step = sent[0]

    first, *rest = job.attempts()
    if len(rest) != 1 or first.cause is None or not first.cause.startswith("preempted:"):
        raise RuntimeError(f"job {job.id}: expected one preemption and one more attempt; "
                           f"got {job.attempts()}")
    cause = re.search(r"(\d+) step\(s\) lost, the next attempt starts at step (\d+)",
                      first.cause)
    if cause is None:
        raise RuntimeError(f"job {job.id}: unexpected cause {first.cause!r}")
    lost, resumed_at = int(cause.group(1)), int(cause.group(2))
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


# ------------------------------------------------------------------- checkpoints
def checkpoint_state(mib: int) -> dict[str, Any]:
    """A training state of ``mib`` MiB: four equal float32 arrays and a step."""
    n = mib * MIB // 4 // 4
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(4)]
    return {"params": {"w0": arrays[0], "w1": arrays[1]},
            "opt": {"m": arrays[2], "v": arrays[3]}, "step": np.int32(1)}


def leaves(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"w0": state["params"]["w0"], "w1": state["params"]["w1"],
            "m": state["opt"]["m"], "v": state["opt"]["v"],
            "step": np.asarray(state["step"])}


def np_save_all(folder: Path, arrays: dict[str, np.ndarray], fsync: bool) -> None:
    folder.mkdir()
    for name, array in arrays.items():
        with open(folder / f"{name}.npy", "wb") as f:
            np.save(f, array)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def save_candidates(root: Path, state: dict[str, Any], checkpoints: Any
                    ) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """``name -> (prepare, write)``: ``prepare`` (untimed) removes what the last
    ``write`` left where that is not the writer's own job."""
    arrays = leaves(state)
    steps = iter(range(1, 1 << 30))

    def np_candidate(kind: str, fsync: bool) -> tuple[Callable[[], None], Callable[[], None]]:
        folder = root / kind
        return (lambda: shutil.rmtree(folder, ignore_errors=True),
                lambda: np_save_all(folder, arrays, fsync))

    def save_checkpoint() -> None:
        # A new step each time; save() prunes the checkpoints beyond the last 2.
        checkpoints.save(next(steps), state)

    root.mkdir(parents=True)
    return {
        "checkpoint": (lambda: None, save_checkpoint),
        "np_save_fsync": np_candidate("fsync", fsync=True),
        "np_save": np_candidate("plain", fsync=False),
    }


def measure_checkpoint_save(sizes_mib: list[int], repeats: int) -> dict[str, Any]:
    from jaxpod.service.jobs.checkpoints import JobCheckpoints

    figures: dict[str, Any] = {"checkpoint_sizes_mib": sizes_mib, "checkpoint_repeats": repeats}
    ratios = []
    root = Path(tempfile.mkdtemp(prefix="jaxpod-bench-ckpt-"))
    try:
        for mib in sizes_mib:
            state = checkpoint_state(mib)
            checkpoints = JobCheckpoints(root / f"ckpt-{mib}")
            candidates = save_candidates(root / str(mib), state, checkpoints)
            times: dict[str, list[float]] = {name: [] for name in candidates}
            try:
                for i in range(repeats + 1):  # the first round warms up
                    for name, (prepare, call) in candidates.items():
                        prepare()  # untimed: removes that candidate's last files
                        os.sync()
                        start = time.perf_counter()
                        call()
                        elapsed = time.perf_counter() - start
                        if i:
                            times[name].append(elapsed)
                latest = checkpoints.latest()
                assert latest is not None
                if not all(np.array_equal(latest.state[g][k], state[g][k])
                           for g in ("params", "opt") for k in state[g]):
                    raise RuntimeError("a checkpoint read back differs from the saved state")
            finally:
                checkpoints.remove_all()
                checkpoints.close()
            med = {name: statistics.median(t) for name, t in times.items()}
            ratio = med["checkpoint"] / med["np_save_fsync"]
            ratios.append(ratio)
            figures.update({
                f"checkpoint_save_s_{mib}mib": med["checkpoint"],
                f"np_save_fsync_s_{mib}mib": med["np_save_fsync"],
                f"np_save_s_{mib}mib": med["np_save"],
                f"checkpoint_save_vs_np_save_{mib}mib": ratio,
                f"checkpoint_save_vs_np_save_no_fsync_{mib}mib":
                    med["checkpoint"] / med["np_save"],
                f"checkpoint_save_mib_per_s_{mib}mib": mib / med["checkpoint"],
            })
            print(f"{mib} MiB: checkpoint {med['checkpoint']:.3f} s, np.save + fsync "
                  f"{med['np_save_fsync']:.3f} s, np.save {med['np_save']:.3f} s "
                  f"(ratio {ratio:.2f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures["checkpoint_save_vs_np_save"] = max(ratios)
    return figures


# ------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_parts(parser, PARTS)
    parts = args.parts
    interruptions = 1 if args.quick else 3
    sizes_mib = [16, 64] if args.quick else [64, 256]
    save_repeats = 3 if args.quick else 5

    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "cores": os.cpu_count()}
    targets: dict[str, Any] = {}
    if "checkpoint" in parts:
        figures.update(measure_checkpoint_save(sizes_mib, save_repeats))
        targets["checkpoint_save_vs_np_save"] = target(
            figures["checkpoint_save_vs_np_save"], "<=", SAVE_RATIO_TARGET)
    if "jobs" in parts:
        import jaxpod
        from jaxpod.service.local_cluster import LocalTPUCluster

        start = time.perf_counter()
        with LocalTPUCluster(ACCELERATOR) as cluster:
            figures["cluster_start_s"] = time.perf_counter() - start
            print(f"simulated {ACCELERATOR} up in {figures['cluster_start_s']:.1f} s "
                  f"({cluster.address})", flush=True)
            with running_service(cluster.address, "recovery") as service, \
                    jaxpod.connect(service.address, token=service.token) as client:
                figures.update(measure_jobs(client, interruptions))
        lost = figures["steps_lost_per_preemption_with_notice"]
        targets["steps_lost_per_preemption_with_notice"] = {
            "value": lost, "target": "== 0", "met": lost == 0}
    report("recovery", rounded(figures), targets)


if __name__ == "__main__":
    main()
