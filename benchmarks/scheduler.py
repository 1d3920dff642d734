"""The fair-share scheduler replayed over a simulated week: shares, utilisation,
preemptions, steps lost and the time of one decision.

The scheduler the service runs (``jaxpod.service.jobs.fair_share.plan``) is a pure
function of the queue, the started jobs, the free slices, the teams' usage and the
clock, so this script drives it with an event simulation instead of a cluster: 64 slices
of 3 shapes, 4 teams of weights 4, 2, 1 and 1, and 1,000 jobs (``--quick``: 300) that
arrive at random over the week's first half (each team asking 1.5x its weighted share of
the week's slice-seconds, so all four keep jobs queued for days; the replay runs until
every job is done), run 1 to 48 hours on 1 or 2 slices (one in
five elastic over two shapes; one in ten of higher priority), checkpoint every 30
minutes, and fail at random (a lost host: the steps since the last checkpoint are lost).
Every event (arrival, end, failure, a preempted job's checkpoint done) asks the
scheduler; a start costs the job 2 minutes (allocation, compile) and a preempted job
takes a minute (its last loop and a checkpoint) to give its slice up, as jaxpod's jobs
do: nothing of it is lost.

Figures:

* ``share_error_max``: over the time every team has jobs queued, the largest
  ``|team's slice-seconds share - weight share| / weight share`` (target <= 0.05);
* ``utilisation_while_waiting``: slices held / slices, over the time jobs wait for a
  type, per type, weighted by time (target >= 0.95);
* ``preemptions_per_job``, ``steps_lost_preempted`` (0: a preempted job checkpoints
  first) and ``steps_lost_failures`` (one step a second, from the failures);
* ``decision_ms_p50`` / ``decision_ms_p99`` at 1,000 queued jobs and 64 started (target
  p50 <= 1 ms), and ``decision_ms_sim_p50`` over the simulation's own decisions;
* ``simulated_days_per_s``: how fast the week replays.

The last line of output is the JSON report.

Usage: ``python benchmarks/scheduler.py [--quick]``
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from _common import report, target

from jaxpod.service.jobs.fair_share import Snapshot, Started, Team, Usage, Waiting, plan

WEEK_S = 7 * 24 * 3600.0
SHAPES = {"v4-8": 32, "v4-16": 24, "v4-32": 8}  # slices of each
TEAMS = {"a": 4.0, "b": 2.0, "c": 1.0, "d": 1.0}
HALF_LIFE_S = 3600.0 * 6
CHECKPOINT_EVERY_S = 1800.0
RESTART_S = 120.0
YIELD_S = 60.0  # a preempted job's last loop and checkpoint
MIN_RUNTIME_S = 600.0
FAILURES_PER_SLICE_HOUR = 1 / 400
DEMAND = 1.5  # each team asks this many times its weighted share of the cluster


@dataclass
class Job:
    job_id: str
    team: str
    types: tuple[str, ...]
    num_slices: int
    priority: int
    work_s: float  # seconds of steps it needs
    arrival: float
    rank: tuple[int, int] = (0, 0)
    done_s: float = 0.0  # steps done and checkpointed (seconds of work)
    kind: str = ""
    started_at: float = 0.0  # this attempt
    attempt: int = 0
    yielding_for: str | None = None
    preemptions: int = 0
    lost_s: float = 0.0


@dataclass
class Sim:
    rng: random.Random
    jobs: dict[str, Job]
    now: float = 0.0
    events: list[tuple[float, int, str, str, int]] = field(default_factory=list)
    waiting: dict[str, Job] = field(default_factory=dict)
    running: dict[str, Job] = field(default_factory=dict)
    usage: Usage = field(default_factory=lambda: Usage(0.0))
    order: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    seq: itertools.count[int] = field(default_factory=itertools.count)
    decisions_s: list[float] = field(default_factory=list)
    # accounting since the last event
    team_s: dict[str, float] = field(default_factory=dict)
    contended_s: float = 0.0
    busy_while_waiting: float = 0.0
    slots_while_waiting: float = 0.0

    def push(self, at: float, what: str, job_id: str, attempt: int = 0) -> None:
        heapq.heappush(self.events, (at, next(self.seq), what, job_id, attempt))

    # -------------------------------------------------------------- accounting
    def held(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for job in self.running.values():
            out[job.team] = out.get(job.team, 0) + job.num_slices
        return out

    def advance(self, to: float) -> None:
        span = to - self.now
        if span > 0:
            held = self.held()
            if {j.team for j in self.waiting.values()} >= set(TEAMS):
                self.contended_s += span
                for team, n in held.items():
                    self.team_s[team] = self.team_s.get(team, 0.0) + n * span
            by_type = {k: 0 for k in SHAPES}
            for job in self.running.values():
                by_type[job.kind] += job.num_slices
            wanted = {k for j in self.waiting.values() for k in j.types}
            for kind in wanted:
                self.busy_while_waiting += by_type[kind] * span
                self.slots_while_waiting += SHAPES[kind] * span
            self.usage = self.usage.advance(to, held, HALF_LIFE_S)
        self.now = to

    # -------------------------------------------------------------- the scheduler
    def snapshot(self) -> Snapshot:
        free = dict(SHAPES)
        for job in self.running.values():
            free[job.kind] -= job.num_slices
        return Snapshot(
            now=self.now, teams={t: Team(t, w) for t, w in TEAMS.items()}, usage=self.usage,
            waiting=[Waiting(j.job_id, j.team, j.types, j.num_slices, j.priority, j.rank)
                     for j in self.waiting.values()],
            started=[Started(j.job_id, j.team, j.kind, j.num_slices, j.priority,
                             j.started_at, MIN_RUNTIME_S, j.yielding_for is None)
                     for j in self.running.values()],
            free=free,
            yielding={j.job_id: j.yielding_for for j in self.running.values()
                      if j.yielding_for is not None},
            half_life_s=HALF_LIFE_S)

    def schedule(self) -> None:
        while True:
            snap = self.snapshot()
            t0 = time.perf_counter()
            decided = plan(snap)
            self.decisions_s.append(time.perf_counter() - t0)
            for p in decided.preemptions:
                self.preempt(self.running[p.victim], p.for_job)
            for s in decided.starts:
                self.start(self.waiting.pop(s.job_id), s.accelerator_type)
            if not decided.starts:
                return

    def start(self, job: Job, kind: str) -> None:
        job.kind, job.started_at, job.attempt = kind, self.now, job.attempt + 1
        self.running[job.job_id] = job
        left = job.work_s - job.done_s
        self.push(self.now + RESTART_S + left, "end", job.job_id, job.attempt)
        # failures: exponential over the attempt's slice-hours
        rate = FAILURES_PER_SLICE_HOUR * job.num_slices / 3600
        fail_at = self.now + self.rng.expovariate(rate)
        if fail_at < self.now + RESTART_S + left:
            self.push(fail_at, "fail", job.job_id, job.attempt)

    def progress(self, job: Job) -> float:
        """Seconds of work done by now in this attempt (after its restart)."""
        return max(0.0, self.now - job.started_at - RESTART_S)

    def preempt(self, job: Job, for_job: str) -> None:
        """Checkpoints at its next loop boundary (once restarted), then gives its slice
        up: nothing is lost."""
        job.yielding_for = for_job
        job.preemptions += 1
        restarted = job.started_at + RESTART_S
        self.push(max(self.now, restarted) + YIELD_S, "yielded", job.job_id, job.attempt)

    def requeue(self, job: Job, first: bool) -> None:
        del self.running[job.job_id]
        job.yielding_for = None
        order = next(self.order)
        job.rank = (-job.priority, -order if first else order)
        self.waiting[job.job_id] = job

    # -------------------------------------------------------------- events
    def run(self) -> None:
        while self.events:
            at, _, what, job_id, attempt = heapq.heappop(self.events)
            job = self.jobs[job_id]
            if what != "arrive" and (job_id not in self.running or job.attempt != attempt):
                continue  # an attempt that ended otherwise
            self.advance(at)
            if what == "arrive":
                job.rank = (-job.priority, next(self.order))
                self.waiting[job_id] = job
            elif what == "end":
                job.done_s = job.work_s
                del self.running[job_id]
            elif what == "yielded":
                job.done_s += self.progress(job)
                self.requeue(job, first=True)
            elif what == "fail":
                ran = self.progress(job)
                kept = ran - ran % CHECKPOINT_EVERY_S
                job.lost_s += ran - kept
                job.done_s += kept
                self.requeue(job, first=True)
            self.schedule()


def make_jobs(rng: random.Random, count: int, span_s: float) -> list[Job]:
    """Each team's jobs, sized so it asks DEMAND times its weighted share."""
    capacity = sum(SHAPES.values()) * span_s
    whole = sum(TEAMS.values())
    kinds, weights = list(SHAPES), list(SHAPES.values())
    jobs: list[Job] = []
    for team, weight in TEAMS.items():
        n = max(1, round(count * weight / whole))
        lengths = [rng.uniform(1, 48) for _ in range(n)]
        slices = [2 if rng.random() < 0.2 else 1 for _ in range(n)]
        asked = sum(h * 3600 * s for h, s in zip(lengths, slices, strict=True))
        scale = DEMAND * capacity * weight / whole / asked
        for i in range(n):
            first = rng.choices(kinds, weights)[0]
            types: tuple[str, ...] = (first,)
            if rng.random() < 0.2:
                other = rng.choice([k for k in kinds if k != first])
                types = (first, other)
            jobs.append(Job(f"{team}-{i}", team, types, slices[i],
                            1 if rng.random() < 0.1 else 0, lengths[i] * 3600 * scale,
                            rng.uniform(0, span_s * 0.5)))
    return jobs


