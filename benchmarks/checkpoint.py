"""Checkpoints written and restored by the hosts (orbax), against plain orbax.

Two parts run one after the other on this machine, never at once:

* **plain** (the lower bound): two ``jax.distributed`` processes (4 CPU devices each,
  gloo) hold the state as jobs write it, one replica's copy as a global array
  replicated over all 8 devices, and call ``orbax.checkpoint.CheckpointManager``
  themselves: ``save`` (``StandardSave``, asynchronous, replica-parallel: each device
  writes its share of the replicated array) until it returns, then until
  ``wait_until_finished`` (committed), then ``restore`` onto the same shardings; and
  the device-to-host copy a save needs (each device's share of the replica-parallel
  write, copied to numpy; the slower process). orbax is set up as the hosts set it up
  (barriers on the coordination service, 4 MiB chunks: :func:`best_settings`), so a
  ratio measures jaxpod around orbax, not a setting.
* **jobs**: the same state through jobs on a simulated v4-16 (2 hosts x 4 chips, the
  same 8 devices) served by a real ``jaxpod serve``: a job whose ``init_fn`` makes the
  state and whose step holds each step for half the plain save time, so the writes of
  its periodic checkpoints (every 4 steps) end before the next one is asked for.

Figures (medians over repeats, the plain ones over at least 3 in a full run; state 1 GiB,
64 MiB with ``--quick``, one repeat of each, the longer job 28 steps):

1. ``save_throughput_vs_orbax`` (target >= 0.9): plain save-to-commit seconds over the
   job's final checkpoint's seconds (goodput ``result``: from its last loop to the
   hosts' commit, the step wait for the previous write included if any).
2. ``stall_vs_d2h`` (target <= 1.2): the job's steady step wait per periodic
   checkpoint (the median of each kept periodic checkpoint's own ``stall_s``, a job's
   first left out: from the loop boundary until the hosts set the state apart and
   orbax's save call returned) over the plain device-to-host copy time (what any save
   must wait for). ``stall_vs_orbax_save_call`` compares it with the plain ``save``
   call instead; ``job_first_checkpoint_extra_s`` is what a job's first checkpoint
   costs more (orbax's manager made, the layout program compiled).
3. ``restore_vs_orbax`` (target <= 1.1): a resumed attempt's ``restoring`` seconds (a
   preemption notice sent to host 1 after its second step; the next attempt restores
   the state and input positions) over plain orbax restoring the same job's
   checkpoints (its final step, as big) in two fresh ``jax.distributed`` processes
   right after the job, with the service's cluster as idle around it as the job's
   restore had it. ``restore_vs_orbax_before_cluster`` compares with the plain part's
   restores instead, run on the machine before the cluster started.
4. ``resume_to_first_step_far_vs_near`` (target <= 1.2): from a resumed attempt's
   ``RUNNING`` to its first loop seen by the client, for a job on a random-access
   input whose elements each cost ~1 ms to make, notified at step 10 vs step 10,000
   (500 with ``--quick``): an input that seeks reads nothing before its checkpoint.

Every job's final checkpoint is opened with plain orbax in this process and compared
with numpy, or the benchmark fails. The last line of output is the JSON report.

Usage: ``python benchmarks/checkpoint.py [--quick] [--parts plain,jobs]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import follow_job, free_port, parse_parts, report, run_processes, target
from jobs import rounded, running_service

from jaxpod.worker.checkpoints import CHUNK_BYTES

ACCELERATOR = "v4-16"
PARTS = ("plain", "jobs")
HOSTS, CHIPS = 2, 4
REPLICAS = HOSTS * CHIPS
MIB = 1 << 20
STEPS, LONG_STEPS, CHECKPOINT_EVERY = 12, 44, 4
QUICK_LONG_STEPS = 28  # 6 periodic checkpoints against the short job's 2
D2H_SAMPLES = 3  # per round: the copy is short and the machine shared
NOTICE_AFTER = 2  # the restore job's notice: once running past this step
NEAR_STEP = 10
ELEMENT_COST_FLOATS = 200_000  # np.sin over this many floats: ~1 ms per element
JOB_TIMEOUT_S = 900.0
RESUME_PAUSE_S = 0.05


# --------------------------------------------------------------------- the state
def state_floats(mib: int) -> int:
    return mib * MIB // 4


def expected_w(n: int, steps: int) -> np.ndarray:
    """numpy: the state's ``w`` after ``steps`` steps (each adds the batch's sum, 8)."""
    w = (np.arange(n, dtype=np.int32) % 1000).astype(np.float32) * np.float32(1e-3)
    for _ in range(steps):
        w = w * np.float32(0.5) + np.float32(REPLICAS)
    return w


# ------------------------------------------------------------------ plain orbax
def plain_process(process_id: int, port: int, mib: int, repeats: int, folder: str,
                  role: str) -> None:
    """One of the two plain ``jax.distributed`` processes; prints its figures as JSON.

    ``role`` ``save``: saves ``repeats`` times after a warm-up (and restores each step
    in the same process: ``warm_restore_s``). ``restore``: a fresh process restoring
    the newest step as a resumed program does, from its first orbax import on.
    ``restore-job``: the same, of a big-state job's checkpoints (``folder``: the job's
    checkpoint folder; its state ``{"w", "n"}`` after as many steps as the step).
    """
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", CHIPS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=HOSTS,
                               process_id=process_id)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = state_floats(mib)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("replica",)), P())
    local = (np.arange(n, dtype=np.int32) % 1000).astype(np.float32) * np.float32(1e-3)
    abstract = {"w": jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding)}
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        multihost_utils.sync_global_devices(name)
        start = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
        return out

    def check(restored: dict[str, Any]) -> None:
        if not np.array_equal(np.asarray(restored["w"].addressable_shards[0].data), local):
            raise RuntimeError("plain orbax restored other values than it saved")

    if role.startswith("restore"):
        if role == "restore-job":
            abstract["n"] = jax.ShapeDtypeStruct((), np.int32, sharding=sharding)
            step = max(int(name) for name in os.listdir(folder) if name.isdigit())
            local = expected_w(n, step)

        def cold_restore() -> Any:
            import orbax.checkpoint as ocp

            best_settings()

            manager = ocp.CheckpointManager(folder, item_names=("state",))
            restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
            jax.block_until_ready(restored)
            manager.close()
            return restored

        check(timed("cold_restore_s", cold_restore))
    else:
        import orbax.checkpoint as ocp

        w = jax.make_array_from_single_device_arrays(
            (n,), sharding, [jax.device_put(local, d) for d in jax.local_devices()])
        share = n // REPLICAS

        def d2h() -> None:  # each device's part of the replica-parallel write, to numpy
            for shard in w.addressable_shards:
                r = shard.device.id
                np.array(shard.data[r * share:(r + 1) * share])

        best_settings()
        manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=True, create=True),
            item_names=("state",))
        chunked = {"w": ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)}

        def save(step: int) -> None:  # the call, then until committed
            multihost_utils.sync_global_devices(f"save {step}")
            start = time.perf_counter()
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": w}, save_args=chunked)))
            times.setdefault("save_call_s", []).append(time.perf_counter() - start)
            manager.wait_until_finished()
            times.setdefault("save_s", []).append(time.perf_counter() - start)

        def restore(step: int) -> Any:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
            return jax.block_until_ready(restored)

        for step in range(repeats + 1):  # the first round warms up
            for _ in range(D2H_SAMPLES):
                timed("d2h_s", d2h)
            save(step)
            check(timed("warm_restore_s", functools.partial(restore, step)))
        manager.close()
        warm = {"d2h_s": D2H_SAMPLES}
        times = {k: v[warm.get(k, 1):] for k, v in times.items()}  # without the warm-up
    print("PLAIN " + json.dumps({k: statistics.median(v) for k, v in times.items()}),
          flush=True)


def best_settings() -> None:
    """Plain orbax set up as the hosts set it up (``jaxpod.worker.checkpoints``): its
    barriers on ``jax.distributed``'s coordination service, not a device collective
    (over gloo on CPU, each costs a collective round); with 4 MiB chunks (below), so
    each host writes many chunks at once. The same library at the same settings: the
    ratios say what jaxpod adds or saves around it, not what a setting does."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["plain"], known_only=True)
    flags.FLAGS.set_default(multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name, True)


