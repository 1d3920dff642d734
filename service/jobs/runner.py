"""One attempt of a job on a held slice: the loop that drives the slice's replica group.

The runner uses the same :class:`~jaxpod.service.slices.group_engine.GroupEngine` handle as an
interactive session's strategy: it defines the job's step (and init and dataset
functions) from the client's pickles, which only the workers unpickle, builds the
state and the input, then runs ``steps_per_run`` steps per on-device loop and, after
each loop, reduces the declared outputs into metrics, records progress and collects
what the job's code printed.

Checkpoints are written by the hosts (:mod:`jaxpod.worker.checkpoints`, orbax), at loop
boundaries only (every ``checkpoint_every`` steps, rounded up to a loop): the runner
asks for one, the next loops run while its bytes go to storage, and the step is
recorded once the hosts report it committed. The last step's state is checkpointed
too: it is the job's result. A resumed attempt restores its state from the latest
committed step straight onto its devices and starts its input where each host was at
that step, so it runs the same loops as an uninterrupted one and ends with exactly its
numbers. Between loops the runner sees cancellation, the service stopping (it
checkpoints first) and preemption notices from the hosts (it checkpoints at once and
gives the slice up).

Every ``JAXPOD_JOB_HOST_POLL_S`` it also reads each host's input feed (:class:`HostInput`:
the time its steps waited for input, the chunks it has ready). The slice runs in lockstep,
so the host that waited longest held every host up that long: that time moves from the
goodput clock's productive steps to its input wait. The same reports time each host's
loops: a host that straggles is flagged (:mod:`~jaxpod.service.jobs.stragglers`) and every
host's Python stacks, read during the next loop, go to the job's logs. A loop that runs
``JAXPOD_JOB_HANG_TIMEOUT_S`` past the slowest of its length is hung: the stacks go to
the logs, the slice's workers restart and the job resumes from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpod import operations as ops
from jaxpod import settings
from jaxpod.errors import (
    JaxpodError,
    OperationTimeoutError,
    SliceResetError,
    UnknownFunctionError,
    WorkerLostError,
    WorkerStartError,
)
from jaxpod.job_wrappers import NoInput, Resumed
from jaxpod.jobs import HostInput, HostStacks, JobSpec
from jaxpod.operations import HostNews
from jaxpod.proto.stored import skeleton_from, skeleton_of
from jaxpod.service.jobs import goodput
from jaxpod.service.jobs.checkpoints import JobCheckpoints
from jaxpod.service.jobs.codec import JobStoreError, check_storable
from jaxpod.service.jobs.goodput import GoodputClock
from jaxpod.service.jobs.loop_times import HANG_TIMEOUT, LoopTimes, StepRate
from jaxpod.service.jobs.memory_plan import MemoryPlan, chosen_interval, memory_checkpoints_on
from jaxpod.service.jobs.scalars import TensorBoardScalars
from jaxpod.service.jobs.store import JobStore
from jaxpod.service.jobs.stragglers import HostCounters, Stragglers
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.group_handles import DefinedFunction, GroupIterator, GroupValue
from jaxpod.service.slices.profiles import Profiling
from jaxpod.shipping import ShippedFunction, ship_object

logger = logging.getLogger(__name__)

#: Errors that mean the slice, not the job's code, failed: a lost host or worker, a
#: group that fell out of step. The job is retried on a whole slice (a preemption).
SLICE_FAILURES: tuple[type[BaseException], ...] = (
    WorkerLostError, SliceResetError, WorkerStartError, OperationTimeoutError)


#: The span of recent loops a running attempt's step rate is measured over.
RATE_WINDOW = settings.JOB_RATE_WINDOW

#: How often, at most, the runner asks the hosts for what the job printed, for
#: preemption notices and for their input figures (between loops; a notice leaves 30 s
#: of grace): short loops do not pay three extra round trips each.
HOST_POLL = settings.JOB_HOST_POLL

#: The least time between two automatic logs of every host's stacks (stragglers).
STACKS_EVERY_S = 600.0



class JobStateError(JaxpodError, TypeError):
    """The job's state cannot be checkpointed or returned (a user error)."""


