"""One attempt of a job on a held slice: the loop that drives the slice's replica group.

The runner uses the same :class:`~jaxpod.service.group_engine.GroupEngine` handle as an
interactive session's strategy: it defines the job's step (and init and dataset
functions) from the client's pickles, which only the workers unpickle, builds the
state and the input, then runs ``steps_per_run`` steps per on-device loop and, after
each loop, reduces the declared outputs into metrics, records progress and collects
what the job's code printed. Cancellation is seen between loops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpod.errors import (
    OperationTimeoutError,
    SliceResetError,
    UnknownFunctionError,
    WorkerLostError,
    WorkerStartError,
)
from jaxpod.jobs import NoInput
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.group_engine import DefinedFunction, GroupEngine, GroupValue
from jaxpod.service.jobs.store import JobStore
from jaxpod.shipping import ShippedFunction

logger = logging.getLogger(__name__)

#: Errors that mean the slice, not the job's code, failed: a lost host or worker, a
#: group that fell out of step. The job is retried on a whole slice (a preemption).
SLICE_FAILURES: tuple[type[BaseException], ...] = (
    WorkerLostError, SliceResetError, WorkerStartError, OperationTimeoutError)


class Stopped(Exception):
    """The attempt stopped between loops because the job was cancelled or the service
    is stopping (``why`` says which)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass(frozen=True)
class Finished:
    """What a completed attempt leaves: the final state (numpy, replica 0's copy) and
    the last reduced outputs."""

    state: Any
    outputs: dict[str, Any]
    steps: int


class JobRun:
    """Runs attempt ``attempt`` of job ``job_id`` on ``engine``.

    Args:
      job_id: the job.
      spec: what the client submitted.
      engine: the held slice's replica group.
      store: where progress, metrics and logs go.
      stop: set to stop between loops; ``stop_reason()`` then says why.
      changed: called after each recorded change (watchers wake up).
    """

    def __init__(self, job_id: str, spec: pb.JobSpec, engine: GroupEngine, store: JobStore,
                 stop: threading.Event, stop_reason: Callable[[], str],
                 changed: Callable[[], None]) -> None:
        self.job_id = job_id
        self.spec = spec
        self.engine = engine
        self.store = store
        self._stop = stop
        self._stop_reason = stop_reason
        self._changed = changed
        self._versions = dict(spec.runtime_versions)

    def run(self) -> Finished:
        """Runs every step; raises what the job's code raised, a slice failure
        (:data:`SLICE_FAILURES`), or :class:`Stopped`."""
        engine, spec = self.engine, self.spec
        engine.capture_output(True)
        try:
            step = self._shipped(spec.step_fn)
            state = self._initial_state()
            iterator = self._input().iterate(spec.steps_per_run)
            done, outputs = 0, {}
            while done < spec.steps:
                self._check_stop()
                k = min(spec.steps_per_run, spec.steps - done)
                state, raw = self._defined_call(
                    step, lambda f: engine.run_steps(f, iterator, k, state))  # noqa: B023
                done += k
                outputs = self._reduce(raw)
                self._record(done, outputs)
            return Finished(self._final_state(state), outputs, done)
        finally:
            self._collect_logs()
            with contextlib.suppress(Exception):  # the slice may be gone: nothing to stop
                engine.capture_output(False)

    # ------------------------------------------------------------------ parts
    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Stopped(self._stop_reason())

    def _shipped(self, payload: bytes) -> tuple[ShippedFunction, list[DefinedFunction]]:
        shipped = ShippedFunction(payload, self._versions)
        return shipped, [self.engine.define(shipped)]

    def _defined_call(self, fn: tuple[ShippedFunction, list[DefinedFunction]],
                      call: Callable[[DefinedFunction], Any]) -> Any:
        """``call(defined fn)``; defined again if the workers' cache evicted it since."""
        shipped, defined = fn
        try:
            return call(defined[0])
        except UnknownFunctionError:
            defined[0] = self.engine.define(shipped)
            return call(defined[0])

    def _initial_state(self) -> Any:
        if not self.spec.init_fn:
            return ()
        init = self._shipped(self.spec.init_fn)
        return self._defined_call(init, self.engine.run)

    def _input(self) -> Any:
        spec, engine = self.spec, self.engine
        if spec.dataset:
            return engine.experimental_distribute_dataset(
                ShippedFunction(spec.dataset, self._versions))  # type: ignore[arg-type]
        if spec.dataset_fn:
            dataset_fn = self._shipped(spec.dataset_fn)
            return self._defined_call(dataset_fn, engine.distribute_datasets_from_function)
        return engine.experimental_distribute_dataset(NoInput(engine.num_replicas_in_sync))

    def _reduce(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Each declared output reduced over replicas, and over its rows (the real
        ones only) when it has any: as ``strategy.reduce(op, value, axis=0)``."""
        reduced = {}
        for name, op in self.spec.outputs.items():
            value = raw[name]
            axis = 0 if isinstance(value, GroupValue) and value.shape else None
            reduced[name] = np.asarray(self.engine.reduce(op, value, axis))
        return reduced

    def _record(self, step: int, outputs: Mapping[str, np.ndarray]) -> None:
        scalars = {name: float(v) for name, v in outputs.items() if v.size == 1}
        if scalars:
            self.store.add_metrics(self.job_id, step, scalars)
        else:
            self.store.set_step(self.job_id, step)
        self._collect_logs()
        self._changed()

    def _collect_logs(self) -> None:
        try:
            per_host = self.engine.take_output()
        except Exception as e:  # logs must never fail the job (nor hide its error)
            logger.debug("job %s: taking its output failed: %s", self.job_id, e)
            return
        for host, lines in enumerate(per_host):
            if lines:
                self.store.append_logs(self.job_id, host, lines)

    def _final_state(self, state: Any) -> Any:
        if not self.spec.init_fn:
            return None
        replicas = self.engine.experimental_local_results(state)
        return _plain(replicas[0])


def _plain(tree: Any) -> Any:
    """A nest the job store can keep: dict/list/tuple/None with numpy leaves."""
    return jax.tree.map(np.asarray, tree)
