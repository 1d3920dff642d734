"""Jobs from the client's side: :func:`build_spec` (what ``client.submit`` sends) and
:class:`Job` (a handle on a submitted job, from any process).

Everything about the user's input that the client can check is checked here, before
anything is sent, with an error that names the value and the fix. The user's objects
travel wrapped in the :mod:`jaxpod.job_wrappers` classes the workers run (``JobStep``,
``Epochs``, ``EpochsFn``, ``InitialState``), pickled by value.

A job outlives its client: a :class:`Job` holds only the id, and every method asks
the service.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from jaxpod import errors, settings, trees
from jaxpod.client import rpc
from jaxpod.job_wrappers import Epochs, EpochsFn, InitialState, JobStep, is_reiterable
from jaxpod.jobs import (
    FORKABLE,
    SUBMIT_DEFAULTS,
    SUBMIT_KEYWORDS,
    Attempt,
    HostInput,
    HostStacks,
    JobCheckpoint,
    JobDetails,
    JobProfile,
    JobResult,
    JobSpec,
    JobStatus,
    Transition,
    check_mesh_axes,
    check_outputs,
    check_profile_seconds,
    check_state,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.proto.job_messages import from_message, to_message

if TYPE_CHECKING:
    from jaxpod.client.client import Client

__all__ = ["SUBMIT_DEFAULTS", "SUBMIT_KEYWORDS", "Job", "build_spec", "check_state",
           "submit_spec"]

#: How long a broken watch stream is re-opened for while the service is unreachable
#: (a coordinator restart); the window starts again with every status received.
WATCH_RECONNECT_TIMEOUT = settings.WATCH_RECONNECT
#: How often ``log_lines(follow=True)`` asks for new lines: the service reads them
#: from the hosts about as often (``JAXPOD_JOB_HOST_POLL_S``).
LOG_FOLLOW_POLL_S = 0.5
_RECONNECT_DELAYS_S = (0.1, 0.25, 0.5, 1.0, 2.0)
#: Room left in a message for the spec's plain fields and gRPC's framing.
_SPEC_SLACK_BYTES = 64 * 1024


# ------------------------------------------------------------------------ the spec
def build_spec(step_fn: Callable[..., Any], *, steps: int,
               accelerator_type: str | Sequence[str] | None,
               init_fn: Callable[[], Any] | None, initial_state: Any, dataset: Any,
               dataset_fn: Callable[..., Any] | None, steps_per_run: int,
               outputs: Mapping[str, Any] | None, checkpoint_every: int | None,
               name: str | None, num_slices: int, max_retries_preemption: int,
               max_retries_failure: int, priority: int = 0,
               computation_shape: Sequence[int] | None = None,
               mesh: Mapping[str, int] | None = None, batch_sharding: Any = None,
               grow_back: bool = True, memory_checkpoint_every: int | None = None,
               min_runtime_s: float | None = None, max_runtime_s: float | None = None
               ) -> JobSpec:
    """Checks ``client.submit``'s arguments and builds the ``JobSpec`` it sends.

    Raises:
      TypeError, ValueError: an argument is of the wrong kind or out of range (the
        message names it, what was received and how to fix it), or an object cannot
        be pickled.
      jaxpod.MessageTooLargeError: the shipped objects exceed the message size limit.
    """
    from jaxpod.shipping import runtime_versions, ship_object

    if not callable(step_fn):
        raise TypeError(
            f"submit: step_fn must be a function step_fn(state, batch) -> (state, outputs). "
            f"Got {_show(step_fn)}. Pass the function itself (submit(step_fn, ...)), not "
            "the result of calling it.")
    steps = _check_int("steps", steps, 1, "the number of steps the job runs, e.g. steps=1000")
    steps_per_run = _check_int("steps_per_run", steps_per_run, 1,
                               "steps per on-device loop, e.g. steps_per_run=10")
    num_slices = _check_int("num_slices", num_slices, 1, "slices the job runs on, e.g. 1")
    max_retries_preemption = _check_int(
        "max_retries_preemption", max_retries_preemption, 0,
        "how often a preempted job is retried, e.g. 10 (0: never)")
    max_retries_failure = _check_int(
        "max_retries_failure", max_retries_failure, 0,
        "how often a job whose code raised is retried, e.g. 0 (never)")
    priority = _check_int("priority", priority, -PRIORITY_LIMIT,
                          "higher runs first and preempts lower ones, e.g. 0 (the default) "
                          "or 10", PRIORITY_LIMIT)
    if checkpoint_every is not None:
        checkpoint_every = _check_int(
            "checkpoint_every", checkpoint_every, 1,
            "steps between checkpoints, e.g. checkpoint_every=100, or None for none")
    if memory_checkpoint_every is not None:
        memory_checkpoint_every = _check_int(
            "memory_checkpoint_every", memory_checkpoint_every, 0,
            "steps between in-memory checkpoints, e.g. memory_checkpoint_every=10, 0 for "
            "none, or None to let the service choose")
    min_runtime_s = _check_seconds("min_runtime_s", min_runtime_s, 0.0,
                                   "seconds a started attempt runs before it may be "
                                   "preempted, e.g. min_runtime_s=600")
    max_runtime_s = _check_seconds("max_runtime_s", max_runtime_s, 1e-3,
                                   "seconds the job may run in all, e.g. "
                                   "max_runtime_s=3600")
    preferences = _check_accelerator_types(accelerator_type)
    if not isinstance(grow_back, bool):
        raise TypeError(f"submit: grow_back must be True (an elastic job moves up to a "
                        f"more preferred type once one is free) or False (it stays). Got "
                        f"{_show(grow_back)}.")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"submit: name must be a string (or None: the job's id). "
                        f"Got {_show(name)}.")

    if init_fn is not None and initial_state is not None:
        raise ValueError(
            "submit: got both init_fn and initial_state; pass one of them: init_fn to build "
            "the state on every replica (as strategy.run(init_fn)), or initial_state to give "
            "every replica the same value.")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"submit: init_fn must be a function of no arguments returning the "
                        f"initial state. Got {_show(init_fn)}. To start from a value, pass "
                        "initial_state=... instead.")
    if dataset is not None and dataset_fn is not None:
        raise ValueError(
            "submit: got both dataset and dataset_fn; pass one of them: dataset (global "
            "batches, split over every replica) or dataset_fn (called once per host with a "
            "jaxpod.InputContext).")
    if dataset is not None:
        _check_dataset(dataset)
    if dataset_fn is not None and not callable(dataset_fn):
        raise TypeError(f"submit: dataset_fn must be a function dataset_fn(input_context) "
                        f"returning that host's batches. Got {_show(dataset_fn)}. To pass "
                        "the batches themselves, use dataset=... instead.")
    checked_outputs = check_outputs(outputs)
    shape = _check_computation_shape(computation_shape)
    axes = _check_global_view(mesh, batch_sharding, shape)

    stateful = init_fn is not None or initial_state is not None
    has_input = dataset is not None or dataset_fn is not None
    step = JobStep(step_fn, tuple(checked_outputs), stateful=stateful, has_input=has_input)
    shipped: dict[str, bytes] = {}
    if init_fn is not None:
        shipped["init_fn"] = ship_object(init_fn, f"init_fn {_qualname(init_fn)}",
                                         _CAPTURE_FIX).payload
    elif initial_state is not None:
        shipped["init_fn"] = ship_object(
            InitialState(initial_state), f"initial_state ({type(initial_state).__name__})",
            "initial_state must be a nest of arrays and plain Python values.").payload
    if dataset is not None:
        shipped["dataset"] = ship_object(
            Epochs(dataset), f"dataset ({type(dataset).__name__})",
            "Pass a list of batches (numpy arrays or nests of them), or use dataset_fn= "
            "to build the data on the hosts.").payload
    elif dataset_fn is not None:
        shipped["dataset_fn"] = ship_object(EpochsFn(dataset_fn),
                                            f"dataset_fn {_qualname(dataset_fn)}",
                                            _CAPTURE_FIX).payload
    if batch_sharding is not None:
        shipped["batch_sharding"] = ship_object(
            batch_sharding, "batch_sharding", "Pass jax.sharding.PartitionSpec objects.").payload
    spec = JobSpec(
        steps=steps, accelerator_type=preferences[0] if preferences else None,
        accelerator_types=preferences if len(preferences) > 1 else None, grow_back=grow_back,
        steps_per_run=steps_per_run,
        outputs=checked_outputs or None, checkpoint_every=checkpoint_every,
        memory_checkpoint_every=memory_checkpoint_every, min_runtime_s=min_runtime_s,
        max_runtime_s=max_runtime_s, name=name, num_slices=num_slices,
        max_retries_preemption=max_retries_preemption,
        max_retries_failure=max_retries_failure, priority=priority, computation_shape=shape,
        mesh_axes=tuple(axes) if axes else None,
        mesh_shape=tuple(axes.values()) if axes else None,
        runtime_versions=runtime_versions(),
        step_fn=ship_object(step, f"step_fn {_qualname(step_fn)}", _CAPTURE_FIX).payload,
        **shipped)
    _check_spec_size(spec)
    return spec


_CAPTURE_FIX = ("Functions must not capture locks, sockets, open files or similar objects; "
                "create those inside the function.")


def _check_accelerator_types(accelerator_type: Any) -> tuple[str, ...]:
    """``accelerator_type`` as the slice types in order of preference (empty: the
    cluster's first type)."""
    fix = ("a slice type such as 'v4-16', a sequence of them in order of preference "
           "such as ('v4-16', 'v4-8') for an elastic job, or None for the cluster's first "
           "slice type")
    if accelerator_type is None:
        return ()
    if isinstance(accelerator_type, str):
        types: tuple[Any, ...] = (accelerator_type,)
    elif isinstance(accelerator_type, Sequence):
        types = tuple(accelerator_type)
    else:
        raise TypeError(f"submit: accelerator_type must be {fix}. "
                        f"Got {_show(accelerator_type)}.")
    if not types or not all(isinstance(t, str) and t for t in types):
        raise TypeError(f"submit: accelerator_type must be {fix}. "
                        f"Got {_show(accelerator_type)}.")
    repeated = sorted({t for t in types if types.count(t) > 1})
    if repeated:
        raise ValueError(f"submit: accelerator_type names {repeated} more than once "
                         f"({accelerator_type!r}); name each slice type once, the most "
                         "preferred first.")
    return types


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _qualname(fn: Any) -> str:
    return repr(getattr(fn, "__qualname__", type(fn).__name__))


def _check_computation_shape(shape: Any) -> tuple[int, ...] | None:
    """``computation_shape`` as a tuple (``None``: one device per replica)."""
    if shape is None:
        return None
    fix = ("logical devices per replica along each axis of the slice's device mesh, "
           "as DeviceAssignment.build takes it, e.g. computation_shape=[1, 1, 1, 2] "
           "for 2, or None for one")
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence):
        raise TypeError(f"submit: computation_shape must be a list of ints ({fix}). "
                        f"Got {_show(shape)}.")
    return tuple(_check_int("computation_shape", d, 1, fix) for d in shape)


