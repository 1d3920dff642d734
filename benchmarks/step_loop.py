"""The interactive remote loop: a TF2 custom training loop, one call per step.

Three figures, in one run:

1. ``loop_remote_vs_inprocess`` (target <= 1.3): milliseconds per step of the custom
   training loop pattern — ``batch = next(iterator)``, ``state, out =
   strategy.run(train_step, args=(state, batch))`` with the state passed as handles,
   the loss reduced every 10 steps and once at the end — through ``jaxpod.connect()``
   (the embedded service simulating one v6e-8 host) over the same loop on an
   in-process ``jaxpod.TPUStrategy`` with the same 8 CPU devices (a child process,
   as a single-host worker runs it). Loops of both alternate, never concurrent;
   medians. ``loop_cpu_<role>_ms_per_step`` says where the CPU goes: the client, the
   coordinator, the host workers and Ray's daemons in the remote loop, against the
   in-process loop's (``inprocess``); ``loop_cpu_remote_vs_inprocess`` (target <= 1.3)
   is their sum over it: what a remote step costs the machine against a local one.
   That sum over the machine's cores bounds the remote loop's wall time from below:
   ``loop_cpu_floor_vs_inprocess`` is that bound over the in-process time per step,
   the least ratio this machine allows with every core busy all the time.
2. ``trivial_run_reduce_p50_ms`` (target <= 1.0): a synchronous ``run`` of an identity
   on a small ``PerReplica`` and ``reduce`` of its result, remote, p50 over many
   calls. For context, the in-process figure twice: back to back
   (``inprocess_trivial_run_reduce_p50_ms``), and with each call after an idle gap
   (``inprocess_trivial_after_idle_ms``) as long as the remote call takes beyond the
   in-process one (``trivial_idle_gap_ms``). A remote host idles that long between
   calls, and on this machine's simulated CPU devices the same two calls cost 1.5 to
   2 times as much after an idle gap as back to back: the second figure is what the
   host's part of a remote call costs at least.
3. ``cold_connect_to_first_result_s`` (target <= 4): a fresh interpreter that runs
   ``import jaxpod; client = jaxpod.connect(); strategy = client.strategy()`` and
   reduces one ``run``, with no service running: from starting the interpreter to
   the first result, with each phase reported (median over fresh runs). The
   embedded service's default cluster (one v4-16: two simulated hosts, plain processes
   since the embedded service runs ``--provider processes``) is the target's;
   ``cold_single_host_*`` are the same with one v6e-8 host, and ``cold_ray_*`` the
   default cluster on a local Ray cluster (``JAXPOD_LOCAL_PROVIDER=ray``), for
   comparison.

The last line of output is the JSON report.

Usage: ``python benchmarks/step_loop.py [--quick] [--no-ray]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    CommandChild,
    call_times,
    process_cpu_s,
    report,
    target,
    use_cpu_devices,
)

from service import RepeatingDataset, identity, make_inputs, replica_vector, train_step

DEVICES = 8
ACCELERATOR = f"v6e-{DEVICES}"
REDUCE_EVERY = 10

# The cold start, as a user's script runs it: its own timings on stdout.
COLD_SCRIPT = """
import json, time
start = time.perf_counter()
import numpy as np
import jaxpod
imported = time.perf_counter()
client = jaxpod.connect()
connected = time.perf_counter()
strategy = client.strategy()
acquired = time.perf_counter()
out = strategy.reduce("SUM", strategy.run(lambda x: x * 2, args=(np.ones(3, np.float32),)),
                      axis=None)
done = time.perf_counter()
assert np.array_equal(out, np.full(3, 2.0 * strategy.num_replicas_in_sync, np.float32)), out
print("COLD", json.dumps({"import_s": imported - start, "connect_s": connected - imported,
                         "acquire_s": acquired - connected, "first_result_s": done - acquired}))
client.close()
"""


# ------------------------------------------------------------ the loop, both sides
def custom_loop(strategy: Any, iterator: Any, state: Any, steps: int) -> tuple[Any, float]:
    """``steps`` steps of the custom loop; the state's handles and the last loss."""
    loss = None
    for i in range(steps):
        batch = next(iterator)
        state, out = strategy.run(train_step, args=(state, batch))
        if (i + 1) % REDUCE_EVERY == 0 or i + 1 == steps:
            loss = strategy.reduce("MEAN", out["loss"], axis=None)
    return state, float(loss)


