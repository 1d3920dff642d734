"""What a job is: every job concept, named once.

The job's types are defined here and nowhere else: :class:`JobSpec` (what was submitted),
:class:`JobState` (the state machine's names), :class:`JobStatus`, :class:`Transition`,
:class:`Attempt`, :class:`HostInput`, :class:`HostStacks`, :class:`JobCheckpoint`,
:class:`JobProfile`, :class:`JobDetails` and :class:`JobResult`, with the checks of what
a job is given. The job store, the job manager, the SDK and the HTTP API all use them;
protobuf messages exist only at the gRPC edge (:mod:`jaxpod.proto.job_messages`
converts, field by field, by name) and the HTTP API's models are derived from them.

What its parts are made of, the wrappers the client ships the user's objects in and the
workers run (:class:`JobStep`, :class:`Epochs`, :class:`EpochsFn`,
:class:`InitialState`), live in :mod:`jaxpod.job_wrappers`; they are importable from
here too.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxpod.job_wrappers import Epochs as Epochs
from jaxpod.job_wrappers import EpochsFn as EpochsFn
from jaxpod.job_wrappers import InitialState as InitialState
from jaxpod.job_wrappers import JobStep as JobStep
from jaxpod.types import ReduceOp


class JobState(enum.StrEnum):
    """A job's state (DESIGN §3); the last three are final. A ``str``: it equals and
    prints as its name."""

    PENDING = "PENDING"
    ALLOCATING = "ALLOCATING"
    RUNNING = "RUNNING"
    RETRYING = "RETRYING"
    #: Checkpointed and off its slice until ``job.resume()`` (``job.suspend()``).
    SUSPENDED = "SUSPENDED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES

    @classmethod
    def parse(cls, name: str | JobState) -> JobState:
        """``name`` as a state, in any case; a clear error (listing the states) for
        anything else."""
        try:
            return cls(str(name).upper())
        except ValueError:
            known = ", ".join(s.value for s in cls)
            raise ValueError(f"Unknown job state {name!r}; expected one of {known} (any "
                             "case).") from None


#: States a job never leaves.
TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
#: Every state's name, in the order a job meets them.
JOB_STATES: tuple[str, ...] = tuple(s.value for s in JobState)


def check_state(state: str | None) -> str:
    """A job state named in any case, as the service spells it ("" for ``None``: all)."""
    if state is None:
        return ""
    wanted = state.upper() if isinstance(state, str) else ""
    if wanted not in JOB_STATES:
        raise ValueError(f"Unknown job state {state!r}; expected one of "
                         f"{', '.join(JOB_STATES)} (any case), or none for every job.")
    return wanted


@dataclass(frozen=True)
class JobStatus:
    """A job as the service last recorded it.

    Attributes:
      id: the job's id (what ``client.job(id)`` and ``jaxpod job ID`` take).
      name: its name (its id unless given at submit).
      state: a :class:`JobState` (a ``str``: ``status.state == "RUNNING"``).
      step: steps done; steps: steps asked for.
      attempts: attempts started so far (a retried job has more than one).
      queue_position: 0 is next for a free slice; ``None`` when not queued.
      error: for a ``FAILED`` job, the reason (the user's exception type, message and
        remote traceback, or what the service saw); for a ``CANCELLED`` one, who or
        what cancelled it.
      metrics: each declared output's latest reduced value.
      goodput: seconds by category, ``wall_s`` and ``productive_share`` (``None``
        until recorded).
      created_at, started_at, finished_at: seconds since the epoch (``None``: not yet).
      accelerator_type: the slice type it runs on.
      steps_per_s: steps per wall-clock second: the running attempt's over its recent
        loops (what a progress bar shows), else the last attempt's over its running
        time (``None``: no steps ran yet).
      owner: the name of the token that submitted it (``"local"`` on a service without
        tokens; ``""`` for jobs recorded before owners were).
      wait_reason: why a queued job waits: its owner's slice quota, the jobs ahead of
        it, a lower-priority job giving its slice up, or no free slice (``None``: not
        queued).
      priority: its priority (higher runs first, preempting lower ones).
      stragglers: the hosts of its running attempt flagged as stragglers now
        (:class:`HostInput` ``straggler`` says why; ``jaxpod job stacks ID`` shows what
        they are doing).
      pinned: kept whole for ever: retention never prunes it (``job.pin()``).
      pruned_at: when retention pruned the finished job (seconds since the epoch;
        ``None``: kept whole): its row, the first and last of its history, its
        attempts, goodput and a few points of each metric stay; its logs, spec, result
        and checkpoints are gone.
      team: the team of the token that submitted it: its slices count against that
        team's share (``"default"`` where no teams are declared).
    """

    id: str
    name: str
    state: JobState
    step: int
    steps: int
    attempts: int
    queue_position: int | None
    error: str | None
    metrics: Mapping[str, float]
    goodput: Mapping[str, float] | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    accelerator_type: str = ""
    steps_per_s: float | None = None
    owner: str = ""
    wait_reason: str | None = None
    priority: int = 0
    stragglers: tuple[int, ...] = ()
    pinned: bool = False
    pruned_at: float | None = None
    team: str = "default"

    @property
    def done(self) -> bool:
        """Whether the job is over (``SUCCEEDED``, ``FAILED`` or ``CANCELLED``)."""
        return self.state in TERMINAL_STATES


@dataclass(frozen=True)
class Transition:
    """One state change of a job; ``from_state`` is ``None`` for its submission."""

    from_state: JobState | None
    to_state: JobState
    at: float
    reason: str


@dataclass(frozen=True)
class Attempt:
    """One attempt at running a job (1 is the first). ``ended_at`` and ``step_reached``
    are ``None`` while it runs; ``running_at`` and ``start_step`` say when it began
    running steps and from which, ``first_step_at`` when its first loop of steps was
    done (``None``: it never got that far). By then each of its hosts had loaded at
    least ``programs_loaded`` programs from the compilation cache and compiled at most
    ``programs_compiled`` (``None`` until then, or with the hosts' cache off; both 0:
    a warm slice that had them compiled already). ``accelerator_type`` is the slice
    type it ran on (an elastic job's attempts may differ)."""

    number: int
    started_at: float
    ended_at: float | None
    cause: str | None
    step_reached: int | None
    running_at: float | None = None
    start_step: int | None = None
    first_step_at: float | None = None
    programs_loaded: int | None = None
    programs_compiled: int | None = None
    #: The slice type it ran on (``None``: recorded before attempts said so).
    accelerator_type: str | None = None


@dataclass(frozen=True)
class HostInput:
    """One host of a job's running attempt, as the service last read it: where its
    worker runs, and its input feed.

    Attributes:
      host: the host's index in the job's slices (its JAX process index).
      input_wait_s: seconds the host's steps waited for input that was not ready yet.
      input_queue_depth: chunks of ``steps_per_run`` steps its infeed has ready.
      node: the machine its worker runs on (its host name).
      address: the address other hosts reach it at.
      pid: its worker's process id on that machine.
      step_s: seconds per step of its recent loops (0: none measured yet).
      straggler: why the host is flagged as a straggler, empty when it is not: for
        several reports its loops, or its input waits, took over 3x the other
        hosts' median (``jaxpod job stacks ID`` shows what it is doing).
    """

    host: int
    input_wait_s: float
    input_queue_depth: int
    node: str = ""
    address: str = ""
    pid: int = 0
    step_s: float = 0.0
    straggler: str = ""


@dataclass(frozen=True)
class JobCheckpoint:
    """A committed checkpoint of a job: ``step`` steps were done; ``path`` is where the
    service's hosts wrote it; ``saved_at`` when (seconds since the epoch); ``stall_s``
    the seconds the job's steps waited for it: a periodic one, while the hosts set the
    state apart (the write goes on behind the next steps); the final one, or one before
    giving the slice up, until it was committed (``None``: not known, as for one found
    on storage after the coordinator restarted)."""

    step: int
    path: str
    saved_at: float
    stall_s: float | None = None


@dataclass(frozen=True)
class JobProfile:
    """A ``jax.profiler`` trace of a running job, one per host.

    Attributes:
      path: its folder, with one ``host-<i>/`` folder per host in TensorBoard's layout
        (``tensorboard --logdir PATH`` or xprof opens it).
      started_at: when the hosts started tracing (seconds since the epoch).
      seconds: how long each host traced.
      files: the trace files the hosts wrote (``*.xplane.pb``), in host order.
    """

    path: str
    started_at: float
    seconds: float
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostStacks:
    """Every thread's Python stack on one host of a job's running attempt, read at once
    (``jaxpod job stacks ID``).

    Attributes:
      host: the host's index.
      node: the machine its worker runs on.
      pid: its worker's process id there.
      stacks: each thread's stack, innermost call last, or why it could not be read.
    """

    host: int
    node: str
    pid: int
    stacks: str


@dataclass(frozen=True)
class JobDetails:
    """A job read in full: its status, every state change, every attempt, each host's
    input feed in the running attempt, its committed checkpoints and its profiles
    (oldest first)."""

    status: JobStatus
    history: tuple[Transition, ...] = ()
    attempts: tuple[Attempt, ...] = ()
    hosts: tuple[HostInput, ...] = ()
    checkpoints: tuple[JobCheckpoint, ...] = ()
    profiles: tuple[JobProfile, ...] = ()


@dataclass(frozen=True)
class AuditRecord:
    """One entry of the service's audit log (``jaxpod audit``).

    Attributes:
      seq: its place in the log (increasing).
      at: when, in seconds since the epoch.
      who: the name of the token that acted.
      action: ``submit``, ``cancel`` or ``refused``.
      target: the job's id, or for a refusal the method or route refused.
      detail: more about it (a refusal's reason).
    """

    seq: int
    at: float
    who: str
    action: str
    target: str
    detail: str = ""


#: The names these types had in the SDK before they were the service's too.
JobTransition = Transition
JobAttempt = Attempt


def _shipped(*keywords: str) -> Any:
    """A :class:`JobSpec` field holding the user's object of ``keywords`` (what
    ``client.submit`` takes for it), pickled by value; empty: not given."""
    return field(default=b"", metadata={"submit": keywords})


#: What a fork (``client.fork``) may change of its source's spec. The input, the
#: state's structure and the declared outputs stay the source's: the fork resumes the
#: source's input position and state from its checkpoint.
FORKABLE = ("step_fn", "name", "priority", "checkpoint_every", "memory_checkpoint_every",
            "max_retries_preemption", "max_retries_failure", "min_runtime_s",
            "max_runtime_s", "grow_back")


@dataclass(frozen=True)
class JobSpec:
    """A job as submitted: ``client.submit``'s keyword arguments, in its order, with the
    user's objects shipped (cloudpickle; only the workers load them). The submit
    keywords, their order and defaults are derived from these fields
    (:data:`SUBMIT_KEYWORDS`); ``init_fn`` also carries an ``initial_state``."""

    steps: int
    accelerator_type: str | None = None
    init_fn: bytes = _shipped("init_fn", "initial_state")
    dataset: bytes = _shipped("dataset")
    dataset_fn: bytes = _shipped("dataset_fn")
    steps_per_run: int = 1
    outputs: Mapping[str, str] | None = None
    checkpoint_every: int | None = None
    name: str | None = None
    num_slices: int = 1
    max_retries_preemption: int = 10
    max_retries_failure: int = 0
    #: Higher runs first; a job preempts running jobs of strictly lower priority.
    priority: int = 0
    #: Logical devices per replica, as ``DeviceAssignment.build`` takes it (``None``: one).
    computation_shape: tuple[int, ...] | None = None
    #: A global-view job's mesh axis names (submit's ``mesh``; ``None``: per-replica).
    mesh_axes: tuple[str, ...] | None = field(default=None, metadata={"submit": ("mesh",)})
    #: Its axis sizes, in the same order (one may be -1).
    mesh_shape: tuple[int, ...] | None = field(default=None, metadata={"submit": ()})
    batch_sharding: bytes = _shipped("batch_sharding")
    step_fn: bytes = _shipped()  # submit's positional argument
    runtime_versions: Mapping[str, str] | None = field(default=None,
                                                        metadata={"submit": ()})
    #: An elastic job's slice types in order of preference, ``accelerator_type`` first
    #: (submit's ``accelerator_type`` as a sequence; ``None``: that type only).
    accelerator_types: tuple[str, ...] | None = field(default=None, metadata={"submit": ()})
    #: An elastic job moves up to a more preferred type once one is free.
    grow_back: bool = True
    #: Steps between in-memory checkpoints, each host's shards kept on its node and its
    #: peer's (``None``: the service chooses from their measured cost when
    #: ``checkpoint_every`` is set; 0: none).
    memory_checkpoint_every: int | None = None
    #: Seconds a started attempt runs before it may be preempted, unless nothing else
    #: can free the slice (``None``: the service's JAXPOD_JOB_MIN_RUNTIME_S).
    min_runtime_s: float | None = None
    #: Seconds the job may run in all; then it ends with a final checkpoint
    #: (``None``: no limit).
    max_runtime_s: float | None = None

    def preferences(self) -> tuple[str, ...]:
        """The slice types the job accepts, the most preferred first (one: not elastic;
        ``("",)``: the cluster's first type)."""
        return self.accelerator_types or (self.accelerator_type or "",)

    @property
    def elastic(self) -> bool:
        """It accepts more than one slice type."""
        return len(self.preferences()) > 1

    def declared_outputs(self) -> Mapping[str, str]:
        """Each declared output's reduce op (empty: none)."""
        return self.outputs or {}

    @property
    def mesh(self) -> tuple[tuple[str, int], ...] | None:
        """A global-view job's mesh as (axis name, size) pairs (``None``: per-replica)."""
        if not self.mesh_axes:
            return None
        return tuple(zip(self.mesh_axes, self.mesh_shape or (), strict=True))

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)