def _check_global_view(mesh: Any, batch_sharding: Any, computation_shape: Any
                       ) -> dict[str, int] | None:
    """``mesh`` checked (``None``: a per-replica job), and ``batch_sharding`` with it."""
    if mesh is None:
        if batch_sharding is not None:
            raise ValueError("submit: batch_sharding splits a global-view job's batches; "
                             "pass mesh={...} too (e.g. mesh={'data': -1}), or drop it.")
        return None
    axes = check_mesh_axes(mesh)
    if computation_shape is not None:
        raise ValueError(
            "submit: got both mesh and computation_shape; pass one: mesh for a global-view "
            "job (one jax.jit step over the slice), computation_shape for a per-replica "
            "job with logical devices.")
    if batch_sharding is not None:
        import jax
        from jax.sharding import PartitionSpec

        leaves = jax.tree.leaves(batch_sharding, is_leaf=lambda x: isinstance(x, PartitionSpec))
        if not leaves or not all(isinstance(x, PartitionSpec) for x in leaves):
            raise TypeError(
                "submit: batch_sharding must be a PartitionSpec (jax.sharding; every batch "
                "leaf), or a pytree of them shaped like the batch, e.g. "
                f"PartitionSpec('data'). Got {_show(batch_sharding)}.")
    return axes


