"""The dispatcher: which queued job starts when, and the threads that run started ones.

Jobs wait in the :class:`~jaxpod.service.jobs.policies.QueuePolicy` (``PENDING``, with a
visible position). The dispatcher wakes on every submission, release, cancel and end of
an allocation (and every ``JAXPOD_JOB_DISPATCH_RECHECK_S``, for capacity that appears
outside this service: a node joining), takes a :class:`~.fair_share.Snapshot` of the
queue, the started jobs, the free slices and the teams' usage, and does what the
fair-share scheduler (:func:`~jaxpod.service.jobs.fair_share.plan`) decides: a started
job gets a :class:`~jaxpod.service.jobs.controller.JobController`, which runs it to its
end in a thread of its own; a preempted one checkpoints at its next loop boundary,
gives its slice up and queues again, first. Only one job per accelerator type
allocates at a time, so jobs start in order; owners' quotas hold jobs back.

An elastic job (several accelerator types, most preferred first) waits in the queue of
each type it accepts and starts on the most preferred one free; while it runs on a
less preferred type, a free slice of a more preferred one that no queued job waits for
has it checkpoint, give its slice up and start again there (it grows back, unless
submitted with ``grow_back=False``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jaxpod import settings
from jaxpod.jobs import JobSpec, JobState, JobStatus
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.teams import DEFAULT_TEAM, Team
from jaxpod.service.jobs import fair_share
from jaxpod.service.jobs.controller import (
    SHUTDOWN,
    JobController,
    JobSlices,
    StateChange,
    StopKind,
)
from jaxpod.service.jobs.events import JobEvents
from jaxpod.service.jobs.policies import FailureKind, QueuePolicy
from jaxpod.service.jobs.states import Allocating, Pending, Retrying, Running

logger = logging.getLogger(__name__)

#: The dispatcher looks for free slices on every release and submission, and at least
#: this often (capacity can also appear outside this service: a node joining).
DISPATCH_RECHECK = settings.JOB_DISPATCH_RECHECK
#: The half-life of the teams' usage, and a started job's default shelter from
#: preemption.
SHARE_HALF_LIFE = settings.JOB_SHARE_HALF_LIFE
MIN_RUNTIME = settings.JOB_MIN_RUNTIME
#: How long a slice freed for a queued job stays its own once let go.
RESERVATION = settings.JOB_ACQUIRE_TRY


class Dispatcher:
    """The queue of jobs waiting for a slice and the controllers of started ones.

    Args:
      slices: the slice provider (asked whether a type has free slices).
      queue: the queue policy.
      quotas: the owners' slice quotas (``None``: none); jobs over theirs wait.
      events: told when a job's visible status changes (its queue position, its reason
        to wait).
      make_controller: a started job's controller (this dispatcher among its
        callbacks).
      teams: the declared teams now (the tokens file's; it may change); none: every
        job is in the default team and slices go by priority alone.
    """

    def __init__(self, slices: JobSlices, queue: QueuePolicy,
                 quotas: SliceQuotas | None, events: JobEvents,
                 make_controller: Callable[[str, JobSpec], JobController],
                 teams: Callable[[], Mapping[str, Team]] = dict) -> None:
        self._slices = slices
        self._queue = queue
        self._teams = teams
        self._quotas = quotas
        self._events = events
        self._make_controller = make_controller
        #: Attempts preempted so far, by why: ``priority`` (a job of higher priority
        #: took the slice) or ``slice`` (a notice, a lost host, a broken slice).
        self.preemptions: collections.Counter[str] = collections.Counter()
        self._lock = threading.Condition()
        self._specs: dict[str, JobSpec] = {}  # queued jobs' specs
        self._owners: dict[str, str] = {}  # queued and started jobs' owners
        self._team_of: dict[str, str] = {}  # queued and started jobs' teams
        self._waits_for: dict[str, tuple[str, ...]] = {}  # queued jobs' types
        self._usage = fair_share.Usage(time.monotonic())
        self._last: fair_share.Snapshot | None = None  # the last pass's, for reasons
        self._reasons: tuple[fair_share.Snapshot, dict[str, str]] | None = None
        self._etas: tuple[fair_share.Snapshot | None, dict[str, float]] | None = None
        self._wait_reasons: dict[str, str] = {}  # queued jobs held back by their quota
        self._yielding: dict[str, str] = {}  # a job giving its slice up -> to which job
        # A queued job a slice is being freed for -> (the job freeing it, when that one
        # let it go (monotonic; None: not yet)): it gets the slice first, and no other
        # job is preempted for it meanwhile.
        self._reserved: dict[str, tuple[str, float | None]] = {}
        self._growing: dict[str, str] = {}  # an elastic job moving up -> to which type
        self._started: dict[str, float] = {}  # started jobs -> when (monotonic)
        self._active: dict[str, JobController] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._allocating: set[str] = set()  # accelerator types with a job acquiring
        self._kicked = False
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, name="jaxpod-jobs",
                                        daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def close(self, limit: float) -> None:
        """Stops dispatching; running jobs stop at their next loop boundary (waits up to
        ``limit`` seconds for each)."""
        with self._lock:
            self._closed = True
            for controller in self._active.values():
                controller.stop.request(SHUTDOWN)
            threads = list(self._threads.items())
            self._kick()
        for job_id, thread in threads:
            thread.join(limit)
            if thread.is_alive():
                logger.warning("job %s did not stop within %.0fs", job_id, limit)
        if self._thread.is_alive():
            self._thread.join(limit)

    def wake(self) -> None:
        """Something the dispatcher looks at changed (a release): it looks again."""
        with self._lock:
            self._kick()

    def _kick(self) -> None:
        """Under the lock. The flag keeps a change made while the dispatcher is not
        waiting (it is checking for free slices) from being missed until its recheck."""
        self._kicked = True
        self._lock.notify_all()

    # ------------------------------------------------------------------ the queue
    def enqueue(self, status: JobStatus, spec: JobSpec) -> None:
        with self._lock:
            self._waits_for[status.id] = self._types(spec, status.accelerator_type)
            for kind in self._waits_for[status.id]:
                self._queue.push(status.id, kind, spec.priority)
            self._specs[status.id] = spec
            self._owners[status.id] = status.owner
            self._team_of[status.id] = status.team or DEFAULT_TEAM
            self._kick()

    def cancel(self, job_id: str, reason: str, when_queued: Callable[[], None]) -> None:
        """Takes a queued job out of the queue (``when_queued`` records it, under the
        lock) or asks a started one to stop at its next loop boundary."""
        self._take_out(job_id, reason, StopKind.CANCEL, when_queued)

    def suspend(self, job_id: str, reason: str, when_queued: Callable[[], None]) -> None:
        """Takes a queued job out of the queue (``when_queued`` records it, under the
        lock) or asks a started one to checkpoint and give its slice up."""
        self._take_out(job_id, reason, StopKind.SUSPEND, when_queued)

    def _take_out(self, job_id: str, reason: str, kind: StopKind,
                  when_queued: Callable[[], None]) -> None:
        moved: list[str] = []
        with self._lock:
            before = self._queue.positions()
            if self._queue.remove(job_id):
                for table in (self._specs, self._owners, self._team_of, self._waits_for):
                    table.pop(job_id, None)
                moved = [j for j, p in before.items() if p > before[job_id]]
                when_queued()
            elif job_id in self._active:
                self._active[job_id].stop.request(reason, kind=kind)
        self._changed(moved)

    def positions(self) -> dict[str, int]:
        with self._lock:
            return self._queue.positions()

    def queued(self) -> dict[str, int]:
        """Queued jobs by accelerator type."""
        with self._lock:
            return dict(collections.Counter(s.accelerator_type or "" for s in self._specs.values()))

    @staticmethod
    def _types(spec: JobSpec, current: str) -> tuple[str, ...]:
        """The queues a job waits in: each type an elastic job accepts, else its own."""
        return spec.preferences() if spec.elastic else (current,)

    def why_waiting(self, status: JobStatus, position: int | None) -> str | None:
        """What a queued job waits for, as its status says it."""
        if status.state is not JobState.PENDING or position is None:
            return None
        quota = self._wait_reasons.get(status.id)
        if quota is not None:
            return f"over quota: {quota}"
        giving = [v for v, for_job in list(self._yielding.items()) if for_job == status.id]
        if giving:
            return f"job {giving[0]} is giving its slice up (checkpointing first)"
        last = self._last
        spec = self._specs.get(status.id)
        kinds = self._waits_for.get(status.id, (status.accelerator_type or "",))
        if last is not None and len(last.teams) > 1:  # teams share: say where it stands
            because = self._reasons_of(last).get(status.id)
            if because is not None:
                return because + self._expected_free(kinds)
        if position > 0:
            return (f"behind {position} queued job(s) of its type (higher priority, or "
                    "submitted earlier)")
        if spec is not None and spec.elastic:
            return f"no free slice of {', '.join(spec.preferences())}" + self._expected_free(
                kinds)
        return f"no free {status.accelerator_type or 'slice'} slice" + self._expected_free(
            kinds)

    def _reasons_of(self, snapshot: fair_share.Snapshot) -> dict[str, str]:
        """Every queued job's reason in ``snapshot``, worked out once per pass."""
        cached = self._reasons
        if cached is None or cached[0] is not snapshot:
            cached = self._reasons = (snapshot, fair_share.wait_reasons(snapshot))
        return cached[1]

    def _expected_free(self, kinds: Sequence[str]) -> str:
        """When the first slice of ``kinds`` should free, from the running jobs' steps
        left and rates ('' when no running job of those types has a rate yet)."""
        etas = self._etas_of(self._last)
        best = min(((etas[k], k) for k in kinds if k in etas), default=None)
        if best is None:
            return ""
        return f"; the next {best[1]} slice is expected free in ~{best[0]:.0f} s"

    def _etas_of(self, snapshot: fair_share.Snapshot | None) -> dict[str, float]:
        """Seconds until the first running job of each type ends, worked out once per
        pass (a job list asks it for every queued job) and counted down since."""
        now, cached = time.monotonic(), self._etas
        if snapshot is None or cached is None or cached[0] is not snapshot:
            ends: dict[str, float] = {}  # type -> when its first running job should end
            for controller in list(self._active.values()):
                run, kind = controller.run_now, controller.spec.accelerator_type or ""
                rate = run.rate.steps_per_s() if run is not None else None
                if run is not None and rate:
                    end = now + max(0.0, (controller.spec.steps - run.step) / rate)
                    ends[kind] = min(end, ends.get(kind, end))
            cached = self._etas = (snapshot, ends)
        return {kind: max(0.0, end - now) for kind, end in cached[1].items()}

    # ------------------------------------------------------------------ started jobs
    def controller(self, job_id: str) -> JobController | None:
        """The started job's controller (``None``: not started, or over)."""
        return self._active.get(job_id)

    def holders(self) -> dict[str, str]:
        """Slice name -> the job holding it."""
        with self._lock:
            return {name: f"job {job_id}" for job_id, c in self._active.items()
                    for name in c.slice_names}

    def slices_of(self, owner: str) -> int:
        """The slices ``owner``'s started jobs hold or are acquiring."""
        with self._lock:
            return sum(c.spec.num_slices for job_id, c in self._active.items()
                       if self._owners.get(job_id) == owner)

    # ------------------------------------------------------------------ dispatching
    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._kicked = False
            snapshot = self._snapshot(self._over_quota())
            decided = fair_share.plan(snapshot)
            started = False
            for start in decided.starts:
                spec = self._specs.get(start.job_id)
                if spec is not None:
                    started |= self._start_within_quota(start.accelerator_type,
                                                        start.job_id, spec)
            for preemption in decided.preemptions:
                self._preempt(preemption)
            self._grow_back()
            with self._lock:
                if not (self._closed or started or self._kicked):
                    self._lock.wait(DISPATCH_RECHECK.seconds())

    def _snapshot(self, held_back: set[str]) -> fair_share.Snapshot:
        """What the scheduler decides from, now; the teams' usage brought up to now."""
        now = time.monotonic()
        minimum = MIN_RUNTIME.seconds()
        teams = dict(self._teams())
        with self._lock:
            ranks = self._queue.ranks()
            waiting = [fair_share.Waiting(j, self._team_of.get(j, DEFAULT_TEAM),
                                          self._waits_for.get(j, (spec.accelerator_type or "",)),
                                          spec.num_slices, spec.priority, ranks[j])
                       for j, spec in self._specs.items() if j in ranks]
            started = [fair_share.Started(
                j, self._team_of.get(j, DEFAULT_TEAM), c.spec.accelerator_type or "",
                c.spec.num_slices, c.spec.priority, self._started.get(j, now),
                minimum if c.spec.min_runtime_s is None else c.spec.min_runtime_s,
                isinstance(c.state, Running) and j not in self._growing)
                for j, c in self._active.items()]
            self._expire_reservations(now)
            yielding = {v: j for j, (v, _) in self._reserved.items()}
            blocked = frozenset(self._allocating)
            held: dict[str, int] = {}
            for running in started:
                held[running.team] = held.get(running.team, 0) + running.num_slices
            self._usage = self._usage.advance(now, held, SHARE_HALF_LIFE.seconds())
            usage = self._usage
        sizes: dict[str, set[int]] = {}
        for job in waiting:
            for kind in job.accelerator_types:
                sizes.setdefault(kind, set()).add(job.num_slices)
        free = {kind: next((n for n in sorted(wanted, reverse=True) if self._free(kind, n)), 0)
                for kind, wanted in sizes.items() if kind not in blocked}
        snapshot = fair_share.Snapshot(
            now=now, teams=teams, usage=usage, waiting=waiting, started=started, free=free,
            blocked=blocked, yielding=yielding, held_back=frozenset(held_back),
            half_life_s=SHARE_HALF_LIFE.seconds())
        self._last = snapshot
        return snapshot

    def _free(self, accelerator_type: str, num_slices: int) -> bool:
        try:
            return bool(self._slices.has_free(accelerator_type, num_slices))
        except Exception:
            logger.exception("checking for free %s slices failed", accelerator_type)
            return False

    def _grow_back(self) -> None:
        """Has an elastic job running on a less preferred type move up to a more
        preferred one that is free and that no queued job waits for: it checkpoints at
        its next loop boundary, gives its slice up and queues again, first."""
        with self._lock:
            waiting = set(self._queue.waiting_types()) | self._allocating
            movers = [(j, c) for j, c in self._active.items()
                      if c.spec.elastic and c.spec.grow_back and isinstance(c.state, Running)
                      and j not in self._yielding and j not in self._growing]
            targets = set(self._growing.values())
        for job_id, controller in movers:
            spec = controller.spec
            order = spec.preferences()
            current = spec.accelerator_type or ""
            better = order[:order.index(current)] if current in order else ()
            up = next((k for k in better if k not in waiting and k not in targets
                       and self._free(k, spec.num_slices)), None)
            if up is None:
                continue
            with self._lock:
                if job_id not in self._active or job_id in self._yielding:
                    continue
                self._growing[job_id] = up
            targets.add(up)
            reason = (f"a {up} slice is free (preferred over {current}): checkpointed, it "
                      f"moves there")
            logger.info("job %s: %s", job_id, reason)
            controller.stop.request(reason, yielding=True)

    def _over_quota(self) -> set[str]:
        """The queued jobs their owners' quotas hold back now; each one's reason is kept
        for its status (a change is an event)."""
        if self._quotas is None:
            return set()
        with self._lock:
            queued = [(job_id, self._owners.get(job_id, ""), spec.num_slices)
                      for job_id, spec in self._specs.items()]
        verdicts: dict[tuple[str, int], str | None] = {}  # one count per owner and size
        for _, owner, wanted in queued:
            if (owner, wanted) not in verdicts:
                verdicts[owner, wanted] = self._quotas.over(owner, wanted)
        reasons = {job_id: why for job_id, owner, wanted in queued
                   if (why := verdicts[owner, wanted]) is not None}
        with self._lock:
            changed = {j for j in set(reasons) | set(self._wait_reasons)
                       if reasons.get(j) != self._wait_reasons.get(j)}
            self._wait_reasons = reasons
        self._changed(changed)
        return set(reasons)

    def _preempt(self, preemption: fair_share.Preempt) -> None:
        """Asks the scheduler's victim to give its slice up for the job it names: it
        checkpoints at its next loop boundary, releases the slice and queues again."""
        with self._lock:
            controller = self._active.get(preemption.victim)
            if (controller is None or preemption.victim in self._yielding
                    or not isinstance(controller.state, Running)):
                return  # it ended or moved meanwhile
            self._yielding[preemption.victim] = preemption.for_job
            self._reserved[preemption.for_job] = (preemption.victim, None)
        reason = f"{preemption.reason}: checkpointed, it waits for a slice again"
        logger.info("job %s %s", preemption.victim, reason)
        controller.stop.request(reason, yielding=True)

    def _expire_reservations(self, now: float) -> None:
        """Under the lock. A reservation ends when its job starts or leaves the queue,
        or JOB_ACQUIRE_TRY after the job freeing the slice let it go (another holder
        took it: the job may have another preempted for it)."""
        for job_id, (victim, since) in list(self._reserved.items()):
            if job_id not in self._specs:
                del self._reserved[job_id]
            elif victim not in self._active or victim not in self._yielding:
                if since is None:
                    self._reserved[job_id] = (victim, now)
                elif now - since > RESERVATION.seconds():
                    del self._reserved[job_id]

    def team_shares(self) -> list[dict[str, Any]]:
        """Each active team's weight, slices held now, entitled slices (all slices split
        by weight among the active teams), borrowed slices and queued jobs, from the
        last pass (empty before one, and where no teams are declared)."""
        last = self._last
        if last is None or not last.teams:
            return []
        queued: collections.Counter[str] = collections.Counter(w.team for w in last.waiting)
        return [{"team": team, "weight": fair_share.weight_of(last.teams, team),
                 "held": held, "entitled": round(entitled, 3),
                 "borrowed": max(0, held - int(entitled + 1e-9)), "queued": queued[team]}
                for team, (held, entitled) in fair_share.shares(last).items()]

    def _start_within_quota(self, accelerator_type: str, job_id: str, spec: JobSpec) -> bool:
        if self._quotas is None:
            return self._start(accelerator_type, job_id)
        started = [False]

        def start() -> None:
            started[0] = self._start(accelerator_type, job_id)

        owner = self._owners.get(job_id, "")
        return self._quotas.admit(owner, spec.num_slices, start) is None and started[0]

    def _start(self, accelerator_type: str, job_id: str) -> bool:
        with self._lock:
            if self._closed or job_id not in self._specs or not self._queue.remove(job_id):
                return False  # cancelled meanwhile
            spec = self._specs.pop(job_id)
            self._waits_for.pop(job_id, None)
            self._reserved.pop(job_id, None)
            if spec.elastic:  # this attempt's type; the spec keeps them all
                spec = spec.replace(accelerator_type=accelerator_type)
            self._allocating.add(accelerator_type)  # before the dispatcher looks again
            self._started[job_id] = time.monotonic()
            controller = self._make_controller(job_id, spec)
            thread = threading.Thread(target=self._run, args=(controller,),
                                      name=f"jaxpod-job-{job_id}", daemon=True)
            self._active[job_id], self._threads[job_id] = controller, thread
        self._changed(self.positions())  # the queue's positions moved up
        thread.start()
        return True

    def after_state_change(self, change: StateChange) -> None:
        """Keeps one job per accelerator type acquiring a slice at a time: no other job
        of its type starts while one is ``ALLOCATING`` (jobs start in queue order); a
        job that yielded its slice queues again, first of its priority."""
        controller = self._active.get(change.job_id)
        if controller is None:
            return
        with self._lock:
            kind = controller.spec.accelerator_type or ""
            if isinstance(change.new, Allocating):
                self._allocating.add(kind)
            elif isinstance(change.old, Allocating):
                self._allocating.discard(kind)
            if isinstance(change.new, Retrying) and change.new.cause.startswith(
                    FailureKind.PREEMPTION.value):
                self.preemptions["slice"] += 1
            if isinstance(change.new, Pending):
                if self._yielding.pop(change.job_id, None) is not None:
                    self.preemptions["priority"] += 1
                self._growing.pop(change.job_id, None)
                self._specs[change.job_id] = controller.spec
                self._waits_for[change.job_id] = self._types(controller.spec, kind)
                for queue in self._waits_for[change.job_id]:
                    self._queue.push(change.job_id, queue, controller.spec.priority,
                                     first=True)
            self._kick()

    def _run(self, controller: JobController) -> None:
        job_id = controller.job_id
        try:
            controller.run()
        finally:
            with self._lock:
                if self._active.get(job_id) is controller:  # not started again since
                    del self._active[job_id]
                    self._threads.pop(job_id, None)
                    self._started.pop(job_id, None)
                self._yielding.pop(job_id, None)
                self._growing.pop(job_id, None)
                if job_id not in self._specs and job_id not in self._active:
                    self._owners.pop(job_id, None)  # over, not queued again
                    self._team_of.pop(job_id, None)
                self._kick()
        if isinstance(controller.state, Pending):  # the queue's positions moved
            self._changed(self.positions())

    def _changed(self, job_ids: Iterable[str]) -> None:
        for job_id in list(job_ids):
            self._events.changed(job_id)
