"""The protocol between the coordinator and its host workers, defined once.

Every host operation is a frozen dataclass here, naming its fields and, through
``Operation[R]``, its result type. The coordinator's replica-group handle sends
operation objects (``ReplicaGroup.call(op) -> list[R]``, one result per host); the
worker runs each by calling the :class:`Host` method of the same name
(``op.apply(host)``), so mypy checks that both ends agree and a reader can follow an
operation from the call to its handler. Adding an operation means one dataclass here
and one method on the worker's ``Host``.

The types both ends share live here too: values on the workers are named by
:class:`Handle`; what the coordinator dropped rides along as :class:`Dropped`; a new
value is described by :class:`HandleInfo`; an exception raised on a worker comes back
as :class:`RemoteError`; hosts other than the first answer a uniform operation with a
:class:`Digest` of their result.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from jaxpod.errors import JaxpodError

if TYPE_CHECKING:
    import numpy as np

    from jaxpod.shipping import ShippedFunction
    from jaxpod.types import ReduceOp

#: A pytree whose leaves are :class:`HandleInfo` (new values) or plain data.
ValueInfos = Any
#: A pytree whose leaves are :class:`Handle` (values on the workers) or plain data.
ValueArgs = Any


class OperationOrderError(JaxpodError):
    """A worker received an operation out of sequence (one was skipped or reordered)."""


class IdRangeError(JaxpodError):
    """An operation sent ahead of another made more objects than the ids it was given."""


class DivergedError(JaxpodError):
    """A host's result of a uniform operation differs from the first host's: the hosts
    are out of lockstep (a step function whose outputs depend on the host)."""


@dataclass(frozen=True)
class Handle:
    """A reference to a ``PerReplica`` value held by every worker of a group."""

    id: int


@dataclass(frozen=True)
class Dropped:
    """Objects the coordinator dropped since its previous operation: freed before the
    next one runs, in the same round trip (a free costs no call of its own)."""

    values: tuple[int, ...] = ()
    iterators: tuple[int, ...] = ()
    datasets: tuple[int, ...] = ()
    functions: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.values or self.iterators or self.datasets or self.functions)

    @property
    def ids(self) -> tuple[int, ...]:
        """The numeric ids (values, iterators, datasets): they come from one sequence."""
        return self.values + self.iterators + self.datasets


@dataclass(frozen=True)
class HandleInfo:
    """What the coordinator learns about a new value: enough to describe it."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    valid_rows: tuple[int, ...] | None
    #: A global array (global-view job, ``strategy.spmd``): ``shape`` is the whole
    #: array's, with no replica axis.
    global_view: bool = False


@dataclass(frozen=True)
class RemoteError:
    """An exception raised on a worker, kept with its traceback.

    The original exception object travels when it pickles (so user code's own exception
    types survive); ``traceback`` is the worker-side formatted traceback. ``pickled`` is
    the exception pickled here with ``cloudpickle`` (``None`` if it does not pickle):
    the coordinator forwards those bytes untouched, so a class the client shipped by
    value unpickles on the client as the client's own class (cloudpickle tracks
    classes across such round trips; Ray's serializer would mint a new class).
    """

    error: BaseException
    traceback: str
    pickled: bytes | None = None

    @classmethod
    def of(cls, error: BaseException, tb: str) -> RemoteError:
        import cloudpickle

        try:
            pickled = cloudpickle.dumps(error)
            cloudpickle.loads(pickled)  # e.g. an __init__ that pickle cannot call again
        except Exception as why:  # it could not travel at all: send its description
            error = RuntimeError(f"{type(error).__qualname__}: {error} (this exception "
                                 f"could not be pickled and unpickled: {why})")
            pickled = cloudpickle.dumps(error)
        return cls(error, tb, pickled)


@dataclass(frozen=True)
class Digested:
    """The first host's reply to a :attr:`~Operation.uniform` operation of a group of
    several hosts: its result and the result's digest (``None``: it has none, see
    ``jaxpod.worker.result_digest``), which the other hosts' :class:`Digest` replies
    must match."""

    result: Any
    digest: bytes | None