#: Priorities travel as int32.
PRIORITY_LIMIT = 2**31 - 1


def _check_int(name: str, value: Any, minimum: int, meaning: str,
               maximum: int | None = None) -> int:
    """``value`` as an int in [``minimum``, ``maximum``]; numpy integers count, bools and
    floats don't."""
    wanted = (f"an int >= {minimum}" if maximum is None
              else f"an int from {minimum} to {maximum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"submit: {name} must be {wanted} ({meaning}). Got {_show(value)}.")
    number = int(value)
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"submit: {name} must be {wanted} ({meaning}). Got {value!r}.")
    return number


def _check_seconds(name: str, value: Any, minimum: float, meaning: str) -> float | None:
    """``value`` as finite seconds >= ``minimum``, or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"submit: {name} must be a number of seconds ({meaning}), or None. "
                        f"Got {_show(value)}.")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < minimum:
        raise ValueError(f"submit: {name} must be finite seconds >= {minimum:g} "
                         f"({meaning}), or None. Got {value!r}.")
    return seconds


def _check_dataset(dataset: Any) -> None:
    try:
        iter(dataset)
    except TypeError:
        raise TypeError(f"submit: dataset must be an iterable of global batches (e.g. a list "
                        f"of numpy arrays or of dicts of them). Got {_show(dataset)}.") from None
    if not is_reiterable(dataset):
        raise TypeError(
            f"submit: dataset must be re-iterable, but got {_show(dataset)}, which can be "
            "read only once (an iterator or a generator): a job reads its input again for "
            "every epoch and every retried attempt. Pass a list of batches (e.g. "
            "dataset=list(batches)), an object whose __iter__ starts over, or a dataset_fn "
            "that builds the generator on each host.")


def _check_spec_size(spec: JobSpec) -> None:
    limit = tensors.MAX_MESSAGE_BYTES - _SPEC_SLACK_BYTES
    size = to_message(spec).ByteSize()
    if size <= limit:
        return
    parts = {f: len(getattr(spec, f)) for f in ("step_fn", "init_fn", "dataset", "dataset_fn")}
    biggest = max(parts, key=lambda f: parts[f])
    raise errors.MessageTooLargeError(
        f"submit: the job pickles to {size} bytes, over the {limit}-byte limit; most of it "
        f"is {biggest} ({parts[biggest]} bytes). Objects travel inside the job's spec: "
        + ("pass a dataset_fn that reads the data on each host (from files or a bucket) "
           "instead of the arrays themselves." if biggest == "dataset" else
           "do not capture large arrays in functions; build or load them on the hosts "
           "(in init_fn or dataset_fn)."))


def fork_request(job_id: str, step: int, steps: int | None,
                 overrides: Mapping[str, Any]) -> pb.ForkJobRequest:
    """Checks ``client.fork``'s arguments; the request it sends."""
    from jaxpod.shipping import ship_object

    if not isinstance(job_id, str) or not job_id:
        raise TypeError(f"fork: job_id must be the source job's id (job.id, or as `jaxpod "
                        f"jobs` shows it). Got {_show(job_id)}.")
    step = _check_int("step", step, 0, "the step of the source's checkpoint to start "
                      "from, as job.checkpoints() lists them")
    if steps is not None:
        steps = _check_int("steps", steps, step + 1, "the fork's last step, past step")
    unknown = sorted(set(overrides) - set(FORKABLE))
    if unknown:
        raise TypeError(f"fork: {unknown} cannot change in a fork; it may change "
                        f"{', '.join(FORKABLE)} (the input, the state's structure and the "
                        "outputs stay the source's: the fork resumes them).")
    fields: dict[str, Any] = {}
    for name, value in overrides.items():
        if name == "step_fn":
            if not callable(value):
                raise TypeError(f"fork: step_fn must be a function step_fn(state, batch) -> "
                                f"(state, outputs). Got {_show(value)}.")
            value = ship_object(value, f"step_fn {_qualname(value)}", _CAPTURE_FIX).payload
        elif name in ("min_runtime_s", "max_runtime_s"):
            value = _check_seconds(name, value, 0.0 if name == "min_runtime_s" else 1e-3,
                                   "seconds")
        elif name == "grow_back":
            if not isinstance(value, bool):
                raise TypeError(f"fork: grow_back must be True or False. Got {_show(value)}.")
        elif name == "name":
            if value is not None and not isinstance(value, str):
                raise TypeError(f"fork: name must be a string. Got {_show(value)}.")
        elif name == "priority":
            value = _check_int(name, value, -PRIORITY_LIMIT, "higher runs first",
                               PRIORITY_LIMIT)
        elif value is not None:
            value = _check_int(name, value, 0, "a count")
        fields[name] = value
    spec = JobSpec(steps=steps or 1, **fields)
    return pb.ForkJobRequest(job_id=job_id, step=step, steps=steps or 0,
                             overrides=to_message(spec), override=sorted(fields))