def decision_times(rng: random.Random, queued: int, repeats: int) -> list[float]:
    """plan() on a full cluster with ``queued`` jobs waiting, every other pass with one
    slice of each type free."""
    kinds = list(SHAPES)
    started = []
    for kind, n in SHAPES.items():
        for i in range(n):
            team = rng.choice(list(TEAMS))
            started.append(Started(f"r-{kind}-{i}", team, kind, 1, 0, rng.uniform(0, 1e5),
                                   MIN_RUNTIME_S))
    waiting = [Waiting(f"w{i}", rng.choice(list(TEAMS)), (rng.choice(kinds),), 1,
                       rng.choice((0, 0, 0, 1)), (0, i)) for i in range(queued)]
    waiting = [Waiting(w.job_id, w.team, w.accelerator_types, 1, w.priority,
                       (-w.priority, i)) for i, w in enumerate(waiting)]
    usage = Usage(1e5, {t: rng.uniform(1e5, 1e6) for t in TEAMS})
    teams = {t: Team(t, w) for t, w in TEAMS.items()}
    # Settle first, as the service would: the preemptions decided become jobs giving
    # their slices up, until a pass decides none.
    yielding: dict[str, str] = {}
    for _ in range(100):
        decided = plan(Snapshot(2e5, teams, usage, waiting, started, {},
                                yielding=yielding, half_life_s=HALF_LIFE_S))
        if not decided.preemptions:
            break
        yielding.update({p.victim: p.for_job for p in decided.preemptions})
    out = []
    for r in range(repeats):
        free = {k: (1 if r % 2 else 0) for k in SHAPES}  # half the passes have one free
        snap = Snapshot(2e5, teams, usage, waiting, started, free, yielding=yielding,
                        half_life_s=HALF_LIFE_S)
        t0 = time.perf_counter()
        plan(snap)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 jobs instead of 1,000")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    count = 300 if args.quick else 1000
    jobs = make_jobs(rng, count, WEEK_S)
    sim = Sim(rng, {j.job_id: j for j in jobs})
    for job in jobs:
        sim.push(job.arrival, "arrive", job.job_id)
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    unfinished = [j.job_id for j in jobs if j.done_s < j.work_s]
    if unfinished:
        raise SystemExit(f"{len(unfinished)} job(s) never finished: {unfinished[:5]}")

    whole = sum(TEAMS.values())
    total = sum(sim.team_s.values()) or 1.0
    figures: dict[str, Any] = {"jobs": len(jobs), "slices": sum(SHAPES.values()),
                               "simulated_days": round(sim.now / 86400, 2),
                               "contended_days": round(sim.contended_s / 86400, 2)}
    errors = {}
    for team, weight in TEAMS.items():
        got = sim.team_s.get(team, 0.0) / total
        want = weight / whole
        figures[f"share_{team}"] = round(got, 4)
        figures[f"weight_share_{team}"] = round(want, 4)
        errors[team] = abs(got - want) / want
    figures["share_error_max"] = round(max(errors.values()), 4)
    figures["utilisation_while_waiting"] = round(
        sim.busy_while_waiting / max(sim.slots_while_waiting, 1e-9), 4)
    figures["preemptions_per_job"] = round(sum(j.preemptions for j in jobs) / len(jobs), 3)
    figures["steps_lost_preempted"] = 0  # a preempted job runs on to its checkpoint
    figures["steps_lost_failures"] = round(sum(j.lost_s for j in jobs))
    figures["decisions"] = len(sim.decisions_s)
    figures["decision_ms_sim_p50"] = round(statistics.median(sim.decisions_s) * 1e3, 4)
    times = sorted(decision_times(rng, 1000, 200 if args.quick else 1000))
    figures["decision_ms_p50"] = round(statistics.median(times) * 1e3, 4)
    figures["decision_ms_p99"] = round(times[int(len(times) * 0.99) - 1] * 1e3, 4)
    figures["simulated_days_per_s"] = round(sim.now / 86400 / wall, 2)
    print(f"shares {[figures[f'share_{t}'] for t in TEAMS]} against "
          f"{[figures[f'weight_share_{t}'] for t in TEAMS]} over "
          f"{figures['contended_days']} contended days; utilisation "
          f"{figures['utilisation_while_waiting']}; {figures['decisions']} decisions, "
          f"p50 {figures['decision_ms_p50']} ms at 1,000 queued", flush=True)
    report("scheduler", figures, {
        "share_error_max": target(figures["share_error_max"], "<=", 0.05),
        "utilisation_while_waiting": target(figures["utilisation_while_waiting"], ">=",
                                            0.95),
        "decision_ms_p50": target(figures["decision_ms_p50"], "<=", 1.0)})


if __name__ == "__main__":
    main()