class HungLoopError(SliceResetError):
    """A loop ran past its hang limit (``JAXPOD_JOB_HANG_TIMEOUT_S`` beyond the slowest
    of its length): every host's stacks went to the job's logs, the slice's workers
    were restarted, and the job resumes from its newest checkpoint."""


class MemoryRestoreError(SliceResetError):
    """Restoring an in-memory checkpoint failed; the job's next attempt reads its
    persistent checkpoint."""


class Stopped(Exception):
    """The attempt stopped between loops because the job was cancelled or the service
    is stopping (``why`` says which)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Preempted(Exception):
    """A host announced its preemption; the attempt checkpointed at ``step`` and
    stopped, to go on on another slice."""

    def __init__(self, step: int, notice: str) -> None:
        super().__init__(f"preemption notice at step {step}: {notice}")
        self.step = step
        self.notice = notice


@dataclass(frozen=True)
class Finished:
    """What a completed attempt leaves: the last reduced outputs (its final state is
    the last checkpoint, on the hosts' storage)."""

    outputs: dict[str, Any]
    steps: int


@dataclass(frozen=True)
class RunContext:
    """What an attempt works with besides its slice.

    Attributes:
      store: where progress, metrics, logs and committed checkpoints go.
      checkpoints: the job's checkpoint directory.
      resume: the committed checkpoint step to start from (``None``: the beginning).
      stop: asks the attempt to stop between loops, saying why (when the service is
        stopping, it checkpoints first).
      clock: the job's goodput clock (the runner switches it between setup, steps,
        metrics, monitoring, checkpointing and the result).
      on_progress: called after each recorded loop (watchers wake up).
      redo_until: the furthest step an earlier attempt reached: steps up to it that
        this attempt runs again count as lost work.
      moved_from: the previous attempt's slice type when this one runs on another (an
        elastic job's move): its setup, restoring and compiling are the move's cost.
      memory: where the hosts' in-memory copies of ``resume`` are, when the attempt
        starts from those instead of storage.
    """

    store: JobStore
    checkpoints: JobCheckpoints
    resume: int | None
    stop: Any  # a controller.StopSignal (is_set, reason, shutting_down)
    clock: GoodputClock
    on_progress: Callable[[], None]
    redo_until: int = 0
    moved_from: str | None = None
    memory: MemoryPlan | None = None


class JobRun:
    """Runs one attempt of job ``job_id`` on ``engine`` (see :class:`RunContext`)."""

    def __init__(self, job_id: str, spec: JobSpec, engine: GroupEngine,
                 context: RunContext) -> None:
        self.job_id = job_id
        self.spec = spec
        self.engine = engine
        self.store = context.store
        self.checkpoints = context.checkpoints
        self.resume = context.resume
        self._stop = context.stop
        self._changed = context.on_progress
        self._clock = context.clock
        self._loops = LoopTimes(context.redo_until)
        self._next_host_poll = 0.0
        self._versions = dict(spec.runtime_versions or {})
        self.start_step = self.resume if self.resume is not None else 0
        self._memory_off = False  # an in-memory save failed: none for this attempt
        #: Steps done so far (what a lost attempt reached).
        self.step = self.start_step
        #: The steps checkpoints were asked for, oldest first (a resumed attempt's
        #: start with those its hosts keep).
        self._saved = [c.step for c in self.store.checkpoints(job_id)]
        #: Seconds each checkpoint not yet recorded as committed stalled the steps.
        self._stalls: dict[int, float] = {}
        self._checkpointed = self.start_step  # the last step a checkpoint was asked for
        self._committed = self.start_step  # the last step recorded as committed
        self._iterator: Any = None
        #: Each host's input feed as last read (empty before the first read).
        self.hosts: tuple[HostInput, ...] = ()
        self.rate = StepRate(self.start_step, RATE_WINDOW.seconds())
        self._input_waited = 0.0  # the longest host input wait moved to INPUT_WAIT so far
        #: Each host's programs loaded and compiled when the attempt began (its
        #: process may have run earlier holders' work).
        self._programs_before: list[tuple[int, int]] | None = None
        #: Profiles asked of this attempt (``JobManager.profile``).
        self.profiling = Profiling(self.checkpoints.directory)
        self._stragglers = Stragglers()
        #: Why the hosts' stacks are to be read during the next loop (``None``: no).
        self._stacks_wanted: str | None = None
        self._next_stacks = 0.0  # when flagging a straggler may log stacks again
        self._stack_readers: list[threading.Timer] = []
        self._loop_limit: float | None = None  # the running loop's, if it has one
        self._scalars = TensorBoardScalars(self.checkpoints.directory, self.start_step)
        #: The clock's totals when a moved attempt began (``None``: not moved, or its
        #: cost is booked).
        self._move_began: dict[str, float] | None = None
        self._moved_from = context.moved_from
        self._memory = context.memory
        #: The last step kept in the hosts' memory (its copies dispatched), if any.
        self.memorized: int | None = None
        self._memory_stall: float | None = None  # seconds the last one stalled the steps

    def run(self) -> Finished:
        """Runs the remaining steps; raises what the job's code raised, a slice
        failure (:data:`SLICE_FAILURES`), :class:`Stopped` or :class:`Preempted`."""
        engine, spec, clock = self.engine, self.spec, self._clock
        clock.switch(goodput.SETUP)
        if self._moved_from:
            self._move_began = clock.totals()
        engine.capture_output(True)
        self._programs_before = self._programs(self._poll_hosts())
        ended = "it finished"  # what a profile request still waiting is told
        try:
            if spec.mesh:  # a global-view job: one jax.jit program over the slice
                engine.set_global_view(spec.mesh, ShippedFunction(
                    spec.batch_sharding, self._versions) if spec.batch_sharding else None)
            step = self._shipped(spec.step_fn)
            state, starts = self._initial_state()
            self._check_storable(state, "as init_fn made it")
            self._iterator = iterator = self._input(starts).iterate(spec.steps_per_run)
            outputs: dict[str, Any] = {}
            while self.step < spec.steps:
                self._check_stop(state)
                k = min(spec.steps_per_run, spec.steps - self.step)
                clock.switch(goodput.PRODUCTIVE)
                started = time.monotonic()
                self._loop_limit = self._loops.limit(k)
                self._read_stacks_during_loop(k)
                try:
                    state, raw = self._defined_call(step, functools.partial(
                        self._loop, iterator, k, state))
                except SliceResetError as e:
                    if e.host_stacks is None:  # not a time-out: a host's own failure
                        raise
                    raise self._hung(e.host_stacks) from e
                clock.switch(goodput.METRICS)
                parts = self._loops.attribute(self.step, k, time.monotonic() - started)
                clock.reattribute(parts, source=goodput.PRODUCTIVE)
                if goodput.COMPILING in parts:  # the first loop's compiling is known
                    self._book_move()
                if self.step == self.start_step:
                    self._check_storable(state, "after the first loop")
                self.step += k
                outputs = self._reduce(raw)
                self._record(self.step, outputs)
                if self.profiling.active:
                    clock.switch(goodput.MONITORING)
                    self.profiling.at_boundary(engine.start_profile, engine.stop_profile)
                if time.monotonic() >= self._next_host_poll:
                    clock.switch(goodput.MONITORING)
                    self._next_host_poll = time.monotonic() + HOST_POLL.seconds()
                    self._check_notice(self._poll_hosts(), state)
                if self._checkpoint_due():
                    self._checkpoint(state, wait=False)
                if self._memory_due():
                    self._memory_checkpoint(state)
            clock.switch(goodput.MONITORING)
            self._poll_hosts()
            clock.switch(goodput.RESULT)
            if spec.init_fn:  # the final state is the job's result: on storage, not here
                self._checkpoint(state, wait=True, during=goodput.RESULT)
            self.drop_memory()
            return Finished(outputs, self.step)
        except BaseException as e:
            ended = f"{type(e).__name__}: {e}"
            if (isinstance(e, SliceResetError) and not isinstance(e, HungLoopError)
                    and e.host_stacks is not None):  # another operation timed out
                self._write_stacks(e.host_stacks, str(e).split(". ")[0])
            if not isinstance(e, SLICE_FAILURES):  # else the hosts cannot commit it
                self._settle_checkpoints()
            raise
        finally:
            self._book_move()
            self._write_scalars()  # what it recorded since the last write
            for reader in self._stack_readers:
                reader.cancel()
            self.profiling.finish(engine.stop_profile, ended)
            self._poll_hosts()  # what the job printed last
            with contextlib.suppress(Exception):  # the slice may be gone: nothing to stop
                engine.capture_output(False)

    def _book_move(self) -> None:
        """Moves a moved attempt's setup, restoring and compiling so far to
        :data:`~jaxpod.service.jobs.goodput.RESIZING` (once)."""
        began, self._move_began = self._move_began, None
        if began is None:
            return
        now = self._clock.totals()
        for category in (goodput.SETUP, goodput.RESTORING, goodput.COMPILING):
            spent = now[category] - began[category]
            if spent > 0:
                self._clock.reattribute({goodput.RESIZING: spent}, source=category)
        logger.info("job %s: moving from %s cost %.2fs", self.job_id, self._moved_from,
                    self._clock.totals()[goodput.RESIZING] - began[goodput.RESIZING])

    def _check_storable(self, state: Any, when: str) -> None:
        """Fails the job now, as the user's error, if its state could not be
        checkpointed or returned, rather than after its last step."""
        if not self.spec.init_fn:
            return
        try:
            check_storable(state, "the job's state", lambda x: isinstance(x, GroupValue))
        except JobStoreError as e:
            raise JobStateError(f"{e} (the state {when}). A job's state must be a pytree "
                                "of arrays, its dict keys numbers, strings or tuples of "
                                "them.") from None

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        every = self.spec.checkpoint_every or 0
        return every > 0 and self.step < self.spec.steps and \
            self.step - self._checkpointed >= every

    def _checkpoint(self, state: Any, wait: bool, during: str = goodput.CHECKPOINTING
                    ) -> None:
        """Has the hosts write the state and input positions at this loop boundary: the
        loop waits while the hosts set the state apart from what the next loop changes
        (:meth:`jaxpod.worker.checkpoints.HostCheckpoints.save`), then goes on while
        it reaches storage, unless ``wait`` (until it is committed).
        The time counts as ``during`` (the final state's checkpoint is the result)."""
        start = time.monotonic()
        with self._clock.during(during):
            if self.step != self._checkpointed:
                self.engine.save_checkpoint(self.checkpoints.directory, self.step,
                                            self.checkpoints.keep, state, self._iterator)
                self._checkpointed = self.step
                self._saved.append(self.step)
                self._stalls[self.step] = time.monotonic() - start
            if wait:
                waited_from = time.monotonic()
                committed = self.engine.wait_checkpoints(self.checkpoints.directory)
                if committed == self.step:
                    self._stalls[self.step] = (self._stalls.get(self.step, 0.0)
                                               + time.monotonic() - waited_from)
                self._commit(committed)

    def _memory_due(self) -> bool:
        every = chosen_interval(self.spec, self._memory_stall, self._step_s())
        last = self.memorized if self.memorized is not None else self.start_step
        return every > 0 and self.step < self.spec.steps and self.step - last >= every

    def _step_s(self) -> float | None:
        rate = self.rate.steps_per_s()
        return 1.0 / rate if rate else None

    def _memory_checkpoint(self, state: Any) -> None:
        """Has the hosts keep the state at this loop boundary in their nodes' memory and
        their peers' (:mod:`jaxpod.worker.memory_checkpoints`); the loop waits while the
        copies are dispatched. A failure costs the fast tier for the rest of the
        attempt, not the job (it is said once, not at every interval)."""
        if (not memory_checkpoints_on(self.spec) or self.step == self.memorized
                or self._memory_off):
            return
        start = time.monotonic()
        with self._clock.during(goodput.CHECKPOINTING):
            try:
                self.engine.save_memory_checkpoint(self.job_id, self.step, state,
                                                   self._iterator)
            except SLICE_FAILURES:
                raise
            except Exception as e:
                logger.warning("job %s: an in-memory checkpoint at step %d failed, so this "
                               "attempt keeps none (its persistent checkpoints go on): %s",
                               self.job_id, self.step, e)
                self._memory_off = True
                return
        self._memory_stall = time.monotonic() - start
        self.memorized = self.step

    def drop_memory(self) -> None:
        """The job is done (no attempt follows): its in-memory checkpoints leave the
        hosts' nodes' RAM (if that fails it is logged; the nodes sweep a day-old folder)."""
        if memory_checkpoints_on(self.spec) or self._memory is not None:
            try:
                self.engine.drop_memory_checkpoints(self.job_id)
            except Exception as e:  # the nodes sweep stale ones
                logger.warning("job %s: dropping its in-memory checkpoints failed: %s",
                               self.job_id, e)

    def _commit(self, step: int | None) -> None:
        """The hosts committed checkpoint ``step``: it is recorded (and resumable), with
        the steps before it they keep (they removed older ones as it committed, but for
        those a fork reads)."""
        if step is None or step <= self._committed:
            return
        saved, keep = [s for s in self._saved if s <= step], self.checkpoints.keep
        pinned = self.checkpoints.pinned_steps() if len(saved) > keep else set()
        kept = [s for s in saved[:-keep] if s in pinned] + saved[-keep:]
        self._saved = kept + [s for s in self._saved if s > step]
        self._stalls = {s: t for s, t in self._stalls.items() if s in self._saved}
        self.store.set_checkpoints(self.job_id, {s: self.checkpoints.state_path(s)
                                                 for s in kept}, self._stalls)
        self._committed = step
        self._write_scalars()
        self._changed()

    def _settle_checkpoints(self) -> None:
        """An attempt that stops with its slice whole waits for the checkpoint still
        being written and records it (the hosts drop the oldest as it commits). After
        a lost slice the controller reads what the hosts committed from storage."""
        if self._checkpointed > self._committed:
            try:
                self._commit(self.engine.wait_checkpoints(self.checkpoints.directory))
            except Exception as e:
                logger.warning("job %s: waiting for its last checkpoint failed: %s",
                               self.job_id, e)

    def _check_stop(self, state: Any) -> None:
        if not self._stop.is_set():
            return
        ends = self._stop.ends_the_job
        if self._stop.checkpoints_first and self.step > self.start_step:
            # The next coordinator, or the job's next turn, resumes here.
            if not ends:
                self._memory_checkpoint(state)
            self._checkpoint(state, wait=True)
        if ends:  # no attempt follows: its copies in the nodes' RAM go now
            self.drop_memory()
        raise Stopped(self._stop.reason)

    def _check_notice(self, news: Sequence[HostNews], state: Any) -> None:
        """A host was told it will be preempted: checkpoint now and give the slice up."""
        noticed = [(h, n.notice) for h, n in enumerate(news) if n.notice is not None]
        if noticed:
            host, notice = noticed[0]
            self._memory_checkpoint(state)  # both tiers
            self._checkpoint(state, wait=True)
            raise Preempted(self.step, f"host {host}: {notice.reason}")

    # ------------------------------------------------------------------ parts

    def _shipped(self, payload: bytes) -> tuple[ShippedFunction, list[DefinedFunction]]:
        shipped = ShippedFunction(payload, self._versions)
        return shipped, [self.engine.define(shipped)]

    def _loop(self, iterator: GroupIterator, steps: int, state: Any, fn: DefinedFunction
              ) -> Any:
        """``steps`` steps of ``fn`` from ``state``: the new state and the outputs, once
        computed (the loop's time is the steps' compute, not their dispatch), within
        the loop's hang limit."""
        engine = self.engine
        return engine.make_values(fn, lambda f: ops.RunSteps(
            f, iterator.id, steps, engine.handles(state), wait=True),
            timeout=self._loop_limit)

    # ------------------------------------------------------------------ stragglers, hangs
    def _read_stacks_during_loop(self, k: int) -> None:
        """If a straggler was just flagged, reads every host's stacks halfway through
        the loop about to start (between loops they show idle hosts) into the logs."""
        why, self._stacks_wanted = self._stacks_wanted, None
        if why is None:
            return
        paces = self._stragglers.paces
        delay = 0.5 * k * max((p.step_s for p in paces), default=0.0)
        reader = threading.Timer(delay, self._log_stacks, (why,))
        reader.daemon = True
        self._stack_readers = [r for r in self._stack_readers if r.is_alive()] + [reader]
        reader.start()

    def stacks(self) -> list[HostStacks]:
        """Every host's Python stacks, read now."""
        group = self.engine.group
        where, texts = group.info, group.stacks()
        return [HostStacks(i, str(where[i].get("node", "")) if i < len(where) else "",
                           int(where[i].get("pid", 0)) if i < len(where) else 0, text)
                for i, text in enumerate(texts)]

    def _log_stacks(self, why: str) -> None:
        self._write_stacks(self.engine.group.stacks(), why)

    def _write_stacks(self, stacks: Sequence[str], why: str) -> None:
        for host, text in enumerate(stacks):
            self.store.append_logs(self.job_id, host, [
                f"[jaxpod] {why}. Python stacks of host {host}:", *text.splitlines()])

    def _hung(self, stacks: Sequence[str]) -> HungLoopError:
        """The loop ran past its limit and the slice restarted: where each host was
        goes to the logs; the error to end the attempt with."""
        limit = self._loop_limit
        said = (f"{limit:.4g} s (the slowest loop of its length + {HANG_TIMEOUT.env_var})"
                if limit is not None else f"its limit ({settings.OPERATION_TIMEOUT.env_var})")
        why = f"the loop from step {self.step} ran past {said} and is taken as hung"
        self._write_stacks(stacks, f"{why}: the slice's workers restart and the job resumes "
                                   "from its newest checkpoint")
        return HungLoopError(f"{why[0].upper()}{why[1:]}; every host's Python stacks are in "
                             "the job's logs (`jaxpod logs ID`).")

    def _defined_call(self, fn: tuple[ShippedFunction, list[DefinedFunction]],
                      call: Callable[[DefinedFunction], Any]) -> Any:
        """``call(defined fn)``; defined again if the workers' cache evicted it since."""
        shipped, defined = fn
        try:
            return call(defined[0])
        except UnknownFunctionError:
            defined[0] = self.engine.define(shipped)
            return call(defined[0])

    def _initial_state(self) -> tuple[Any, list[Any] | None]:
        """The state (``()`` for a job without one) and, for a resumed attempt, each
        host's input position at its checkpoint. A resumed state is restored from the
        checkpoint straight onto the devices; a new one is ``init_fn``'s (and its
        structure is recorded, for the attempts that restore it)."""
        spec, store = self.spec, self.store
        if self.resume is not None:
            raw = store.state_skeleton(self.job_id) if spec.init_fn else None
            skeleton = skeleton_from(raw) if raw is not None else ()
            # A global-view state goes where init_fn (compiled, not run) would put it.
            init = (self._shipped(spec.init_fn)[1][0] if spec.mesh and spec.init_fn
                    else None)
            with self._clock.during(goodput.RESTORING):
                if self._memory is not None:
                    return self._restore_memory(self._memory, skeleton, init)
                return self.engine.restore_checkpoint(
                    self.checkpoints.directory_of(self.resume), self.resume,
                    self.checkpoints.keep, skeleton, init)
        if not spec.init_fn:
            return (), None
        state = self._defined_call(self._shipped(spec.init_fn), self.engine.run)
        store.set_state_skeleton(self.job_id, skeleton_of(
            state, lambda x: isinstance(x, GroupValue)))
        return state, None

    def _restore_memory(self, plan: MemoryPlan, skeleton: Any, init: Any
                        ) -> tuple[Any, list[Any]]:
        try:
            state = self.engine.restore_memory_checkpoint(self.job_id, plan.step, plan.sources,
                                                          skeleton, init)
        except SLICE_FAILURES:
            raise
        except Exception as e:
            raise MemoryRestoreError(
                f"restoring {plan.describe()} failed ({type(e).__name__}: {e}); the next "
                "attempt reads the persistent checkpoint") from e
        return state, list(plan.positions)

    def _input(self, starts: list[Any] | None) -> Any:
        """The job's input; a resumed attempt's starts where each host's was at its
        checkpoint (:class:`~jaxpod.job_wrappers.Epochs`: by index or iterator state where the
        input can seek, else by reading it again)."""
        spec, engine = self.spec, self.engine
        if spec.dataset and starts:
            # Every host reads the whole stream; the last takes each step's last rows,
            # so its position names the element the next step starts in exactly.
            starts = [starts[-1]] * len(starts)
        if spec.dataset or spec.dataset_fn:
            payload = spec.dataset or spec.dataset_fn
            source: Any = (ShippedFunction(payload, self._versions) if starts is None else
                           ship_object(Resumed(payload, self._versions, tuple(starts)),
                                       "the job's input", ""))
            if spec.dataset:
                return engine.experimental_distribute_dataset(source)
            return self._defined_call((source, [engine.define(source)]),
                                      engine.distribute_datasets_from_function)
        return engine.experimental_distribute_dataset(NoInput(engine.num_replicas_in_sync))

    def _reduce(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Each declared output reduced over replicas, and over its rows (the real
        ones only) when it has any: as ``strategy.reduce(op, value, axis=0)``. Outputs
        with the same op and axis go in one call."""
        groups: dict[tuple[str, int | None], dict[str, Any]] = {}
        for name, op in self.spec.declared_outputs().items():
            value = raw[name]
            axis = 0 if isinstance(value, GroupValue) and value.shape else None
            groups.setdefault((op, axis), {})[name] = value
        reduced = {}
        for (op, axis), values in groups.items():
            for name, result in self.engine.reduce(op, values, axis).items():
                reduced[name] = np.asarray(result)
        return reduced

    def _record(self, step: int, outputs: Mapping[str, np.ndarray]) -> None:
        self.rate.add(step)
        scalars = {name: float(v) for name, v in outputs.items() if v.size == 1}
        if scalars:
            self.store.add_metrics(self.job_id, step, scalars)
        else:
            self.store.set_step(self.job_id, step)
        if self._scalars.due():
            self._write_scalars()
        if step - self.start_step <= self.spec.steps_per_run:  # the attempt's first loop
            self.store.first_loop_done(
                self.job_id, self._programs_since(self._programs(self._poll_hosts()),
                                                  self._programs_before))
        self._changed()

    def _write_scalars(self) -> None:
        """The metrics recorded since the last write, with the attempt's rate and
        goodput, as TensorBoard scalars in the job's folder (:mod:`.scalars`)."""
        try:
            series = self.store.metrics(self.job_id, after=self._scalars.after)
        except Exception as e:  # a report must never fail the job
            logger.debug("job %s: reading its metrics failed: %s", self.job_id, e)
            return
        extra = {f"goodput/{name}": value
                 for name, value in goodput.summary(self._clock.totals()).items()}
        rate = self.rate.steps_per_s()
        if rate is not None:
            extra["steps_per_s"] = rate
        self._scalars.write(series, extra)

    @staticmethod
    def _programs(news: Sequence[HostNews]) -> list[tuple[int, int]] | None:
        """Each host's programs loaded from the compilation cache and compiled
        (``None``: a host's news could not be read, or its cache is off)."""
        if not news or any(n.programs_loaded is None or n.programs_compiled is None
                           for n in news):
            return None
        return [(n.programs_loaded or 0, n.programs_compiled or 0) for n in news]

    @staticmethod
    def _programs_since(now: list[tuple[int, int]] | None,
                        before: list[tuple[int, int]] | None) -> tuple[int, int] | None:
        """What the attempt's first loop cost its hosts: the fewest programs a host
        loaded from the cache and the most a host compiled (the slice waits for the
        slowest host, so one host compiling is the whole slice waiting)."""
        if now is None or before is None or len(now) != len(before):
            return None
        since = [(n[0] - b[0], n[1] - b[1]) for n, b in zip(now, before, strict=True)]
        return min(s[0] for s in since), max(s[1] for s in since)

    def _poll_hosts(self) -> list[HostNews]:
        """One report from every host: the lines the job printed (to its logs), its
        input figures (the slice runs in lockstep, so the new wait of the host that
        waited longest moves from productive to input wait) and the newest checkpoint
        they committed. Empty when the hosts cannot be read (a report must never fail
        the job, nor hide its error)."""
        try:
            news = self.engine.host_reports(self.checkpoints.directory)
        except Exception as e:
            logger.debug("job %s: reading its hosts' reports failed: %s", self.job_id, e)
            return []
        for host, report in enumerate(news):
            if report.lines:
                self.store.append_logs(self.job_id, host, report.lines)
        if news:
            self._commit(news[0].checkpoint)  # committed means every host committed
        where = self.engine.group.info
        stragglers = self._stragglers
        flagged = stragglers.update([HostCounters(n.loop_steps, n.loop_s, n.input_wait_s)
                                     for n in news])
        for host in flagged:
            why = f"host {host} straggles: {stragglers.flagged[host]}"
            # Every host's stacks at most every STACKS_EVERY_S: a host that keeps
            # being flagged and let go must not fill the logs with 256 hosts' stacks.
            dump = time.monotonic() >= self._next_stacks
            self.store.append_logs(self.job_id, host, [
                f"[jaxpod] {why}" + ("; every host's Python stacks follow, read during the "
                                     "next loop" if dump else "") +
                " (`jaxpod job stacks ID` reads them now)."])
            if dump:
                self._stacks_wanted = why
                self._next_stacks = time.monotonic() + STACKS_EVERY_S
        paces = stragglers.paces if len(stragglers.paces) == len(news) else ()
        self.hosts = tuple(HostInput(i, n.input_wait_s, n.input_queue_depth,
                                     str(where[i].get("node", "")),
                                     str(where[i].get("address", "")),
                                     int(where[i].get("pid", 0)),
                                     paces[i].step_s if paces else 0.0,
                                     stragglers.flagged.get(i, ""))
                           for i, n in enumerate(news))
        waited = max((h.input_wait_s for h in self.hosts), default=0.0)
        if waited > self._input_waited:
            self._clock.reattribute({goodput.INPUT_WAIT: waited - self._input_waited},
                                    source=goodput.PRODUCTIVE)
            self._input_waited = waited
        return news
