"""Integrity under chaos: a job survives random faults, and resumes exactly.

One simulated v4-16 (``LocalTPUCluster``: 2 hosts x 4 chips, JAX on CPU) served by a real
``jaxpod serve`` process joined to it; this process is the client. First one job runs
uninterrupted: the reference. Then, for each of N rounds (``--rounds``, default 200;
``--quick`` 10), the same job is submitted again and, once it is past a random step,
one fault picked at random strikes it:

* ``host``: SIGKILL of a random host worker (a failure without notice);
* ``notice``: SIGTERM of a random host worker (a preemption notice);
* ``mid_save``: SIGKILL of a random host worker while a checkpoint's files are being
  written (seen as orbax's temporary folder of the step);
* ``coordinator``: SIGKILL of the service, then a new one started on its state dir,
  the client reconnected to it and the job found again by its id.

The job (``STEPS`` steps, ``--quick`` ``QUICK_STEPS``, 2 per loop, a checkpoint every
``CHECKPOINT_EVERY``) updates a 4 MiB float32 state from the all-reduced sum of its
global batch, and keeps a **ledger**: ``seen[i]`` counts the steps that consumed
global row ``i`` of the 40-row dataset (3 elements of 16, 16 and 8 rows, read round and
round as a stream of rows, 16 per step), summed over the replicas with any padding
rows masked out. Each round checks:

1. the job ends SUCCEEDED (``recovered``);
2. its final state equals the reference's, bit for bit (``state_mismatches``);
3. its ledger equals numpy's count of the rows the steps take: no row consumed twice
   or skipped over all the attempts (``ledger_errors``);
4. every checkpoint its folder holds at the end restores with plain orbax in a fresh
   interpreter that never imports jaxpod, and holds the state of its step: ``n`` is
   the step and the ledger is numpy's count at that step (``corrupt_checkpoints``);
   an attempt resumes from a committed checkpoint only (a half-written one holds no
   ``state`` to read, and a resume from it would fail checks 2 and 3).

Figures: ``recovered`` of ``rounds``, each check's failures, ``steps_lost_median`` and
``steps_lost_max`` (the steps the faulted attempt ran past the checkpoint the next one
started from), ``fault_to_first_step_s_median`` and ``..._p95`` (from the fault to the
end of the next attempt's first loop, the service's record), and per fault kind how
often it struck (``mid_save_caught``: rounds that killed a host with a checkpoint's
files half written). Targets: every round recovered; no state, ledger or checkpoint
error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import kept_log_on_failure, report, wait_until
from jobs import Service, rounded

ACCELERATOR = "v4-16"
HOSTS = 2
STEPS = 200
QUICK_STEPS = 32
STEPS_PER_RUN = 2
CHECKPOINT_EVERY = 10
STEP_PAUSE_S = 0.005
PID_EVERY = 2  # steps between the pid lines the job prints (how hosts are found)
STATE_FLOATS = 1 << 20  # 4 MiB of float32: a checkpoint's write is long enough to hit
ELEMENT_ROWS = (16, 16, 8)
ROWS = sum(ELEMENT_ROWS)
KINDS = ("host", "notice", "mid_save", "coordinator")
JOB_TIMEOUT_S = 300.0
SEEN_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------- the job
def print_pid(step: Any) -> None:
    if int(step) % PID_EVERY == 0:
        print(f"pid {os.getpid()}")


def ledger_step(state: Any, batch: Any) -> Any:
    """A deterministic update from the global batch's sum, and the ledger of its rows."""
    import jax
    import jax.numpy as jnp

    import jaxpod

    jax.debug.callback(print_pid, state["n"])

    def pause(x: Any) -> Any:
        time.sleep(STEP_PAUSE_S)
        return x

    ctx = jaxpod.get_replica_context()
    mask = ctx.valid_row_mask
    total = ctx.all_reduce("SUM", (batch["x"] * mask.astype(jnp.float32)).sum())
    total = jax.pure_callback(pause, jax.ShapeDtypeStruct(total.shape, total.dtype), total)
    rows = jax.nn.one_hot(batch["id"], ROWS, dtype=jnp.int32) * mask.astype(jnp.int32)[:, None]
    seen = ctx.all_reduce("SUM", rows.sum(axis=0))
    w = state["w"] * 0.97 + jnp.sin(total + state["w"]) * 0.05
    return {"w": w, "n": state["n"] + 1, "seen": state["seen"] + seen}, {"total": total}


def dataset() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    out, first = [], 0
    for n in ELEMENT_ROWS:
        out.append({"x": rng.normal(size=n).astype(np.float32),
                    "id": np.arange(first, first + n, dtype=np.int32)})
        first += n
    return out


def expected_ledger(steps: int) -> np.ndarray:
    """numpy's count of the rows ``steps`` steps take: a job's input is a stream of
    rows, read round and round, of which each step takes as many as the first element
    has (step ``s``: rows ``16 s`` to ``16 s + 15``)."""
    taken = np.arange(steps * ELEMENT_ROWS[0]) % ROWS
    return np.bincount(taken, minlength=ROWS).astype(np.int32)