@dataclass(frozen=True)
class Digest:
    """Another host's reply to a :attr:`~Operation.uniform` operation: only its result's
    digest. The coordinator reads a few dozen bytes from each host instead of the
    result (a 1000-leaf state's infos are 38 KB; 10 MB per step from 256 hosts)."""

    digest: bytes


@dataclass(frozen=True)
class HostStats:
    """What one host holds, and the time it spent working: its operations (other than
    ``Stats``) and the computations they dispatched, measured inside the worker; and its
    input feed: the seconds its steps waited for input that was not ready
    (``input_wait_s``) and the chunks of steps its infeeds have placed on the devices
    now (``input_queue_depth``; not those read ahead into host memory only). Times count
    from the slice's current holder."""

    num_values: int
    device_bytes: int
    num_iterators: int
    busy_s: float
    operations: int
    input_wait_s: float
    input_queue_depth: int


@dataclass(frozen=True)
class HostNews:
    """What a job's runner learns from one host between loops, in one round trip: the
    lines its code printed since the last report, its input figures (as
    :class:`HostStats` has them), its preemption notice (``None``: none came) and the
    newest checkpoint step of the job that every host committed (``None``: none, or
    one is being written)."""

    lines: list[str]
    input_wait_s: float
    input_queue_depth: int
    notice: Notice | None
    checkpoint: int | None = None


@dataclass(frozen=True)
class HostReset:
    """What :class:`ResetHost` freed on one host, and what it kept for the next holder."""

    values: int
    datasets: int
    iterators: int
    functions_kept: int
    pid: int


@dataclass(frozen=True)
class Notice:
    """A host's notice of a coming preemption: when it came (wall-clock seconds, as
    ``time.time()``) and from where (``"SIGTERM"``, or another source's reason)."""

    at: float
    reason: str


# ---------------------------------------------------------------------- operations
R = TypeVar("R")


class Operation(abc.ABC, Generic[R]):
    """One step that every host of a slice takes, in the same order.

    It takes effect on every host or on none: where it fails on some hosts, what it
    :meth:`created` on the others, and what :meth:`spoils` names, are freed on all.
    """

    #: Whether running it counts as work in the host's busy time (reading the
    #: figures must not move them).
    counts_as_work: ClassVar[bool] = True
    #: Whether it dispatches compiled programs, which may hold collectives: where it
    #: failed on some hosts only, the others may wait in one for ever.
    dispatches: ClassVar[bool] = False
    #: Whether the coordinator may send the next operation before this one's replies:
    #: they are small, and it fails on every host or on none, or else dispatches (a
    #: failure on some hosts then restarts the slice, failing what was sent behind
    #: it). What follows an operation that fails everywhere finds its outputs missing
    #: on every host alike.
    followable: ClassVar[bool] = False
    #: Whether every host's result is the same value (the infos of the values it made,
    #: as hosts in lockstep make them): hosts other than the first answer with a
    #: :class:`Digest`, and one that differs fails as :class:`DivergedError`. Only
    #: operations that dispatch are uniform: a host that diverged restarts the slice.
    uniform: ClassVar[bool] = False

    @abc.abstractmethod
    def apply(self, host: Host) -> R:
        """Runs this operation on ``host``."""

    def created(self, result: R) -> Dropped:
        """What a host that ran it holds because of it (freed if another host failed)."""
        return Dropped()

    def spoils(self) -> Dropped:
        """What cannot be used any more once it failed on some hosts only (an iterator
        that some hosts advanced and others did not)."""
        return Dropped()


@dataclass(frozen=True)
class Configure(Operation[int]):
    """Sets the host's engine for this device assignment (as ``DeviceAssignment.build``
    takes it) and default steps per run; returns the replica count. An engine already
    built for the same assignment is kept, with its compiled programs."""

    steps_per_run: int
    computation_shape: tuple[int, ...] | None
    num_replicas: int | None

    def apply(self, host: Host) -> int:
        return host.configure(self)


@dataclass(frozen=True)
class SetGlobalView(Operation[None]):
    """Makes the host's next values global-view ones (DESIGN §8): ``run`` becomes the
    job's ``init_fn`` under ``jax.jit`` over a mesh of ``mesh`` (axis names and sizes, in
    order; one may be -1), ``run_steps`` a loop of global steps fed by batches split by
    ``batch_sharding`` (pickled by the client: a ``PartitionSpec`` or a pytree of them;
    ``None``: rows over the first axis)."""

    mesh: tuple[tuple[str, int], ...]
    batch_sharding: ShippedFunction | None

    def apply(self, host: Host) -> None:
        return host.set_global_view(self)