def _submit_keywords() -> dict[str, Any]:
    keywords: dict[str, Any] = {}
    for f in dataclasses.fields(JobSpec):
        names = f.metadata.get("submit", (f.name,))
        for name in names:
            shipped = "submit" in f.metadata
            keywords[name] = None if shipped or f.default is dataclasses.MISSING else f.default
    return keywords


#: ``client.submit``'s keyword arguments after ``step_fn``, in order, with their
#: defaults (``steps`` has none: ``None`` here); ``jaxpod submit FILE.py`` reads them.
SUBMIT_DEFAULTS: dict[str, Any] = {k: v for k, v in _submit_keywords().items()
                                   if k != "steps"}
SUBMIT_KEYWORDS: tuple[str, ...] = tuple(_submit_keywords())


@dataclass(frozen=True)
class JobResult:
    """A finished job's result.

    Attributes:
      state: the final state (replica 0's copy: jobs train mirrored state), as the
        pytree types ``init_fn`` made it, with numpy leaves (typed PRNG keys as keys).
      outputs: the last reduced outputs (name -> numpy).
      metrics: every recorded value: name -> ``[(step, value), ...]``.
      steps: steps run.
      note: why ``state`` is not what ``init_fn`` made (``None`` when it is): a
        pytree type this process cannot import comes as nested dicts.
    """

    state: Any
    outputs: Mapping[str, Any]
    metrics: Mapping[str, list[tuple[int, float]]] = field(default_factory=dict)
    steps: int = 0
    note: str | None = None


