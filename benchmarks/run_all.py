"""Every benchmark in one run, and the pages that publish their figures.

Runs each script of ``benchmarks/`` as a child process (``--quick`` passed on), reads
its last line (the JSON report) and writes:

* ``results.json``: every report, with the machine, the command and each script's
  run time and exit status;
* ``docs/benchmarks.md``: one table per area (each figure, its lower bound or peer
  measured in the same run, the ratio, the target, met or not), the machine and the
  command, and the cost-growth plot ``docs/benchmarks/growth.png``;
* the headline summary between the ``benchmarks:summary`` markers of ``README.md``.

A full run writes them in the repository (``benchmarks/results.json`` and the docs);
``--quick`` (about 15 minutes on 2 cores) writes them under ``--out`` (a temporary
folder unless given), so a smoke run never replaces the published figures. A full run
runs every script ``--repeats`` times (5) in rounds and shows each figure's median with
its min-max (:mod:`repeats`); targets are judged on the median. ``--only`` runs some
scripts and keeps them beside the last full run as a dated rerun, shown in a section
of its own, never mixed into the full run's tables. A script that fails is recorded as
failed and makes this one exit 1, after the others ran.

Usage: ``python benchmarks/run_all.py [--quick] [--repeats N] [--only engine,...]
[--out DIR]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxpod import settings

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: Runs of each script in a full run: every figure is their median.
FULL_REPEATS = 5
#: Longest one script may run (a full checkpoint run takes ~20 min on 2 cores).
SCRIPT_TIMEOUT_S = settings.BENCH_SCRIPT_TIMEOUT.seconds()


@dataclasses.dataclass(frozen=True)
class Area:
    """One benchmark script and the table it fills."""

    script: str
    title: str
    question: str  # what the table answers
    explains: str = ""  # what the figures time, and what a reader should know of them


AREAS = (
    Area("engine", "Engine (in-process)", "What does jaxpod's in-process strategy cost over "
         "a hand-written `lax.scan` and a bare `jax.jit` call on the same devices?"),
    Area("infeed", "Input pipeline", "Does the infeed hide input time behind compute?"),
    Area("allocate", "Allocation", "How long does acquiring and releasing a 2-host slice take?"),
    Area("service", "Remote strategy", "What does reaching the hosts through the service "
         "cost: run latency, `run_steps` against the workers and plain JAX, gather "
         "against a raw gRPC stream?"),
    Area("step_loop", "Remote custom loop and cold start", "A TF2-style custom loop "
         "remote against in-process on the same chips; `run`+`reduce` latency; "
         "`jaxpod.connect()` with nothing running to the first result."),
    Area("jobs", "Jobs", "Submit to first step, re-acquiring a warm slice, jobs per "
         "minute, goodput, against Ray Train's `JaxTrainer` on the same cluster.",
         "`submit_to_first_step_ms_p50` is the job's own record: its attempt's first loop "
         "done (`first_step_at`) less its `created_at`. `submit_to_finished_ms_p50` adds "
         "the one-step job's end, where the hosts commit its final state as an orbax "
         "checkpoint (its result): about 25 ms for a scalar with plain orbax in one process "
         "on this machine, and the bulk of the difference."),
    Area("recovery", "Recovery", "A host killed or told of its preemption: time to the "
         "resumed first step, steps lost, bit-identical results."),
    Area("memory_checkpoint", "In-memory checkpoints", "A host lost without notice: "
         "restoring from the hosts' memory against from storage, steps lost, and the "
         "steps' stall per save of each tier.",
         "On this machine the persistent checkpoint is read from the page cache, memory "
         "as well: the ratio is a bound on what RAM saves, not what it saves against a "
         "bucket. Both jobs save every 2 steps; the stall is the goodput's "
         "checkpointing seconds, the persistent job's final checkpoint counted apart."),
    Area("restart", "Restarts and the compilation cache", "A transformer job's host "
         "killed, and the same job submitted again on new hosts: time to the first step "
         "and programs compiled, with the hosts' compilation cache and without."),
    Area("chaos", "Integrity under chaos", "A job struck by random faults (host SIGKILL, "
         "preemption notice, a host killed mid-checkpoint, coordinator SIGKILL): does it "
         "always finish with the uninterrupted run's state, every row consumed once, and "
         "only whole checkpoints on disk?"),
    Area("checkpoint", "Checkpoints", "Host-written orbax checkpoints through a job against "
         "plain orbax on plain `jax.distributed` processes; the step loop's stall; "
         "resume far against near.",
         "What each figure times. Plain save: orbax's `save` call to committed (async, "
         "replica-parallel, set up as the hosts set orbax up: barriers on the "
         "coordination service, 4 MiB chunks). The job's save: its final checkpoint, "
         "from its last loop to the hosts' commit recorded, so it adds the "
         "coordinator's calls (ask the hosts to save, wait for the commit, record it). "
         "Stall: each periodic checkpoint's own record of how long it held the steps "
         "(`JobCheckpoint.stall_s`, a job's first left out), against the device-to-host "
         "copy any save waits for; it cannot be negative. Restore: a resumed attempt's "
         "restoring against plain orbax restoring the same checkpoint in fresh "
         "processes. The quick run (64 MiB, one run of each) depends on the machine "
         "being quiet: the coordinator's calls cost about 0.1 s a checkpoint, a third "
         "of a 64 MiB save and under a tenth of the full run's 1 GiB one. Three quick "
         "runs on 2026-12-01 (save, stall, restore, far/near): 2.14, 1.09, 0.98, 0.92 "
         "(all met); 0.81, 1.88, 0.90, 1.11 (in CI); 0.69, 1.25, 1.18, 0.98 (beside "
         "another benchmark): one run of each is too few at this size. Why the job's "
         "save can beat orbax's own save-to-commit at the same settings is not "
         "explained yet."),
    Area("results", "Reading results back", "`job.result()` against plain orbax restoring "
         "the same checkpoint at 10 to 1,000 leaves and 16 to 256 MiB; the coordinator's "
         "peak memory while a 256 MiB result, gather, local results or fetch passes "
         "through it.",
         "`result_s_*` is the client's `job.result()`: the coordinator reads the checkpoint "
         "once, in blocks, and streams it; `orbax_s_*` is `StandardCheckpointer().restore` "
         "of the same files in the client's process (the lower bound: no coordinator, no "
         "stream). Growth figures are the coordinator's `VmHWM` above its `VmRSS` when the "
         "call started (reset through `clear_refs`); the first result of the run is "
         "reported apart (`first_result_peak_growth_mib`: libraries and thread pools it "
         "loads once)."),
    Area("sharded", "Sharded (global-view) jobs", "A `mesh=` job's steps/s against the same "
         "`jax.jit` step on plain `jax.distributed` processes: a 2-layer MLP and a 2-layer "
         "flax nnx transformer with optax AdamW (`transformer_*`, 92 state leaves).",
         "The job runs through `jaxpod serve --local --provider processes`, as the embedded "
         "service does. Its simulated hosts used to start in sessions of their own, and "
         "Linux's scheduler (autogroup) shares the CPU equally between sessions: the two "
         "hosts preempted each other twice as often as processes of one session, and the "
         "transformer's cross-host all-reduces ran a quarter slower (0.72x plain); they now "
         "share the service's session. `job_steps_per_s` is the wall rate from the first "
         "loop seen done to the last; `job_productive_steps_per_s` the steps over the "
         "productive seconds of the job's goodput."),
    Area("dashboard", "Dashboard", "32 pollers of the job list: p99 latency, and a running "
         "job's steps/s against no pollers."),
    Area("job_queue", "Priorities", "A high-priority job preempting a running one: submit to "
         "its first step, steps lost."),
    Area("fan_in", "Replies at pod host counts", "What reading every host's reply to "
         "an operation costs the coordinator at 8, 64 and 256 hosts (socket pairs "
         "standing for the hosts)."),
    Area("job_history", "A long job's history", "What reading a job's metric series "
         "costs the dashboard at 1,000 to 1,000,000 steps: whole, thinned for the "
         "chart, the last point."),
    Area("retention", "A service that runs for months", "What the job store holds after "
         "10,000 short jobs of 1,000 metric steps with `--retain-jobs 100`, and what the "
         "page's reads cost at the start and at the end.",
         "The jobs are recorded by the benchmark into the store a real `jaxpod serve` runs "
         "on, with the calls a job's runner makes; the service prunes them. The quick run "
         "(800 jobs of 100 steps) judges the same bound per job: 50 MiB over 10,000 jobs."),
    Area("scheduler", "Teams sharing a reservation", "The fair-share scheduler replayed "
         "over a simulated week: 1,000 jobs of 4 teams (weights 4:2:1:1) on 64 slices of 3 "
         "shapes. Each team's share of the contended slice-seconds against its weight, "
         "utilisation while jobs wait, preemptions per job, and one decision's time at "
         "1,000 queued jobs.",
         "The scheduler the service runs is a pure function of the queue, the jobs, the "
         "free slices, the teams' usage and the clock: the replay calls that function, "
         "no cluster. The quick run replays 300 jobs."),
    Area("growth", "Cost growth with hosts", "The same figures on 1, 2, 4 (and 8) "
         "simulated hosts, fitted per host and read at 64 and 256 hosts."),
)


#: About how long each script's --quick run takes on 2 cores (seconds): with
#: --parallel, the longest start first.
EXPECTED_S = {"chaos": 130, "checkpoint": 100, "memory_checkpoint": 95, "sharded": 80,
              "growth": 75, "restart": 65, "recovery": 60, "step_loop": 45}


def peer_installed() -> bool:
    """Whether Ray Train (the jobs benchmark's peer) can be imported."""
    try:
        return importlib.util.find_spec("ray.train") is not None and \
            importlib.util.find_spec("pandas") is not None
    except ImportError:
        return False


def script_args(area: Area, quick: bool, notes: dict[str, str]) -> list[str]:
    args = ["--quick"] if quick else []
    if area.script == "jobs" and not peer_installed():
        notes[area.script] = ("Ray Train's `JaxTrainer` (the peer) was not measured: "
                              "`ray[train]` is not installed here (`pip install -e "
                              "'.[bench]'`).")
        args += ["--parts", "reacquire,jobs"]
    return args


def run_script(area: Area, args: list[str], logs: Path) -> dict[str, Any]:
    """Runs one script; its report plus how it ran (its output goes to ``logs``)."""
    command = [sys.executable, str(HERE / f"{area.script}.py"), *args]
    log = logs / f"{area.script}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=SCRIPT_TIMEOUT_S, cwd=REPO)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = -1
    seconds = time.monotonic() - start
    lines = log.read_text(errors="replace").splitlines()
    entry: dict[str, Any] = {"command": " ".join(["python", f"benchmarks/{area.script}.py",
                                                  *args]),
                             "ran_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             "seconds": round(seconds, 1), "exit": code, "log": str(log)}
    try:
        reported = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        reported = None
    if code != 0 or not isinstance(reported, dict) or reported.get("benchmark") is None:
        entry["error"] = "\n".join(lines[-15:]) or "(no output)"
        return entry
    entry.update(figures=reported["figures"], targets=reported["targets"])
    return entry


def merged(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """A run of some scripts kept beside the full run published under ``out`` (of the
    same kind), as a dated rerun of its own: never mixed into the full run's tables.
    ``results`` alone when there is none, or when it ran every script."""
    published = out / "benchmarks" / "results.json"
    if not published.exists():
        return results
    earlier = json.loads(published.read_text())
    if earlier.get("quick") != results["quick"] or \
            set(results["benchmarks"]) >= set(earlier.get("benchmarks", {})):
        return results
    earlier.setdefault("reruns", []).append(
        {key: results[key] for key in ("command", "generated_at", "seconds", "repeats",
                                       "benchmarks", "notes") if key in results})
    return earlier


def machine() -> dict[str, Any]:
    import jax

    import jaxpod

    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return {"cores": os.cpu_count(), "memory_gib": round(total_kib / 2**20, 1),
            "cpu": platform.processor() or platform.machine(),
            "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxpod": jaxpod.__version__,
            "accelerators": "none: TPU hosts simulated on CPU, one virtual device per chip"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="every script's --quick, once (about 15 min on 2 cores)")
    parser.add_argument("--only", default=None,
                        help="comma-separated scripts (default: all): "
                             + ",".join(a.script for a in AREAS))
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each script, in rounds; every figure is their "
                             "median, min-max beside it (default 5, 1 with --quick)")
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="scripts run at once (default 1). Above 1 the scripts "
                             "share the cores, so their figures say less: for checking "
                             "that every benchmark runs (CI), not for publishing")
    parser.add_argument("--out", default=None,
                        help="where results.json and docs/ go (default: the repository "
                             "for a full run, a temporary folder with --quick)")
    args = parser.parse_args()
    chosen = [a for a in AREAS if args.only is None or a.script in args.only.split(",")]
    unknown = set(args.only.split(",")) - {a.script for a in AREAS} if args.only else set()
    if unknown or not chosen:
        parser.error(f"--only takes scripts from {[a.script for a in AREAS]}; got {args.only}")
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="jaxpod-bench-")) if args.quick else REPO)
    logs = Path(tempfile.mkdtemp(prefix="jaxpod-bench-logs-"))
    started = time.time()
    notes: dict[str, str] = {}
    results: dict[str, Any] = {
        "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "command": "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
                   + (f" --only {args.only}" if args.only else ""),
        "quick": args.quick, "machine": machine(), "benchmarks": {}, "notes": notes}
    repeats = args.repeats or (1 if args.quick else FULL_REPEATS)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1; got {repeats}")
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1; got {args.parallel}")
    results["repeats"] = repeats
    if args.parallel > 1:
        results["command"] += f" --parallel {args.parallel}"
        notes["parallel"] = (f"{args.parallel} scripts ran at once, sharing the cores: "
                             "these figures say that every benchmark runs, not how fast.")
    runs: dict[str, list[dict[str, Any]]] = {a.script: [] for a in chosen}

    def run(area: Area, round_: int) -> None:
        print(f"run_all: {area.script} ({round_}/{repeats}) ...", flush=True)
        entry = run_script(area, script_args(area, args.quick, notes), logs)
        runs[area.script].append(entry)
        met = [t["met"] for t in entry.get("targets", {}).values()]
        print(f"run_all: {area.script} {'FAILED' if 'error' in entry else 'done'} in "
              f"{entry['seconds']:.0f} s; targets met {sum(met)}/{len(met)}", flush=True)
        if "error" in entry:
            print(entry["error"], flush=True)

    # The scripts' hosts keep in-memory checkpoints in RAM as by default, in a folder
    # of this run's: whatever a killed or cancelled job leaves goes with it.
    memory = None
    if "JAXPOD_MEMORY_CHECKPOINT_DIR" not in os.environ:
        memory = os.environ["JAXPOD_MEMORY_CHECKPOINT_DIR"] = tempfile.mkdtemp(
            prefix="jaxpod-bench-memory-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for round_ in range(1, repeats + 1):  # rounds: a busy spell falls on several
            with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
                # the longest first, so the last to finish is a short one
                order = chosen if args.parallel == 1 else sorted(
                    chosen, key=lambda a: -EXPECTED_S.get(a.script, 0))
                for done in [pool.submit(run, area, round_) for area in order]:
                    done.result()  # bounded: each script runs under SCRIPT_TIMEOUT_S
    finally:
        if memory is not None:
            os.environ.pop("JAXPOD_MEMORY_CHECKPOINT_DIR", None)
            shutil.rmtree(memory, ignore_errors=True)
    from repeats import combine

    own = results["benchmarks"] = {a.script: combine(runs[a.script]) for a in chosen}
    elapsed = results["seconds"] = round(time.time() - started, 1)
    results = merged(results, out)

    from publish import write_pages

    written = write_pages(results, out, AREAS)
    failed = [a.script for a in chosen if "error" in own[a.script]]
    print(f"run_all: {len(chosen) - len(failed)}/{len(chosen)} scripts ran in "
          f"{elapsed:.0f} s; wrote " + ", ".join(str(p) for p in written)
          + (f"; logs in {logs}" if failed else ""), flush=True)
    if failed:
        print(f"run_all: FAILED: {', '.join(failed)}", file=sys.stderr)
    from _common import report

    report("run_all", {"scripts": len(chosen), "failed": failed, "seconds": elapsed},
           {f"{name}.{figure}": t for name, e in own.items()
            for figure, t in e.get("targets", {}).items()})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