def run_reduce(strategy: Any, value: Any) -> None:
    strategy.reduce("SUM", strategy.run(identity, args=(value,)), axis=None)


class Loop:
    """A custom loop's state on one strategy: its iterator and its state handles."""

    def __init__(self, strategy: Any) -> None:
        batches, params = make_inputs()
        self.strategy = strategy
        self.iterator = iter(strategy.experimental_distribute_dataset(
            RepeatingDataset(batches)))
        self.state: Any = params
        self.loss = float("nan")

    def steps(self, count: int) -> float:
        """Runs ``count`` steps; their wall time in seconds."""
        start = time.perf_counter()
        self.state, self.loss = custom_loop(self.strategy, self.iterator, self.state, count)
        return time.perf_counter() - start


def inprocess_child() -> None:
    """The in-process side, driven over stdin/stdout: ``loop N`` answers ``T <s> <loss>``,
    ``trivial N [GAP_S]`` answers ``T <p50 s>`` (each call after ``GAP_S`` idle), ``quit``."""
    use_cpu_devices(DEVICES)
    import jaxpod

    strategy = jaxpod.TPUStrategy()
    loop = Loop(strategy)
    value = strategy.experimental_distribute_values_from_function(replica_vector)
    print("READY", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        if command[0] == "loop":
            elapsed = loop.steps(int(command[1]))
            print(f"T {elapsed} {loop.loss}", flush=True)
        elif command[0] == "trivial":
            gap = float(command[2]) if len(command) > 2 else 0.0
            times = call_times(lambda: run_reduce(strategy, value), int(command[1]), 20,
                               idle_s=gap)
            print(f"T {statistics.median(times)}", flush=True)


class Child(CommandChild):
    """A running :func:`inprocess_child`, ready."""

    def __init__(self) -> None:
        super().__init__(__file__, [])
        self.wait_ready()


# ------------------------------------------------------------------ measurements
def measure_cold(runs: int, slices: str | None = None, provider: str | None = None
                 ) -> dict[str, float]:
    """Median phases of ``runs`` fresh interpreters' cold starts, and their wall time
    from spawning the interpreter to its first result (``slices``: the embedded
    service's simulated slices, default its own, one v4-16; ``provider``: how it runs
    them, default its own, plain processes)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAXPOD_ADDRESS", "JAXPOD_LOCAL_SLICES", "JAXPOD_LOCAL_PROVIDER")}
    if slices:
        env["JAXPOD_LOCAL_SLICES"] = slices
    if provider:
        env["JAXPOD_LOCAL_PROVIDER"] = provider
    samples: list[dict[str, float]] = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", COLD_SCRIPT], stdout=subprocess.PIPE,
                                env=env, text=True)
        phases: dict[str, float] | None = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("COLD "):
                phases = dict(json.loads(line[5:]))
                phases["wall_to_first_result_s"] = time.perf_counter() - start
        if proc.wait(300) != 0 or phases is None:
            raise RuntimeError(f"the cold-start script failed (status {proc.returncode})")
        print(f"cold start ({slices or 'default slices'}, {provider or 'default provider'}): "
              + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
        samples.append(phases)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def cold_figures(prefix: str, phases: dict[str, float]) -> dict[str, float]:
    """:func:`measure_cold`'s phases as figures named ``prefix`` + phase, its wall time
    as ``prefix + "connect_to_first_result_s"``."""
    return {prefix + ("connect_to_first_result_s" if name == "wall_to_first_result_s"
                      else name): value for name, value in phases.items()}


def measure_loop(remote: Loop, child: Child, steps: int, rounds: int) -> dict[str, float]:
    """Median seconds per step of the custom loop, remote and in-process alternating
    (both losses must agree: the same program on the same data), and the CPU seconds
    per step each process spent in them: ``cpu_<role>`` (:func:`_roles`)."""
    for _ in range(2):  # warm-up: compiles, starts the infeeds
        remote.steps(steps)
        child.ask(f"loop {steps}")
    times: dict[str, list[float]] = {"remote": [], "inprocess": []}
    cpu: dict[str, float] = {}
    roles = {**_roles(), child.proc.pid: "inprocess"}
    for _ in range(rounds):
        before = {pid: process_cpu_s(pid) for pid in roles}
        times["remote"].append(remote.steps(steps) / steps)
        elapsed, loss = child.ask(f"loop {steps}")
        times["inprocess"].append(elapsed / steps)
        for pid, role in roles.items():
            cpu[role] = cpu.get(role, 0.0) + process_cpu_s(pid) - before[pid]
        if abs(loss - remote.loss) > 1e-4 * max(1.0, abs(loss)):
            raise RuntimeError(f"the remote loop's loss {remote.loss} differs from the "
                               f"in-process loop's {loss}")
    return {**{name: statistics.median(t) for name, t in times.items()},
            **{f"cpu_{role}": spent / (rounds * steps) for role, spent in cpu.items()}}


def _roles() -> dict[int, str]:
    """This process and the embedded service's, by role: ``client``, ``coordinator``,
    ``hosts`` (the host workers), ``ray`` (Ray's own daemons)."""
    from jaxpod.service.capacity.local_cluster import descendants

    roles = {os.getpid(): "client"}
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:  # gone meanwhile
            continue
        roles[pid] = ("coordinator" if b"jaxpod.cli" in command else
                      "hosts" if b"HostWorker" in command or b"host_process" in command
                      else "ray")
    return roles


# ------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--no-ray", action="store_true",
                        help="skip the cold start on a local Ray cluster (cold_ray_*), "
                             "for a machine without Ray installed")
    parser.add_argument("--_inprocess", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._inprocess:
        inprocess_child()
        return
    cold_runs = 1 if args.quick else 3
    loop_steps, rounds = (50, 3) if args.quick else (100, 9)
    calls = 100 if args.quick else 500

    cold = measure_cold(cold_runs)
    single = measure_cold(cold_runs, ACCELERATOR)
    on_ray = {} if args.no_ray else measure_cold(cold_runs, provider="ray")
    os.environ["JAXPOD_LOCAL_SLICES"] = ACCELERATOR
    import jaxpod

    with jaxpod.connect() as client, client.strategy(ACCELERATOR) as strategy:
        child = Child()
        try:
            per_step = measure_loop(Loop(strategy), child, loop_steps, rounds)
            value = strategy.experimental_distribute_values_from_function(replica_vector)
            trivial = statistics.median(call_times(lambda: run_reduce(strategy, value),
                                                   calls, 20))
            local_trivial = child.ask(f"trivial {calls}")[0]
            idle_gap = max(0.0, trivial - local_trivial)
            local_after_idle = child.ask(f"trivial {calls} {idle_gap}")[0]
        finally:
            child.close()
    ratio = per_step["remote"] / per_step["inprocess"]
    remote_cpu = sum(spent for key, spent in per_step.items()
                     if key.startswith("cpu_") and key != "cpu_inprocess")
    cores = os.cpu_count() or 1
    figures = {
        "devices": DEVICES, "loop_steps": loop_steps, "loop_rounds": rounds,
        "loop_remote_ms_per_step": 1e3 * per_step["remote"],
        "loop_inprocess_ms_per_step": 1e3 * per_step["inprocess"],
        "loop_remote_vs_inprocess": ratio,
        # Where the remote loop's CPU goes, per step, against the in-process loop's.
        **{f"loop_{key}_ms_per_step": 1e3 * value for key, value in per_step.items()
           if key.startswith("cpu_")},
        "loop_cpu_remote_vs_inprocess": remote_cpu / per_step["cpu_inprocess"],
        "loop_cpu_floor_vs_inprocess": remote_cpu / cores / per_step["inprocess"],
        "trivial_run_reduce_p50_ms": 1e3 * trivial,
        "inprocess_trivial_run_reduce_p50_ms": 1e3 * local_trivial,
        "inprocess_trivial_after_idle_ms": 1e3 * local_after_idle,
        "trivial_idle_gap_ms": 1e3 * idle_gap,
        "trivial_calls": calls, "cold_runs": cold_runs,
        **cold_figures("cold_", cold), **cold_figures("cold_single_host_", single),
        **cold_figures("cold_ray_", on_ray),
        "cores": cores,
    }
    report("step_loop", {k: round(v, 4) if isinstance(v, float) else v
                         for k, v in figures.items()}, {
        "loop_remote_vs_inprocess": target(ratio, "<=", 1.3),
        "loop_cpu_remote_vs_inprocess": target(remote_cpu / per_step["cpu_inprocess"], "<=",
                                               1.3),
        "trivial_run_reduce_p50_ms": target(1e3 * trivial, "<=", 1.0),
        "cold_connect_to_first_result_s": target(cold["wall_to_first_result_s"], "<=", 4.0),
    })


if __name__ == "__main__":
    main()