@dataclass(frozen=True)
class Define(Operation[str]):
    """Defines a function pickled by value; returns its content id."""

    shipped: ShippedFunction

    def apply(self, host: Host) -> str:
        return host.define(self)

    def created(self, result: str) -> Dropped:
        return Dropped(functions=(result,))


@dataclass(frozen=True)
class Run(Operation[ValueInfos]):
    """``strategy.run(function, args, kwargs)``; returns the new values."""

    function_id: str
    args: ValueArgs
    kwargs: ValueArgs
    dispatches: ClassVar[bool] = True
    followable: ClassVar[bool] = True
    uniform: ClassVar[bool] = True

    def apply(self, host: Host) -> ValueInfos:
        return host.run(self)

    def created(self, result: ValueInfos) -> Dropped:
        return values_in(result)


@dataclass(frozen=True)
class RunSpmd(Operation[ValueInfos]):
    """``strategy.spmd(fn, mesh=...)(*args, **kwargs)``: ``fn`` as one ``jax.jit``
    program over a mesh of ``mesh`` (as :class:`SetGlobalView` describes it); global
    values keep their shardings, host arrays are split by ``batch_sharding`` (one
    ``PartitionSpec``'s entries; ``None``: rows over the first axis where they
    divide). Returns the new (global) values."""

    function_id: str
    mesh: tuple[tuple[str, int], ...]
    batch_sharding: tuple[Any, ...] | None
    args: ValueArgs
    kwargs: ValueArgs
    dispatches: ClassVar[bool] = True
    followable: ClassVar[bool] = True
    uniform: ClassVar[bool] = True

    def apply(self, host: Host) -> ValueInfos:
        return host.run_spmd(self)

    def created(self, result: ValueInfos) -> Dropped:
        return values_in(result)


@dataclass(frozen=True)
class StepItems:
    """``run_steps`` input given as the steps' elements themselves (nests of values),
    taken by the caller from an iterator that is not a distributed one."""

    items: ValueArgs


@dataclass(frozen=True)
class RunSteps(Operation[ValueInfos]):
    """``strategy.run_steps``: ``steps`` steps in one on-device loop, fed from an
    iterator (by id) or from :class:`StepItems`; returns the new values, once they are
    computed if ``wait`` (else once the loop is dispatched)."""

    function_id: str
    source: int | StepItems
    steps: int
    initial_state: ValueArgs
    wait: bool = False
    dispatches: ClassVar[bool] = True
    followable: ClassVar[bool] = True
    uniform: ClassVar[bool] = True

    def apply(self, host: Host) -> ValueInfos:
        return host.run_steps(self)

    def created(self, result: ValueInfos) -> Dropped:
        return values_in(result)

    def spoils(self) -> Dropped:
        return Dropped(iterators=(self.source,)) if isinstance(self.source, int) else Dropped()


@dataclass(frozen=True)
class ValuesFromFunction(Operation[ValueInfos]):
    """``experimental_distribute_values_from_function``; returns the new values."""

    function_id: str

    def apply(self, host: Host) -> ValueInfos:
        return host.values_from_function(self)

    def created(self, result: ValueInfos) -> Dropped:
        return values_in(result)


@dataclass(frozen=True)
class DistributeDataset(Operation[int]):
    """``experimental_distribute_dataset``: the dataset and its options, each as the
    object or as the client's pickle of it (the coordinator never unpickles user
    objects); returns the dataset's id."""

    dataset: Any
    options: Any

    def apply(self, host: Host) -> int:
        return host.distribute_dataset(self)

    def created(self, result: int) -> Dropped:
        return Dropped(datasets=(result,))


@dataclass(frozen=True)
class DistributeDatasetsFromFunction(Operation[int]):
    """``distribute_datasets_from_function``; returns the dataset's id."""

    function_id: str
    options: Any

    def apply(self, host: Host) -> int:
        return host.distribute_datasets_from_function(self)

    def created(self, result: int) -> Dropped:
        return Dropped(datasets=(result,))