def plain_run(mib: int, repeats: int, folder: str, role: str) -> dict[str, float]:
    """Two plain processes in ``role``: the slower process's figures."""
    port = free_port()
    outs = run_processes(
        "checkpoint", "plain_process(*map(int, sys.argv[1:5]), *sys.argv[5:7])",
        [[str(i), str(port), str(mib), str(repeats), folder, role] for i in range(HOSTS)],
        JOB_TIMEOUT_S)
    figures = [json.loads(line.split(" ", 1)[1]) for out in outs
               for line in out.splitlines() if line.startswith("PLAIN ")]
    return {k: max(f[k] for f in figures) for k in figures[0]}


def measure_plain(mib: int, repeats: int) -> dict[str, float]:
    """The plain figures: saves in one pair of processes, then cold restores, each in
    a fresh pair (medians)."""
    folder = tempfile.mkdtemp(prefix="jaxpod-bench-plain-")
    try:
        figures = plain_run(mib, repeats, folder, "save")
        colds = [plain_run(mib, 1, folder, "restore")["cold_restore_s"]
                 for _ in range(repeats)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    figures["restore_s"] = statistics.median(colds)
    return figures


# ------------------------------------------------------------------------- jobs
def print_pid() -> None:
    print(f"pid {os.getpid()}")


def big_init_fn(n: int) -> Callable[[], dict[str, Any]]:
    def big_init() -> dict[str, Any]:
        import jax.numpy as jnp

        w = (jnp.arange(n, dtype=jnp.int32) % 1000).astype(jnp.float32) * 1e-3
        return {"w": w, "n": jnp.int32(0)}

    return big_init


def paced_step_fn(pause_s: float) -> Callable[[Any, Any], Any]:
    def paced_step(state: Any, batch: Any) -> Any:
        import jax

        import jaxpod

        jax.debug.callback(print_pid)

        def pause(x: Any) -> Any:
            time.sleep(pause_s)
            return x

        total = jaxpod.get_replica_context().all_reduce("SUM", batch.sum())
        total = jax.pure_callback(pause, jax.ShapeDtypeStruct(total.shape, total.dtype),
                                  total)
        return {"w": state["w"] * 0.5 + total, "n": state["n"] + 1}, {}

    return paced_step


def host_pid(job: Any, host: int) -> int:
    pids = re.findall(rf"^\[host {host}\] pid (\d+)$", job.logs(), re.MULTILINE)
    return int(pids[-1])


def notify_past(job: Any, step: int) -> Callable[[Any], None]:
    """A status callback that sends host 1 a preemption notice (SIGTERM) once."""
    sent: list[int] = []

    def on_status(status: Any) -> None:
        if not sent and status.state == "RUNNING" and status.step > step:
            sent.append(status.step)
            os.kill(host_pid(job, 1), signal.SIGTERM)

    return on_status


def check_final_checkpoint(job: Any, n: int, steps: int) -> None:
    """The job's last checkpoint, opened with plain orbax here, equals numpy's state."""
    import orbax.checkpoint as ocp

    saved = job.checkpoints()[-1]
    state = ocp.StandardCheckpointer().restore(saved.path)
    if saved.step != steps or int(state["n"]) != steps or not np.array_equal(
            np.asarray(state["w"]), expected_w(n, steps)):
        raise RuntimeError(f"job {job.id}: its final checkpoint differs from numpy's state")


def big_state_job(client: Any, n: int, pause_s: float, name: str, notice: bool,
                  steps: int = STEPS) -> dict[str, float]:
    job = client.submit(paced_step_fn(pause_s), steps=steps, accelerator_type=ACCELERATOR,
                        init_fn=big_init_fn(n), dataset=[np.ones(REPLICAS, np.float32)],
                        checkpoint_every=None if notice else CHECKPOINT_EVERY,
                        max_retries_preemption=2, name=name)
    follow_job(job, notify_past(job, NOTICE_AFTER) if notice else lambda status: None,
               JOB_TIMEOUT_S)
    check_final_checkpoint(job, n, steps)
    goodput: dict[str, Any] = dict(job.status().goodput or {})
    # The periodic checkpoints the job keeps, but a job's first (it also creates
    # orbax's manager and compiles the layout program) and the final one (the result,
    # waited for until committed): how long each held the steps, as the job recorded.
    goodput["stalls"] = [c.stall_s for c in job.checkpoints()
                         if CHECKPOINT_EVERY < c.step < steps and c.stall_s is not None]
    attempts = len(job.attempts())
    if attempts != (2 if notice else 1):
        raise RuntimeError(f"job {job.id} took {attempts} attempts")
    if notice:  # the lower bound: plain orbax restoring the same files, right after
        folder = os.path.dirname(os.path.dirname(job.checkpoints()[-1].path))
        goodput["plain_restore"] = plain_run(n * 4 // MIB, 1, folder,
                                             "restore-job")["cold_restore_s"]
    print(f"{name}: " + ", ".join(f"{k} {goodput.get(k, 0):.3f} s" for k in (
        "checkpointing", "restoring", "plain_restore", "result")), flush=True)
    return goodput


class CostlyBatches:
    """A random-access input whose every element costs ~1 ms to make (a decode)."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> np.ndarray:
        work = np.sin(np.arange(ELEMENT_COST_FLOATS, dtype=np.float32) + i)
        return np.full(REPLICAS, float(work[0] > 2), np.float32) + i % 7


def counting_step_fn(slow_from: int) -> Callable[[Any, Any], Any]:
    """A step that counts and sums its input; from step ``slow_from`` on it holds each
    step ``RESUME_PAUSE_S`` (time to notice it and send the notice)."""
    def counting_step(state: Any, batch: Any) -> Any:
        import jax

        import jaxpod

        jax.debug.callback(print_pid)

        def pause(n: Any) -> Any:
            if int(n) >= slow_from:
                time.sleep(RESUME_PAUSE_S)
            return n

        n = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.int32), state["n"])
        total = jaxpod.get_replica_context().all_reduce("SUM", batch.sum())
        return {"n": n + 1, "total": state["total"] + total}, {}

    return counting_step


def resume_job(client: Any, notify_at: int, name: str) -> float:
    """Seconds from a resumed attempt's ``RUNNING`` to its first loop seen, for a job
    notified past ``notify_at``."""
    steps = notify_at + 60
    job = client.submit(counting_step_fn(notify_at), steps=steps, accelerator_type=ACCELERATOR,
                        steps_per_run=10, dataset=CostlyBatches(),
                        initial_state={"n": np.int32(0), "total": np.float32(0)},
                        max_retries_preemption=2, name=name)
    seen = follow_job(job, notify_past(job, notify_at), JOB_TIMEOUT_S)
    first = job.attempts()[0]
    resumed = re.search(r"the next attempt starts at step (\d+)", first.cause or "")
    if resumed is None or int(resumed.group(1)) < notify_at:
        raise RuntimeError(f"job {job.id}: unexpected first attempt {first}")
    at = int(resumed.group(1))
    history = job.history()
    running = [t.at for t in history if t.to_state == "RUNNING"][-1]
    first_loop = next(t for t, s in seen if s.attempts >= 2 and s.step > at and t >= running)
    state = job.result().state
    if int(state["n"]) != steps:
        raise RuntimeError(f"job {job.id} ran {int(state['n'])} steps, not {steps}")
    print(f"{name}: resumed at step {at}, first loop after "
          f"{first_loop - running:.2f} s", flush=True)
    return first_loop - running


def measure_jobs(client: Any, mib: int, repeats: int, plain: dict[str, float],
                 far: int, long_steps: int = LONG_STEPS) -> dict[str, Any]:
    n = state_floats(mib)
    # Each step waits half the plain save: 4 steps between checkpoints are two saves.
    pause_s = max(0.05, plain.get("save_s", 1.0) / 2)
    saving = [big_state_job(client, n, pause_s, f"bench-save-{i}", notice=False)
              for i in range(repeats)]
    longer = [big_state_job(client, n, pause_s, f"bench-save-long-{i}", notice=False,
                            steps=long_steps) for i in range(repeats)]
    restoring = [big_state_job(client, n, pause_s, f"bench-restore-{i}", notice=True)
                 for i in range(repeats)]
    near = [resume_job(client, NEAR_STEP, f"bench-resume-near-{i}") for i in range(repeats)]
    farther = [resume_job(client, far, f"bench-resume-far-{i}") for i in range(repeats)]
    # Periodic checkpoints (none at the last step: the final one is the result's).
    periodic = STEPS // CHECKPOINT_EVERY - 1
    more = long_steps // CHECKPOINT_EVERY - 1 - periodic

    def med(runs: list[dict[str, Any]], key: str, per: int = 1) -> float:
        return float(statistics.median(r.get(key, 0.0) / per for r in runs))

    # The steady stall per checkpoint: each periodic checkpoint's own record of how
    # long it held the steps (never a difference of two jobs' totals, which noise
    # could make negative); a job's first is left out (it also creates orbax's manager
    # and compiles the layout program): the whole first checkpointing minus the
    # steady ones is what it costs more.
    stalls = [s for r in saving + longer for s in r["stalls"]]
    stall = float(statistics.median(stalls))
    return {
        "step_pause_s": pause_s,
        "job_save_s": med(saving + longer, "result"),
        "job_stall_per_checkpoint_s": stall,
        "job_stall_samples": len(stalls),
        "job_checkpointing_per_checkpoint_s": (med(longer, "checkpointing")
                                               / (periodic + more)),
        "job_first_checkpoint_extra_s": med(saving, "checkpointing") - periodic * stall,
        "job_restore_s": med(restoring, "restoring"),
        "plain_restore_job_checkpoint_s": med(restoring, "plain_restore"),
        "resume_near_step": NEAR_STEP, "resume_far_step": far,
        "resume_to_first_step_near_s": float(statistics.median(near)),
        "resume_to_first_step_far_s": float(statistics.median(farther)),
    }


# ------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_parts(parser, PARTS)
    mib = 64 if args.quick else 1024
    repeats = 1 if args.quick else 3
    far = 500 if args.quick else 10_000
    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "state_mib": mib,
                               "repeats": repeats, "cores": os.cpu_count()}
    targets: dict[str, Any] = {}
    plain: dict[str, float] = {}
    if "plain" in args.parts:
        plain = measure_plain(mib, repeats if args.quick else max(3, repeats))
        figures.update({f"plain_{k}": v for k, v in plain.items()})
        print(f"plain orbax: {plain}", flush=True)
    if "jobs" in args.parts:
        import jaxpod
        from jaxpod.service.capacity.local_cluster import LocalTPUCluster

        with LocalTPUCluster(ACCELERATOR) as cluster, \
                running_service(cluster.address, "checkpoint") as service, \
                jaxpod.connect(service.address, token=service.token) as client:
            figures.update(measure_jobs(client, mib, repeats, plain, far,
                                        QUICK_LONG_STEPS if args.quick else LONG_STEPS))
        figures["resume_to_first_step_far_vs_near"] = (
            figures["resume_to_first_step_far_s"] / figures["resume_to_first_step_near_s"])
        targets["resume_to_first_step_far_vs_near"] = target(
            figures["resume_to_first_step_far_vs_near"], "<=", 1.2)
        figures["restore_vs_orbax"] = (figures["job_restore_s"]
                                       / figures["plain_restore_job_checkpoint_s"])
        targets["restore_vs_orbax"] = target(figures["restore_vs_orbax"], "<=", 1.1)
    if plain and "jobs" in args.parts:
        figures["save_throughput_vs_orbax"] = plain["save_s"] / figures["job_save_s"]
        figures["stall_vs_d2h"] = figures["job_stall_per_checkpoint_s"] / plain["d2h_s"]
        figures["stall_vs_orbax_save_call"] = (figures["job_stall_per_checkpoint_s"]
                                               / plain["save_call_s"])
        figures["restore_vs_orbax_before_cluster"] = (figures["job_restore_s"]
                                                      / plain["restore_s"])
        targets["save_throughput_vs_orbax"] = target(figures["save_throughput_vs_orbax"],
                                                     ">=", 0.9)
        targets["stall_vs_d2h"] = target(figures["stall_vs_d2h"], "<=", 1.2)
    report("checkpoint", rounded(figures), targets)


if __name__ == "__main__":
    main()