def submit_spec(client: Client, spec: JobSpec) -> Job:
    """Sends a built spec (:func:`build_spec`); returns the submitted job."""
    client.check_open("submit")
    # Not retried: a submission that reached the service would run twice.
    reply = client.call(client.stub.SubmitJob, to_message(spec), what="submit",
                        timeout=rpc.CONTROL_TIMEOUT)
    return Job(client, reply.id, reply.name or reply.id)


def status_from(message: pb.JobStatus) -> JobStatus:
    """The :class:`jaxpod.JobStatus` a ``JobStatus`` message stands for."""
    return from_message(JobStatus, message)


# ------------------------------------------------------------------------- the job
class Job:
    """A submitted job. It runs on the service whether or not this object (or its
    client) still exists; ``client.job(id)`` makes another from any process.

    Args:
      client: the client to ask the service through.
      job_id: the job's id.
      name: its name.
    """

    def __init__(self, client: Client, job_id: str, name: str) -> None:
        self._client = client
        self.id = job_id
        self.name = name

    def _call(self, method: str, request: Any, what: str, idempotent: bool = True) -> Any:
        self._client.check_open(what)
        return self._client.call(getattr(self._client.stub, method), request,
                                 what=f"{what} of job {self.id}", idempotent=idempotent,
                                 timeout=rpc.CONTROL_TIMEOUT)

    def status(self) -> JobStatus:
        """The job as the service last recorded it."""
        return status_from(self._call("GetJob", pb.JobRequest(job_id=self.id),
                                      "status()").status)

    def history(self) -> list[Transition]:
        """Every state change of the job with its time and reason, oldest first."""
        return list(self.details("history()").history)

    def attempts(self) -> list[Attempt]:
        """Every attempt at running the job: start, end, cause and the step reached."""
        return list(self.details("attempts()").attempts)

    def hosts(self) -> list[HostInput]:
        """Each host's input feed in the running attempt, as the service last read it
        (every ``JAXPOD_JOB_HOST_POLL_S``): the seconds its steps waited for input and the
        chunks it has ready. Empty when no attempt runs. A host whose wait grows while
        the others' stay near 0 is the one whose input holds the slice back."""
        return list(self.details("hosts()").hosts)

    def details(self, what: str = "details()") -> JobDetails:
        """The status, history, attempts, host input figures and checkpoints, read at
        once."""
        reply = self._call("GetJob", pb.JobRequest(job_id=self.id, detail=True), what)
        return from_message(JobDetails, reply)

    def watch(self) -> Iterator[JobStatus]:
        """Yields the job's status once per change, starting with the current one; ends
        after the first terminal state (``SUCCEEDED``, ``FAILED``, ``CANCELLED``)."""
        return self._follow(None, None)

    def wait(self, timeout: float | None = None, progress: bool | None = None) -> JobStatus:
        """Waits until the job is over and returns its final status.

        Args:
          timeout: seconds to wait at most (``None``: as long as it takes).
          progress: show a progress bar (step, steps/s and the latest metrics) on
            stderr; ``None``: only when stderr is a terminal.

        Raises:
          jaxpod.DeadlineExceededError: ``timeout`` passed first (the job goes on).
        """
        if timeout is not None and not timeout > 0:
            raise ValueError(f"wait: timeout must be a positive number of seconds or None. "
                             f"Got {timeout!r}.")
        if progress is None:
            progress = sys.stderr.isatty()
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = _ProgressBar(self) if progress else None
        last: JobStatus | None = None
        try:
            for status in self._follow(deadline, timeout):
                last = status
                if bar is not None:
                    bar.show(status)
        finally:
            if bar is not None:
                bar.close()
        if last is None:  # the watch ended without a status: ask once
            last = self.status()
        return last

    def result(self, timeout: float | None = None, *, state: bool = True) -> JobResult:
        """Waits for the job (no progress bar) and returns its result.

        Args:
          timeout: seconds to wait at most for the job to finish (``None``: no limit).
          state: fetch the final state (read from the job's last checkpoint and
            streamed through the service in blocks). ``False`` leaves
            ``JobResult.state`` ``None``: for a state too big for this process, open
            the checkpoint with orbax instead (``job.checkpoints()[-1].path``).

        Raises:
          jaxpod.JobFailedError: the job ended ``FAILED`` (``error`` says why).
          jaxpod.JobCancelledError: the job ended ``CANCELLED``.
          jaxpod.DeadlineExceededError: ``timeout`` passed first.
        """
        status = self.wait(timeout, progress=False)
        if status.state == "FAILED":
            raise errors.JobFailedError(self.id, status.error or "no reason recorded")
        if status.state == "CANCELLED":
            saved = self.checkpoints()
            raise errors.JobCancelledError(self.id, status.error or "cancelled",
                                           saved[-1] if saved else None)
        self._client.check_open("result()")
        request = pb.JobRequest(job_id=self.id, without_state=not state)
        tree = self._client.stream(self._client.stub.GetJobResult, request, tensors.read_result,
                                   what=f"result() of job {self.id}")
        notes: list[str] = []
        tree = trees.thaw(tree, unknown_as_dicts=True, notes=notes)
        reply = self._call("GetJobMetrics", pb.JobRequest(job_id=self.id), "result()")
        metrics = {s.name: [(int(k), float(v)) for k, v in zip(s.steps, s.values, strict=True)]
                   for s in reply.series}
        return JobResult(state=tree.get("state"), outputs=tree.get("outputs") or {},
                         metrics=metrics, steps=status.step, note=" ".join(notes) or None)

    def checkpoints(self) -> list[JobCheckpoint]:
        """The job's committed checkpoints, oldest first: the step each holds the state
        of, where the service's hosts wrote it and when. A finished job keeps its last
        ones (a cancelled job's state is there)."""
        return list(self.details("checkpoints()").checkpoints)

    def profile(self, seconds: float = 5.0) -> JobProfile:
        """Traces every host of the running job with ``jax.profiler`` for ``seconds``,
        from its next loop boundary, and returns where the trace is once written: a
        folder under the job's checkpoint folder with one ``host-<i>/`` per host, in
        TensorBoard's layout (``tensorboard --logdir PATH``, xprof, or
        ``jax.profiler.ProfileData.from_file`` on a ``files`` entry read it). The job
        runs on meanwhile.

        Raises:
          ValueError: ``seconds`` is not in (0, 300], or the job is not running.
          jaxpod.PermissionDeniedError: the job is another token's (and this one is
            not an admin).
        """
        request = pb.ProfileJobRequest(job_id=self.id, seconds=check_profile_seconds(seconds))
        self._client.check_open("profile()")
        reply = self._client.call(self._client.stub.ProfileJob, request,
                                  what=f"profile() of job {self.id}", timeout=rpc.CALL_TIMEOUT)
        return from_message(JobProfile, reply)

    def profiles(self) -> list[JobProfile]:
        """The profiles taken of the job, oldest first."""
        return list(self.details("profiles()").profiles)

    def cancel(self) -> JobStatus:
        """Cancels the job: a queued one leaves the queue; a running one stops at its
        next loop boundary and frees its slice. Returns its status once it stopped
        (``CANCELLED``), or, if its current loop takes longer than the service waits
        (``JAXPOD_JOB_CANCEL_WAIT_S``, 10 s), as it is then: ``wait()`` follows it to
        ``CANCELLED``. Cancelling a finished job changes nothing."""
        return status_from(self._call("CancelJob", pb.JobRequest(job_id=self.id),
                                      "cancel()"))

    def suspend(self) -> JobStatus:
        """Suspends the job: a running one checkpoints at its next loop boundary and
        frees its slice; a queued one leaves the queue. It waits, ``SUSPENDED``, until
        :meth:`resume`, and then goes on from that checkpoint, losing no step. Returns
        its status once suspended (or, if its current loop takes longer than the service
        waits, as it is then). Suspending a suspended job changes nothing.

        Raises:
          jaxpod.JobNotRunningError: the job is over.
        """
        return status_from(self._call("SuspendJob", pb.JobRequest(job_id=self.id),
                                      "suspend()"))

    def resume(self) -> JobStatus:
        """Queues a suspended job again: it resumes from the checkpoint it took when
        suspended.

        Raises:
          jaxpod.JobNotRunningError: the job is not ``SUSPENDED``.
        """
        return status_from(self._call("ResumeJob", pb.JobRequest(job_id=self.id),
                                      "resume()"))

    def pin(self, pinned: bool = True) -> JobStatus:
        """Keeps the job whole for ever: the service's retention (``jaxpod serve
        --retain-days/--retain-jobs``) never prunes its logs, metrics, result and
        checkpoints. ``pin(False)`` (or :meth:`unpin`) lets it prune the job once it is
        finished and past the limits. A job already pruned cannot be pinned
        (``ValueError``): what it lost is gone."""
        return status_from(self._call("PinJob", pb.PinJobRequest(job_id=self.id,
                                                                  pinned=pinned),
                                      "pin()" if pinned else "unpin()"))

    def unpin(self) -> JobStatus:
        """``pin(False)``."""
        return self.pin(False)

    def stacks(self) -> list[HostStacks]:
        """Every thread's Python stack on each host of the job's running attempt, read
        now (what ``jaxpod job stacks ID`` prints): where a straggling or stuck host
        is. A job not running on a slice raises ``ValueError``; a hung loop's stacks
        are in its logs."""
        reply = self._call("GetJobStacks", pb.JobRequest(job_id=self.id), "stacks()")
        return [from_message(HostStacks, h) for h in reply.hosts]

    def logs(self) -> str:
        """Every line the job's code printed on its hosts so far, each prefixed with
        ``[host N] ``."""
        return "\n".join(self.log_lines())

    def log_lines(self, host: int | None = None, follow: bool = False) -> Iterator[str]:
        """The lines the job's code printed on its hosts, in order, each prefixed with
        ``[host N] ``; with ``host``, only that host's, unprefixed. With ``follow``, new
        lines as the service reads them from the hosts, until the job is over (what
        ``jaxpod logs --follow`` prints; stop early by leaving the loop)."""
        if host is not None and (not isinstance(host, int) or isinstance(host, bool)
                                 or host < 0):
            raise ValueError(f"log_lines: host must be a host index (an int >= 0). Got "
                             f"{host!r}.")
        after, over = 0, False
        more = False  # the last page said more lines follow
        while True:
            if not more:
                # Asked before the read: every line printed before the end is read after.
                over = follow and self.status().done
            reply = self._call("GetJobLogs", pb.JobLogsRequest(job_id=self.id, after=after),
                               "log_lines()")
            for line in reply.lines:
                after = line.seq
                text = line.line.rstrip("\n")
                if host is None:
                    yield f"[host {line.host}] {text}"
                elif line.host == host:
                    yield text
            more = reply.more
            if more:
                continue
            if not follow or over:
                return
            if not reply.lines:
                time.sleep(LOG_FOLLOW_POLL_S)

    def _follow(self, deadline: float | None, timeout: float | None) -> Iterator[JobStatus]:
        """The WatchJob stream, re-opened while the service is briefly unreachable.

        Watching may last longer than any fixed RPC time-out, so the stream has a
        deadline only when the caller gave one (``deadline``, monotonic time)."""
        what = f"watching job {self.id}"
        last: JobStatus | None = None
        failures = 0
        reconnect_until = 0.0
        while True:
            self._client.check_open("watch()")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._timed_out(timeout, last)
            call = self._client.stub.WatchJob(pb.JobRequest(job_id=self.id), timeout=remaining,
                                              metadata=self._client.metadata)
            try:
                for message in call:
                    status = status_from(message)
                    failures = 0
                    if status != last:  # a re-opened stream starts with the current status
                        last = status
                        yield status
                    if status.done:
                        return
                error: grpc.RpcError | None = None
            except grpc.RpcError as e:
                error = e
            finally:
                call.cancel()  # a no-op when the stream ended; else frees it
            failed: Any = error  # a grpc.Call too
            code = None if failed is None else failed.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
                raise self._timed_out(timeout, last) from None
            if error is not None and code not in (grpc.StatusCode.UNAVAILABLE,
                                                  grpc.StatusCode.CANCELLED):
                raise rpc.error_from(error, what, WATCH_RECONNECT_TIMEOUT) from None
            # The stream broke (or ended early) while the job is not over: the service
            # is restarting or moving; open it again for a while.
            now = time.monotonic()
            if failures == 0:
                reconnect_until = now + WATCH_RECONNECT_TIMEOUT.seconds()
            elif now >= reconnect_until:
                if error is not None:
                    raise rpc.error_from(error, what, WATCH_RECONNECT_TIMEOUT) from None
                raise errors.ServiceUnavailableError(
                    f"{what}: the service kept ending the watch before the job was over "
                    f"(last state {last.state if last else 'unknown'}). Check the service; "
                    f"raise {WATCH_RECONNECT_TIMEOUT.env_var} to keep trying longer.")
            pause = _RECONNECT_DELAYS_S[min(failures, len(_RECONNECT_DELAYS_S) - 1)]
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - now))
            failures += 1
            time.sleep(pause)

    def _timed_out(self, timeout: float | None, last: JobStatus | None
                   ) -> errors.DeadlineExceededError:
        seen = (f"its last state was {last.state} at step {last.step}/{last.steps}"
                if last is not None else "no status arrived")
        named = f" ({self.name})" if self.name and self.name != self.id else ""
        return errors.DeadlineExceededError(
            f"Job {self.id}{named} did not finish within {timeout or 0:g}s; {seen}. It "
            "goes on running on the service: wait again (job.wait() / job.result()), or "
            "stop it with job.cancel().")

    def __repr__(self) -> str:
        name = f", name={self.name!r}" if self.name and self.name != self.id else ""
        return f"Job({self.id!r}{name}, service={self._client.address!r})"


class _ProgressBar:
    """A tqdm bar over a job's steps: rate, state and the latest metrics."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._bar: Any = None

    def show(self, status: JobStatus) -> None:
        queued = f" #{status.queue_position}" if status.queue_position is not None else ""
        description = f"{self._job.name} {status.state}{queued}"
        metrics = {k: f"{v:.4g}" for k, v in sorted(status.metrics.items())}
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=status.steps, initial=status.step, unit="step",
                             desc=description, postfix=metrics or None, file=sys.stderr,
                             dynamic_ncols=True, leave=True)
            return
        bar = self._bar
        if status.steps and bar.total != status.steps:
            bar.total = status.steps
        if status.step >= bar.n:
            bar.update(status.step - bar.n)  # through update(), so tqdm measures steps/s
        else:  # a retried attempt resumed from an earlier checkpoint
            bar.n = status.step
        bar.set_description(description, refresh=False)
        bar.set_postfix(metrics, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