@dataclass(frozen=True)
class CreateIterator(Operation[int]):
    """A new iterator over a dataset whose infeeds prepare ``steps_per_run`` steps at
    a time (``None``: the engine's); returns its id."""

    dataset_id: int
    steps_per_run: int | None = None

    def apply(self, host: Host) -> int:
        return host.create_iterator(self)

    def created(self, result: int) -> Dropped:
        return Dropped(iterators=(result,))


@dataclass(frozen=True)
class NextInput(Operation[tuple[ValueInfos, int]]):
    """The next step's input of an iterator, kept as new values, and how many steps
    after it this host has ready in full (``LocalIterator.full_steps_ahead``)."""

    iterator_id: int
    # The hosts agree on how many steps remain, and a dataset's error on one host
    # fails the others' too (PeerHostError): it fails everywhere or nowhere.
    followable: ClassVar[bool] = True

    def apply(self, host: Host) -> tuple[ValueInfos, int]:
        return host.next_input(self)

    def created(self, result: tuple[ValueInfos, int]) -> Dropped:
        return values_in(result[0])

    def spoils(self) -> Dropped:
        return Dropped(iterators=(self.iterator_id,))


@dataclass(frozen=True)
class Reduce(Operation[Any]):
    """``strategy.reduce``: the result as numpy from host 0, ``None`` from the others.

    The rule for every backend: a per-replica leaf is reduced across its replicas
    (and along ``axis``); a global array (from ``strategy.spmd`` or a global-view
    job) is one value with no replicas, so ``axis=None`` gives it whole and an
    ``axis`` reduces along that axis of it; any other array is mirrored, the same
    on every replica (``SUM`` counts each replica's copy). ``gather`` refuses a
    global array; ``experimental_local_results`` of a value without per-replica
    leaves is ``(value,)``."""

    reduce_op: ReduceOp | str
    value: ValueArgs
    axis: int | None

    def apply(self, host: Host) -> Any:
        return host.reduce(self)


@dataclass(frozen=True)
class GatherParts(Operation["tuple[int, list[Any]]"]):
    """This host's replicas' parts of ``gather(value, axis)`` (only ``replicas``,
    when given) and the normalized axis: arrays, or with ``streamed``, views of the
    device memory as :class:`~jaxpod.pieces.Streamed` buffers (the receiving end cuts
    them as it forwards them). ``rows``: only rows ``[start, stop)`` of each part, so
    a large result travels in blocks; ``padded``: each replica's whole component,
    padding rows included (``PerReplica.array``'s parts; ``axis`` 0)."""

    value: Handle
    axis: int
    replicas: tuple[int, ...] | None = None
    streamed: bool = False
    rows: tuple[int, int] | None = None
    padded: bool = False

    def apply(self, host: Host) -> tuple[int, list[Any]]:
        return host.gather_parts(self)


@dataclass(frozen=True)
class FetchParts(Operation["list[np.ndarray]"]):
    """This host's replicas' padded components of a value (``PerReplica.array``)."""

    value: Handle

    def apply(self, host: Host) -> list[np.ndarray]:
        return host.fetch_parts(self)


#: Where a shard sits in its global array: (start, stop) along each axis.
ShardIndex = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class FetchShards(Operation["list[tuple[ShardIndex, np.ndarray]]"]):
    """The shards of a global array this host holds, each once (a replicated shard
    comes from the host holding its first copy), with where each goes; with ``rows``,
    only their parts within rows ``[start, stop)`` of the array's first axis."""

    value: Handle
    rows: tuple[int, int] | None = None

    def apply(self, host: Host) -> list[tuple[ShardIndex, np.ndarray]]:
        return host.fetch_shards(self)


@dataclass(frozen=True)
class LocalResults(Operation["tuple[Any, ...]"]):
    """This host's replicas' values, padding dropped (``experimental_local_results``)."""

    value: ValueArgs

    def apply(self, host: Host) -> tuple[Any, ...]:
        return host.local_results(self)


@dataclass(frozen=True)
class ReplicaValue(Operation[Any]):
    """One replica's component of a value's leaves (numpy), from the host holding that
    replica (the others answer ``None``): a job's mirrored state, fetched once."""

    value: ValueArgs
    replica: int

    def apply(self, host: Host) -> Any:
        return host.replica_value(self)


