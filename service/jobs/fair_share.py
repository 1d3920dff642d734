"""Fair share between teams: which queued job takes a free slice and which running job
gives its slice up, as one pure function (:func:`plan`) of the queue, the started jobs,
the free slices, the teams' usage and the clock. The dispatcher asks it on every pass;
``benchmarks/scheduler.py`` replays a simulated week through the same function.

The rules, in the order they apply:

* **Free slices go to the team furthest below its share** of the recent past: the
  team's slice-seconds, decayed with a half-life (:class:`Usage`), over its weight.
  Within a team, jobs go by priority, then first in, first out.
* **A team may borrow** every slice no other team asks for.
* **Borrowed slices are reclaimed** through a checkpoint when a team asks for one and
  none is free: a running job of another team is preempted if, after the move, the
  asking team's share of the slices held now is still at most the other's (Kueue's
  ``LessThanOrEqualToFinalShare``: the rule that cannot ping-pong), or the asking team
  is under a slice count its ``[[team]]`` entry guarantees it and the other is over
  its own. Within a team, a job of higher priority preempts one of lower.
* **The victim costs least**: lowest priority first, then the team furthest over its
  share, then the most recently started; a job within its ``min_runtime_s`` only when
  nothing else can free the slice.

With no teams declared every job is in :data:`DEFAULT_TEAM` and this is the priority
queue of before: free slices in priority order, preemption by priority only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from jaxpod.service.auth.teams import DEFAULT_TEAM, Team

__all__ = ["DEFAULT_TEAM", "Plan", "Preempt", "Snapshot", "Start", "Started", "Team",
           "Usage", "Waiting", "plan", "shares", "wait_reasons", "why_waiting"]

@dataclass(frozen=True)
class Waiting:
    """A queued job, as the scheduler sees it.

    Attributes:
      rank: its place among its team's jobs (lower first): ``(-priority, order)``.
    """

    job_id: str
    team: str
    accelerator_types: tuple[str, ...]  # most preferred first
    num_slices: int
    priority: int
    rank: tuple[int, int]


@dataclass(frozen=True)
class Started:
    """A job holding (or acquiring) slices.

    Attributes:
      started_at: when this attempt started, on the scheduler's clock.
      preemptible: it runs and is not giving its slice up already.
    """

    job_id: str
    team: str
    accelerator_type: str
    num_slices: int
    priority: int
    started_at: float
    min_runtime_s: float = 0.0
    preemptible: bool = True


@dataclass(frozen=True)
class Usage:
    """Each team's slice-seconds as of ``at``, decayed with a half-life: what a slice
    held an hour ago counts half with a one-hour half-life."""

    at: float
    slice_seconds: Mapping[str, float] = field(default_factory=dict)

    def advance(self, now: float, held: Mapping[str, int], half_life_s: float) -> Usage:
        """The usage at ``now``, the teams having held ``held`` slices since ``at``."""
        span = max(0.0, now - self.at)
        if span == 0.0:
            return self
        decay = 0.5 ** (span / half_life_s)
        gained = half_life_s / math.log(2) * (1.0 - decay)  # ∫ of a held slice, decayed
        teams = set(self.slice_seconds) | set(held)
        values = {t: self.slice_seconds.get(t, 0.0) * decay + held.get(t, 0) * gained
                  for t in teams}
        return Usage(now, {t: v for t, v in values.items() if v > 1e-9})


@dataclass(frozen=True)
class Snapshot:
    """What the scheduler decides from.

    Attributes:
      free: free slices per accelerator type now.
      blocked: types a job is acquiring slices of now (one acquires at a time, so jobs
        start in order); nothing more starts on them this pass.
      yielding: jobs giving their slices up (or that gave them up moments ago) -> the
        queued job each does it for: that job takes a free slice of its type first,
        no other job is preempted for it, and the slices still held count as its
        team's.
      held_back: jobs their owners' quotas hold back (the jobs behind them go first).
      half_life_s: the half-life of :class:`Usage`.
    """

    now: float
    teams: Mapping[str, Team]
    usage: Usage
    waiting: Sequence[Waiting]
    started: Sequence[Started]
    free: Mapping[str, int]
    blocked: frozenset[str] = frozenset()
    yielding: Mapping[str, str] = field(default_factory=dict)
    held_back: frozenset[str] = frozenset()
    half_life_s: float = 3600.0


@dataclass(frozen=True)
class Start:
    job_id: str
    accelerator_type: str


@dataclass(frozen=True)
class Preempt:
    victim: str
    for_job: str
    accelerator_type: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """What to do now: jobs to start and jobs to preempt."""

    starts: tuple[Start, ...] = ()
    preemptions: tuple[Preempt, ...] = ()


def plan(snapshot: Snapshot) -> Plan:
    """The starts and preemptions the rules of the module give for ``snapshot``."""
    return _Planner(snapshot).run()


def why_waiting(snapshot: Snapshot, job_id: str) -> str | None:
    """Why one queued job waits (``None``: not queued); :func:`wait_reasons` for all."""
    return wait_reasons(snapshot).get(job_id)


def wait_reasons(snapshot: Snapshot) -> dict[str, str]:
    """Why each queued job waits, as its status says it, for all of them in one pass
    (a job list reads every one: one pass, not one per job)."""
    team_shares = shares(snapshot) if len(snapshot.teams) > 1 else {}
    ahead: dict[tuple[str, str], int] = {}  # (team, type) -> its jobs counted so far
    out: dict[str, str] = {}
    for job in sorted(snapshot.waiting, key=lambda w: w.rank):
        kinds = ", ".join(job.accelerator_types)
        before = max(ahead.get((job.team, k), 0) for k in job.accelerator_types)
        for k in job.accelerator_types:
            ahead[job.team, k] = ahead.get((job.team, k), 0) + 1
        held, entitled = team_shares.get(job.team, (0, math.inf))
        if held >= entitled:
            out[job.job_id] = (f"team {job.team} is at or over its share: it holds {held} "
                               f"of its {entitled:.3g} slice(s); no free {kinds} slice it "
                               "may take")
        elif before:
            out[job.job_id] = (f"behind {before} queued job(s) of team {job.team} for its "
                               "type (higher priority, or submitted earlier)")
        else:
            out[job.job_id] = f"no free {kinds} slice"
    return out


def weight_of(teams: Mapping[str, Team], name: str) -> float:
    team = teams.get(name)
    return team.weight if team is not None else 1.0


def shares(snapshot: Snapshot) -> dict[str, tuple[int, float]]:
    """Each active team's slices held now and its entitled slices: all held and free
    slices split by weight among the teams that hold or ask for some."""
    held = _held_by_team(snapshot.started)
    active = set(held) | {w.team for w in snapshot.waiting}
    total = sum(held.values()) + sum(snapshot.free.values())
    weights = {t: weight_of(snapshot.teams, t) for t in active}
    whole = sum(weights.values()) or 1.0
    return {t: (held.get(t, 0), total * weights[t] / whole) for t in sorted(active)}


def _held_by_team(started: Iterable[Started]) -> dict[str, int]:
    held: dict[str, int] = {}
    for s in started:
        held[s.team] = held.get(s.team, 0) + s.num_slices
    return held


class _Planner:
    """One :func:`plan` call's working state."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.s = snapshot
        self.horizon = snapshot.half_life_s / math.log(2)  # a held slice's decayed future
        self.free = dict(snapshot.free)
        self.blocked = set(snapshot.blocked)
        self.held: dict[str, int] = {}
        self.held_by_type: dict[tuple[str, str], int] = {}
        promised = set(snapshot.yielding.values())
        waiting_team = ({w.job_id: w.team for w in snapshot.waiting if w.job_id in promised}
                        if promised else {})
        self.served = set(snapshot.yielding.values())  # a slice is being freed for them
        self.counted: set[str] = set()  # served jobs whose promised slices are counted
        for job in snapshot.started:
            team = job.team
            if job.job_id in snapshot.yielding:  # its slices are promised
                team = waiting_team.get(snapshot.yielding[job.job_id], team)
                self.counted.add(snapshot.yielding[job.job_id])
            self._count(team, job.accelerator_type, job.num_slices)
        self.victims: dict[str, list[Started]] = {}  # by type
        for job in snapshot.started:
            if job.preemptible and job.job_id not in snapshot.yielding:
                self.victims.setdefault(job.accelerator_type, []).append(job)
        self.kinds = set(self.victims)  # what preempting can free
        self.weights = {t.name: t.weight for t in snapshot.teams.values()}
        self.starts: list[Start] = []
        self.preemptions: list[Preempt] = []

    def _count(self, team: str, kind: str, slices: int) -> None:
        self.held[team] = self.held.get(team, 0) + slices
        self.held_by_type[team, kind] = self.held_by_type.get((team, kind), 0) + slices

    def weight(self, team: str) -> float:
        return self.weights.get(team, 1.0)

    def share(self, team: str, extra: int = 0) -> float:
        """The team's use over its weight: its decayed slice-seconds so far plus what
        the slices it holds now (and ``extra`` more) will add while they are held,
        counted until they would have decayed away. One measure orders the teams for
        free slices and decides reclaims, so a slice given cannot be taken back at
        once (a slice moved changes the measure of both teams by more than it leaves
        between them)."""
        used = self.s.usage.slice_seconds.get(team, 0.0)
        return (used + (self.held.get(team, 0) + extra) * self.horizon) / self.weight(team)

    def team_order(self, teams: Iterable[str]) -> list[str]:
        """Furthest below its share first; ties heavier first, then by name."""
        return sorted(teams, key=lambda t: (self.share(t), -self.weight(t), t))

    def run(self) -> Plan:
        pending: dict[str, list[Waiting]] = {}
        for queued in sorted(self.s.waiting, key=lambda w: w.rank):
            if queued.job_id in self.served and queued.job_id not in self.s.held_back and any(
                    self._open(k, queued.num_slices) for k in queued.accelerator_types):
                self._start(queued)  # the slice freed for it
                continue
            pending.setdefault(queued.team, []).append(queued)
        # One start at a time, always for the team furthest below its share now; each
        # start blocks its type, so a pass starts at most one job per type.
        while True:
            for team in self.team_order(t for t, jobs in pending.items() if jobs):
                job = self._next_job(pending[team])
                if job is not None:
                    self._start(job)
                    pending[team].remove(job)
                    break
            else:
                break
        for team in self.team_order(t for t, jobs in pending.items() if jobs):
            self._reclaim_for(pending[team])
        return Plan(tuple(self.starts), tuple(self.preemptions))

    def _next_job(self, jobs: list[Waiting]) -> Waiting | None:
        """The team's first job that can start on a free slice now; a type an earlier
        job of the team waits for is that job's (jobs start in order on each type)."""
        remaining = {k for k, n in self.free.items() if n > 0 and k not in self.blocked}
        for job in jobs:
            if not remaining:
                return None
            if job.job_id in self.s.held_back:
                continue
            if any(k in remaining and self.free[k] >= job.num_slices
                   for k in job.accelerator_types):
                return job
            remaining.difference_update(job.accelerator_types)
        return None

    def _open(self, kind: str, num_slices: int) -> bool:
        return kind not in self.blocked and self.free.get(kind, 0) >= num_slices

    def _start(self, job: Waiting) -> None:
        kind = next(k for k in job.accelerator_types if self._open(k, job.num_slices))
        self.free[kind] -= job.num_slices
        self.blocked.add(kind)
        if job.job_id not in self.counted:  # else its promised slices were
            self._count(job.team, kind, job.num_slices)
        self.starts.append(Start(job.job_id, kind))

    def _reclaim_for(self, jobs: list[Waiting]) -> None:
        """Preempts for a team's waiting jobs, in order, while the rules allow: each job
        for its most preferred type, once a type found no victim none after it does."""
        failed: set[str] = set()
        for job in jobs:
            if failed >= self.kinds:
                return
            kind = job.accelerator_types[0]
            if (job.job_id in self.s.held_back or job.job_id in self.served
                    or kind in failed or kind not in self.kinds):
                failed.update(job.accelerator_types)
                continue
            victim = self._victim(job, kind)
            if victim is None:
                failed.update(job.accelerator_types)
            else:
                self._preempt(victim, job, kind)

    def _victim(self, job: Waiting, kind: str) -> Started | None:
        needed = job.num_slices - self.free.get(kind, 0)
        allowed: dict[tuple[str, int, int], bool] = {}  # one verdict per team and size
        shares: dict[str, float] = {}
        best: tuple[bool, int, float, float] | None = None
        chosen = None
        for v in self.victims[kind]:
            if v.num_slices < needed:
                continue
            key = (v.team, v.num_slices, v.priority if v.team == job.team else 0)
            if key not in allowed:
                allowed[key] = self._may_preempt(job, v)
            if not allowed[key]:
                continue
            if v.team not in shares:
                shares[v.team] = self.share(v.team)
            # protected (within its min_runtime_s) last, then lowest priority, the team
            # furthest over its share, the most recently started
            cost = (self.s.now - v.started_at < v.min_runtime_s, v.priority,
                    -shares[v.team], -v.started_at)
            if best is None or cost < best:
                best, chosen = cost, v
        return chosen

    def _may_preempt(self, job: Waiting, victim: Started) -> bool:
        if victim.team == job.team:
            return victim.priority < job.priority
        guaranteed = self.s.teams.get(job.team)
        kind = victim.accelerator_type
        if guaranteed is not None and kind in guaranteed.guaranteed:
            mine = self.held_by_type.get((job.team, kind), 0) + job.num_slices
            theirs_team = self.s.teams.get(victim.team)
            theirs_floor = theirs_team.guaranteed.get(kind, 0) if theirs_team else 0
            theirs = self.held_by_type.get((victim.team, kind), 0) - victim.num_slices
            if mine <= guaranteed.guaranteed[kind] and theirs >= theirs_floor:
                return True
        return self.share(job.team, job.num_slices) <= self.share(
            victim.team, -victim.num_slices)

    def _preempt(self, victim: Started, job: Waiting, kind: str) -> None:
        if victim.team == job.team:
            why = (f"preempted by job {job.job_id} (priority {job.priority} over "
                   f"{victim.priority})")
        else:
            why = (f"preempted by job {job.job_id} of team {job.team}: team "
                   f"{victim.team} holds {self.held.get(victim.team, 0)} slice(s), over "
                   f"its share")
        self.preemptions.append(Preempt(victim.job_id, job.job_id, kind, why))
        self.victims[kind] = [v for v in self.victims[kind] if v is not victim]
        self.served.add(job.job_id)
        self._count(victim.team, kind, -victim.num_slices)
        self._count(job.team, kind, victim.num_slices)