def submit(client: Any, name: str, steps: int) -> Any:
    return client.submit(
        ledger_step, steps=steps, accelerator_type=ACCELERATOR, steps_per_run=STEPS_PER_RUN,
        initial_state={"w": np.linspace(0, 1, STATE_FLOATS, dtype=np.float32),
                       "n": np.int32(0), "seen": np.zeros(ROWS, np.int32)},
        dataset=dataset(), outputs={"total": "MAX"}, checkpoint_every=CHECKPOINT_EVERY,
        max_retries_preemption=5, name=name)


def host_pids(job: Any, host: int) -> list[int]:
    pids = [int(m.group(1)) for m in re.finditer(rf"^\[host {host}\] pid (\d+)$", job.logs(),
                                                  re.MULTILINE)]
    return list(dict.fromkeys(pids))




# ------------------------------------------------------------------- one round
class Chaos:
    """The cluster's service and client, restarted when a round kills the service."""

    def __init__(self, ray_address: str, steps: int, seed: int) -> None:
        import jaxpod

        self._jaxpod = jaxpod
        self.ray_address = ray_address
        self.steps = steps
        self.rng = random.Random(seed)
        self.log = os.path.join(tempfile.gettempdir(), f"jaxpod-bench-chaos-{os.getpid()}.log")
        self.service = Service(ray_address, self.log)
        self.client = jaxpod.connect(self.service.address, token=self.service.token)

    def close(self) -> None:
        self.client.close()
        self.service._own_state_dir = True  # the last one removes the shared folder
        self.service.stop()

    def restart_service(self) -> None:
        old = self.service
        old.crash()
        self.client.close()
        self.service = Service(self.ray_address, self.log, state_dir=old.state_dir,
                               token=old.token)
        self.client = self._jaxpod.connect(self.service.address, token=self.service.token)

    def folder(self, job_id: str) -> Path:
        return Path(self.service.state_dir) / "checkpoints" / job_id

    @staticmethod
    def _saving(job: Any, folder: Path) -> bool:
        """Waits until a checkpoint of the job is being written (its step's temporary
        folder is there); ``False`` if the job ended first."""
        deadline = time.monotonic() + SEEN_TIMEOUT_S
        polls = 0
        while time.monotonic() < deadline:
            try:
                if any(".orbax-checkpoint-tmp" in p.name for p in folder.iterdir()):
                    return True
            except FileNotFoundError:  # not made yet
                pass
            polls += 1
            if polls % 200 == 0 and job.status().done:
                return False
            time.sleep(0.0005)
        return False

    def run_round(self, number: int, reference: dict[str, np.ndarray]) -> dict[str, Any]:
        kind = self.rng.choice(KINDS)
        host = self.rng.randrange(HOSTS)
        # Past the first checkpoint, early enough that the fault lands before the end.
        at_step = self.rng.randrange(CHECKPOINT_EVERY, self.steps * 3 // 4)
        job = submit(self.client, f"chaos-{number}", self.steps)
        job_id = job.id
        wait_until(lambda: job.status().step >= at_step or job.status().done, JOB_TIMEOUT_S,
                   f"job {job_id} past step {at_step}")
        caught = False
        struck = time.time()
        if kind == "coordinator":
            self.restart_service()
            job = self.client.job(job_id)
        else:
            # The pid first: the kill then follows the moment at once.
            pid = wait_until(lambda: (host_pids(job, host) or [None])[-1], SEEN_TIMEOUT_S,
                             f"host {host}'s pid")
            if kind == "mid_save":  # a checkpoint's files half written: orbax's tmp folder
                caught = self._saving(job, self.folder(job_id))
            struck = time.time()
            with contextlib.suppress(ProcessLookupError):  # the job was over already
                os.kill(pid, signal.SIGTERM if kind == "notice" else signal.SIGKILL)
        final = job.wait(timeout=JOB_TIMEOUT_S, progress=False)
        out: dict[str, Any] = {"kind": kind, "caught": caught, "state": final.state,
                               "job_id": job_id}
        if final.state != "SUCCEEDED":
            out["error"] = final.error
            return out
        state = {k: np.asarray(v) for k, v in job.result(timeout=JOB_TIMEOUT_S).state.items()}
        out["state_ok"] = all(
            state[k].dtype == reference[k].dtype and np.array_equal(state[k], reference[k])
            for k in reference)
        out["ledger_ok"] = bool(np.array_equal(state["seen"], expected_ledger(self.steps)))
        attempts = job.attempts()
        after = [a for a in attempts if a.started_at >= struck - 1e-3]
        faulted = [a for a in attempts if a.started_at < struck]
        if after and faulted and after[0].start_step is not None:
            reached = faulted[-1].step_reached or 0
            out["steps_lost"] = max(0, reached - after[0].start_step)
            if after[0].first_step_at is not None:
                out["to_first_step_s"] = after[0].first_step_at - struck
        out["attempts"] = len(attempts)
        out["checkpoints"] = sorted(
            str(p / "state") for p in self.folder(job_id).iterdir() if p.name.isdigit())
        return out


_PLAIN_ORBAX = """
import json, sys
import numpy as np
import orbax.checkpoint as ocp
out = []
for path in sys.argv[1:]:
    try:
        state = ocp.StandardCheckpointer().restore(path)
        out.append([path, int(state["n"]), np.asarray(state["seen"]).tolist()])
    except Exception as e:
        out.append([path, None, f"{type(e).__name__}: {e}"])
assert "jaxpod" not in sys.modules
print(json.dumps(out))
"""


def corrupt_checkpoints(paths: list[str]) -> tuple[int, list[str]]:
    """Restores every path with plain orbax in a fresh interpreter; the ones that do
    not read, or do not hold their step's state."""
    if not paths:
        return 0, []
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPOD_")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", _PLAIN_ORBAX, *paths], capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the plain orbax reader failed:\n{done.stderr[-3000:]}")
    bad = []
    for path, step, seen in json.loads(done.stdout.strip().splitlines()[-1]):
        own_step = int(Path(path).parent.name)
        if step != own_step or seen != expected_ledger(own_step).tolist():
            bad.append(f"{path}: {seen if step is None else f'n={step}'}")
    return len(paths), bad


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds of a shorter job")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rounds = args.rounds or (10 if args.quick else 200)
    steps = QUICK_STEPS if args.quick else STEPS

    from jaxpod.service.capacity.local_cluster import LocalTPUCluster

    # Each run starts from an empty compilation cache, which keeps every program.
    cache = tempfile.mkdtemp(prefix="jaxpod-chaos-cache-")
    os.environ.update({"JAXPOD_COMPILATION_CACHE_DIR": cache,
                       "JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S": "0.001"})
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    with LocalTPUCluster(ACCELERATOR) as cluster:
        chaos = Chaos(cluster.address, steps, args.seed)
        try:
            with kept_log_on_failure(chaos.service, chaos.log):
                reference_job = submit(chaos.client, "chaos-reference", steps)
                reference = {k: np.asarray(v) for k, v in
                             reference_job.result(timeout=JOB_TIMEOUT_S).state.items()}
                if not np.array_equal(reference["seen"], expected_ledger(steps)):
                    raise RuntimeError("the uninterrupted job's ledger differs from numpy's")
                for number in range(rounds):
                    outcome = chaos.run_round(number, reference)
                    results.append(outcome)
                    print(f"round {number}: {outcome['kind']}"
                          f"{' (mid-save)' if outcome['caught'] else ''} -> "
                          f"{outcome['state']}, lost {outcome.get('steps_lost')}, first "
                          f"step after {outcome.get('to_first_step_s', float('nan')):.2f} s",
                          flush=True)
                checked, bad = corrupt_checkpoints(
                    [p for r in results for p in r.get("checkpoints", [])])
        finally:
            chaos.close()
            shutil.rmtree(cache, ignore_errors=True)
    lost = [r["steps_lost"] for r in results if "steps_lost" in r]
    to_first = [r["to_first_step_s"] for r in results if "to_first_step_s" in r]
    recovered = sum(r["state"] == "SUCCEEDED" for r in results)
    figures: dict[str, Any] = {
        "rounds": rounds, "job_steps": steps, "checkpoint_every": CHECKPOINT_EVERY,
        "recovered": recovered,
        "state_mismatches": sum(not r.get("state_ok", False) for r in results),
        "ledger_errors": sum(not r.get("ledger_ok", False) for r in results),
        "checkpoints_checked": checked, "corrupt_checkpoints": len(bad),
        "steps_lost_median": float(statistics.median(lost)) if lost else float("nan"),
        "steps_lost_max": max(lost, default=0),
        "fault_to_first_step_s_median": percentile(to_first, 50),
        "fault_to_first_step_s_p95": percentile(to_first, 95),
        "mid_save_caught": sum(r["caught"] for r in results),
        # Rounds whose fault struck a running attempt (one may land as the job ends).
        "rounds_restarted": sum(r.get("attempts", 1) > 1 for r in results),
        "wall_s": time.perf_counter() - start, "cores": os.cpu_count(),
    }
    for kind in KINDS:
        figures[f"rounds_{kind}"] = sum(r["kind"] == kind for r in results)
    for problem in [r for r in results if r["state"] != "SUCCEEDED"][:3]:
        print(f"job {problem['job_id']} ({problem['kind']}) ended {problem['state']}: "
              f"{problem.get('error')}", flush=True)
    for line in bad[:5]:
        print(f"corrupt checkpoint {line}", flush=True)
    targets = {
        "recovered": {"value": recovered, "target": f"== {rounds}", "met": recovered == rounds},
        "state_mismatches": {"value": figures["state_mismatches"], "target": "== 0",
                             "met": figures["state_mismatches"] == 0},
        "ledger_errors": {"value": figures["ledger_errors"], "target": "== 0",
                          "met": figures["ledger_errors"] == 0},
        "corrupt_checkpoints": {"value": len(bad), "target": "== 0", "met": not bad},
    }
    report("chaos", rounded(figures), targets)


if __name__ == "__main__":
    main()