@dataclass(frozen=True)
class Stats(Operation[HostStats]):
    """What the host holds and how long it worked."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> HostStats:
        return host.stats(self)


@dataclass(frozen=True)
class ResetHost(Operation[HostReset]):
    """Frees every value, dataset and iterator, zeroes the work figures and stops
    capturing output (discarding it), keeping the defined (and compiled) functions: the
    slice's next holder starts on warm workers."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> HostReset:
        return host.reset_host(self)


@dataclass(frozen=True)
class CaptureOutput(Operation[None]):
    """Starts (``enabled``) or stops keeping what the host's code prints on stdout and
    stderr; starting while capturing keeps the one capture. Stopping keeps what was
    captured (an unfinished last line becomes a line) until it is taken."""

    enabled: bool
    counts_as_work: ClassVar[bool] = False  # bookkeeping, as Stats: no busy time

    def apply(self, host: Host) -> None:
        return host.capture_output(self)


@dataclass(frozen=True)
class TakeOutput(Operation["list[str]"]):
    """The complete lines the host printed since the last take, in order (stdout and
    stderr together). Text ``jax.debug.print`` writes comes when the computation
    that prints it runs: it may come with a later take."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> list[str]:
        return host.take_output(self)


@dataclass(frozen=True)
class HostReport(Operation[HostNews]):
    """The host's news for a job's runner: printed lines (taken, as
    :class:`TakeOutput` takes them), input figures, preemption notice and the job's
    committed checkpoint step (of the checkpoints under ``checkpoints``, if given)."""

    checkpoints: str | None = None
    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> HostNews:
        return host.host_report(self)


@dataclass(frozen=True)
class SaveCheckpoint(Operation[None]):
    """Starts writing a job's state as checkpoint ``step`` under ``directory`` (orbax;
    the last ``keep`` kept), with each host's input position in iterator
    ``iterator_id`` (``None``: the job has no input); returns once its bytes are off
    the devices, before they are on storage."""

    directory: str
    step: int
    keep: int
    state: ValueArgs
    iterator_id: int | None
    dispatches: ClassVar[bool] = True  # orbax synchronises the hosts

    def apply(self, host: Host) -> None:
        return host.save_checkpoint(self)


@dataclass(frozen=True)
class WaitCheckpoints(Operation["int | None"]):
    """Waits until the checkpoint writes under ``directory`` are committed; returns the
    newest committed step (``None``: none)."""

    directory: str
    dispatches: ClassVar[bool] = True

    def apply(self, host: Host) -> int | None:
        return host.wait_checkpoints(self)


@dataclass(frozen=True)
class RestoreCheckpoint(Operation["tuple[ValueInfos, Any]"]):
    """Restores checkpoint ``step`` under ``directory`` onto the devices: the state as
    new values (``skeleton``: its frozen structure, each leaf its index) and this
    host's input position at the step (``keep``: as the attempt's saves will)."""

    directory: str
    step: int
    keep: int
    skeleton: Any
    #: A global-view job's ``init_fn`` (by id): the leaves go where it puts them.
    init_function_id: str | None = None
    dispatches: ClassVar[bool] = True

    def apply(self, host: Host) -> tuple[ValueInfos, Any]:
        return host.restore_checkpoint(self)

    def created(self, result: tuple[ValueInfos, Any]) -> Dropped:
        return values_in(result[0])


@dataclass(frozen=True)
class StartProfile(Operation[None]):
    """Starts a ``jax.profiler`` trace into ``<folder>/host-<i>`` on every host; each
    host ends it after ``seconds``."""

    folder: str
    seconds: float
    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> None:
        return host.start_profile(self)


@dataclass(frozen=True)
class StopProfile(Operation["list[str]"]):
    """Ends the host's trace if it still runs; the trace files it wrote."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> list[str]:
        return host.stop_profile(self)