#: The longest profile one request may ask for (a trace grows with its length).
MAX_PROFILE_SECONDS = 300.0


def check_profile_seconds(seconds: Any) -> float:
    """``seconds`` as a float if a profile may last that long; a ``ValueError`` saying
    why not."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or \
            not 0 < float(seconds) <= MAX_PROFILE_SECONDS:
        raise ValueError(f"A profile lasts more than 0 and at most {MAX_PROFILE_SECONDS:g} "
                         f"seconds; got seconds={seconds!r}. Pass e.g. seconds=5.")
    return float(seconds)


def check_outputs(outputs: Any) -> dict[str, str]:
    """``outputs`` as ``{name: reduce op name}``; a clear error for anything else."""
    if outputs is None:
        return {}
    if not isinstance(outputs, Mapping):
        raise TypeError(f"outputs must be a dict of output name -> reduce op (e.g. "
                        f"{{'loss': 'MEAN'}}). Got {type(outputs).__name__}.")
    checked = {}
    for name, op in outputs.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"outputs: names must be non-empty strings. Got {name!r}.")
        try:
            checked[name] = ReduceOp.from_value(op).value
        except ValueError:
            known = ", ".join(o.value for o in ReduceOp)
            raise ValueError(f"outputs[{name!r}]: unknown reduce op {op!r}; expected one of "
                             f"{known} (or jaxpod.ReduceOp.*).") from None
    return checked


def check_mesh_axes(axes: Any) -> dict[str, int]:
    """A global-view job's ``mesh`` (axis names to sizes, in order; one may be ``-1``)
    as a dict; a clear error for anything else. The slice's device count is checked
    where it is known (the hosts)."""
    example = 'e.g. mesh={"data": -1, "model": 2}'
    if not isinstance(axes, Mapping) or not axes:
        raise TypeError(f"mesh must be a dict of axis names to sizes ({example}). "
                        f"Got {axes!r}.")
    sizes: dict[str, int] = {}
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"mesh: axis names must be identifiers ({example}). Got "
                            f"{name!r}.")
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or not (
                int(size) == -1 or int(size) >= 1):
            raise ValueError(f"mesh: axis {name!r} must have a positive size, or -1 for "
                             f"the devices the other axes leave. Got {size!r}.")
        sizes[name] = int(size)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1 (the rest of the devices). Got "
                         f"{free} in {axes!r}.")
    return sizes


def check_spmd(fn: Any, mesh: Any, batch_sharding: Any) -> tuple[dict[str, int], Any]:
    """``strategy.spmd``'s arguments checked: the mesh's axes (``None``:
    ``{"data": -1}``) and ``batch_sharding`` (``None`` or one ``PartitionSpec``)."""
    from jax.sharding import PartitionSpec

    if not callable(fn):
        raise TypeError(f"spmd: fn must be a function (the one jax.jit would take). "
                        f"Got {type(fn).__name__}.")
    if batch_sharding is not None and not isinstance(batch_sharding, PartitionSpec):
        raise TypeError(
            "spmd: batch_sharding must be one jax.sharding.PartitionSpec (how every host "
            "array argument is split, e.g. PartitionSpec('data')) or None (rows over the "
            f"mesh's first axis where they divide). Got {type(batch_sharding).__name__}.")
    return check_mesh_axes({"data": -1} if mesh is None else mesh), batch_sharding
