"""The operations behind the strategy methods.

Setting up the host's engine (:class:`Configure`, :class:`SetGlobalView`) and defining
functions (:class:`Define`); making values (:class:`Run`, :class:`RunSpmd`,
:class:`RunSteps`, :class:`ValuesFromFunction`); input (datasets, iterators,
:class:`NextInput`); and results brought back as numpy (:class:`Reduce`, the gather,
fetch and local-results parts, :class:`ReplicaValue`).

An operation that is one call of the host's engine says so in its ``apply``, over the
host's services (:class:`~jaxpod.operations.host.Host`); where every host answers,
``combine`` says how the coordinator makes the strategy's one answer from theirs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from jaxpod.operations.base import Operation
from jaxpod.operations.handles import Dropped, Handle, ValueArgs, ValueInfos, values_in

if TYPE_CHECKING:
    import numpy as np

    from jaxpod.operations.host import Host
    from jaxpod.shipping import ShippedFunction
    from jaxpod.types import ReduceOp


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
        fn = host.function(self.function_id)
        if host.global_view is not None:  # a global-view job's init_fn
            if self.args or self.kwargs:
                raise TypeError("A global-view job's init_fn takes no arguments.")
            return host.keep(host.global_view.init(fn))
        return host.keep(host.engine.run(fn, args=host.resolve(self.args),
                                         kwargs=host.resolve(self.kwargs)))

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
        started = time.monotonic()
        source = (iter(host.resolve(self.source.items)) if isinstance(self.source, StepItems)
                  else host.iterator(self.source))
        # A global-view job's loop runs global steps and takes its state donated (the
        # per-replica loop donates nothing: no handle to check on every loop).
        view = host.global_view
        result = (host.engine if view is None else view).run_steps(
            host.function(self.function_id), source, self.steps,
            host.resolve(self.initial_state))
        kept = host.keep(result, wait=self.wait,
                         donated=() if view is None else self.initial_state)
        if self.wait:  # its outputs are computed: the loop's time on this host
            host.engine.loop_time.add(self.steps, time.monotonic() - started)
        return kept

    def created(self, result: ValueInfos) -> Dropped:
        return values_in(result)

    def spoils(self) -> Dropped:
        return Dropped(iterators=(self.source,)) if isinstance(self.source, int) else Dropped()


@dataclass(frozen=True)
class ValuesFromFunction(Operation[ValueInfos]):
    """``experimental_distribute_values_from_function``; returns the new values."""

    function_id: str

    def apply(self, host: Host) -> ValueInfos:
        fn = host.function(self.function_id)
        return host.keep(host.engine.experimental_distribute_values_from_function(fn))

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
        iterator = host.iterator(self.iterator_id)
        return host.keep(next(iterator)), iterator.full_steps_ahead()

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
        from jaxpod import trees  # JAX loads where values are, not with the CLI

        return tuple(trees.freeze(r, "result") for r in
                     host.engine.experimental_local_results(host.resolve(self.value)))

    def combine(self, per_host: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        """The replicas' values in replica order (each host holds the next ones); a
        value without handles is ``(value,)`` on every host: the first host's."""
        import jax

        if not any(isinstance(x, Handle) for x in
                   jax.tree.leaves(self.value, is_leaf=lambda x: isinstance(x, Handle))):
            return per_host[0]
        return tuple(r for host in per_host for r in host)


@dataclass(frozen=True)
class ReplicaValue(Operation[Any]):
    """One replica's component of a value's leaves (numpy), from the host holding that
    replica (the others answer ``None``): a job's mirrored state, fetched once."""

    value: ValueArgs
    replica: int

    def apply(self, host: Host) -> Any:
        return host.replica_value(self)