@dataclass(frozen=True)
class PreemptionNotices(Operation["Notice | None"]):
    """The host's notice of a coming preemption (``None``: none came). No device work:
    the coordinator asks after every on-device loop and before keeping a slice warm."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> Notice | None:
        return host.preemption_notices(self)


class Host(Protocol):
    """What runs host operations: one method per operation, named after it."""

    def configure(self, op: Configure) -> int: ...

    def set_global_view(self, op: SetGlobalView) -> None: ...

    def define(self, op: Define) -> str: ...

    def run(self, op: Run) -> ValueInfos: ...

    def run_steps(self, op: RunSteps) -> ValueInfos: ...

    def run_spmd(self, op: RunSpmd) -> ValueInfos: ...

    def values_from_function(self, op: ValuesFromFunction) -> ValueInfos: ...

    def distribute_dataset(self, op: DistributeDataset) -> int: ...

    def distribute_datasets_from_function(self, op: DistributeDatasetsFromFunction) -> int: ...

    def create_iterator(self, op: CreateIterator) -> int: ...

    def next_input(self, op: NextInput) -> tuple[ValueInfos, int]: ...

    def reduce(self, op: Reduce) -> Any: ...

    def gather_parts(self, op: GatherParts) -> tuple[int, list[Any]]: ...

    def fetch_parts(self, op: FetchParts) -> list[np.ndarray]: ...

    def fetch_shards(self, op: FetchShards) -> list[tuple[ShardIndex, np.ndarray]]: ...

    def local_results(self, op: LocalResults) -> tuple[Any, ...]: ...

    def stats(self, op: Stats) -> HostStats: ...

    def reset_host(self, op: ResetHost) -> HostReset: ...

    def capture_output(self, op: CaptureOutput) -> None: ...

    def take_output(self, op: TakeOutput) -> list[str]: ...

    def preemption_notices(self, op: PreemptionNotices) -> Notice | None: ...

    def host_report(self, op: HostReport) -> HostNews: ...

    def save_checkpoint(self, op: SaveCheckpoint) -> None: ...

    def wait_checkpoints(self, op: WaitCheckpoints) -> int | None: ...

    def restore_checkpoint(self, op: RestoreCheckpoint) -> tuple[ValueInfos, Any]: ...

    def replica_value(self, op: ReplicaValue) -> Any: ...

    def start_profile(self, op: StartProfile) -> None: ...

    def stop_profile(self, op: StopProfile) -> list[str]: ...


def values_in(infos: ValueInfos) -> Dropped:
    """The values a tree of :class:`HandleInfo` describes."""
    import jax

    leaves = jax.tree.leaves(infos, is_leaf=lambda x: isinstance(x, HandleInfo))
    return Dropped(values=tuple(x.id for x in leaves if isinstance(x, HandleInfo)))


@dataclass(frozen=True)
class Envelope:
    """One message of the operation channel: the operation, its number in the
    group's sequence (the worker checks it: a skipped or reordered operation fails
    loudly instead of deadlocking a collective), what to free before it, and the
    first id for the objects it creates (ids come from the coordinator, so that
    every host names them alike whatever failed before)."""

    seq: int
    operation: Operation[Any]
    dropped: Dropped | None = None
    first_id: int = 1
    #: The id past the last it may give (``None``: no limit): the coordinator sent
    #: the next operation, with its own ids, before reading this one's replies.
    id_limit: int | None = None
    #: The next message may arrive before the reply is read: the reply must lend
    #: no memory (a lent buffer lives only until the next message).
    ahead: bool = False


# ------------------------------------------------------------------ value ids
#: A stream operation's n-th output value has the id ``op << OUTPUT_BITS | n``.
OUTPUT_BITS = 20
_OUTPUT_MASK = (1 << OUTPUT_BITS) - 1


def output_id(op: int, index: int) -> int:
    """The id of stream operation ``op``'s ``index``-th output value (``SliceOp``).

    Raises:
      ValueError: an operation that makes more values than an id leaves room for.
    """
    if index > _OUTPUT_MASK:
        raise ValueError(f"An operation may make at most {_OUTPUT_MASK + 1} values; "
                         "return fewer leaves.")
    return op << OUTPUT_BITS | index


def op_of(value_id: int) -> int:
    """The stream operation that made value ``value_id``."""
    return value_id >> OUTPUT_BITS


def output_index(value_id: int) -> int:
    """Value ``value_id``'s place among its operation's outputs."""
    return value_id & _OUTPUT_MASK
