"""The strategy methods over a :class:`ReplicaGroup`: what the coordinator drives.

``GroupEngine`` gives the coordinator (and, through it, the remote client) the same
methods as the in-process engine, for a replica group spread over several hosts.
Values stay on the workers as :class:`GroupValue` handles; step and dataset functions
travel once as cloudpickle bytes. Results come back as numpy: reductions from host 0
only, gathers and local results as each host's own replicas' parts, joined here in
replica order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

from jaxpod import operations as ops
from jaxpod import settings
from jaxpod.errors import EndOfDataError, SliceResetError, UnknownFunctionError
from jaxpod.operations import Dropped, Handle, HandleInfo, StepItems
from jaxpod.pieces import PieceLayout, Pieces
from jaxpod.service.slices.replica_group import Pipeline, ReplicaGroup
from jaxpod.shipping import ShippedFunction, ship
from jaxpod.types import InputOptions, ReduceOp

_R = TypeVar("_R")
#: The most bytes of a large result fetched from the workers in one operation: a
#: caller that streams it holds the block it sends and the one fetched ahead.
RESULT_BLOCK = settings.RESULT_BLOCK_BYTES


@dataclass(frozen=True, eq=False)
class GroupValue:
    """A ``PerReplica`` value held by every worker of a group (by handle id)."""

    info: HandleInfo
    group: GroupEngine

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.info.dtype)

    def __repr__(self) -> str:
        rows = "" if self.info.valid_rows is None else f", valid_rows={list(self.info.valid_rows)}"
        return f"GroupValue(id={self.info.id}, shape={self.shape}, dtype={self.dtype}{rows})"


@dataclass(frozen=True)
class DefinedFunction:
    """A function already defined on the group's workers (by content id).

    The coordinator receives functions as pickled bytes and never unpickles user code;
    it defines them once and passes this wherever a method takes a function.
    """

    id: str


@dataclass(frozen=True)
class GatherParts:
    """One gathered leaf: the replicas' parts in replica order, the axis to join them
    on, and the joined result's shape and dtype.

    ``parts`` may be fetched lazily, one replica ahead of its reader, and come as
    ``Pieces`` (see :meth:`GroupEngine.gather_parts`): iterate it once.
    """

    axis: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    parts: Iterable[np.ndarray | Pieces]

    def join(self) -> np.ndarray:
        return np.concatenate(list(self.parts), axis=self.axis)


def _is_value(x: object) -> bool:
    return isinstance(x, GroupValue)


class GroupEngine:
    """``TPUStrategy`` methods executed by a replica group's workers."""

    def __init__(self, group: ReplicaGroup, steps_per_run: int = 1,
                 functions: weakref.WeakKeyDictionary[Any, str] | None = None) -> None:
        self.group = group
        self.steps_per_run = steps_per_run
        # fn -> id of what the workers have defined; a warm group's next engine takes
        # over the previous one's (the workers kept the functions).
        self._functions: weakref.WeakKeyDictionary[Any, str] = (
            weakref.WeakKeyDictionary() if functions is None else functions)
        self.dropped = DropQueue()
        self._num_replicas: int | None = None
        self._configured: ops.Configure | None = None
        self._capturing = False  # restarted workers capture again

    def _call(self, op: ops.Operation[_R], layout: PieceLayout | None = None,
              timeout: float | None = None) -> list[_R]:
        try:
            return self.group.call(op, drops=self.dropped, layout=layout, timeout=timeout)
        except SliceResetError:
            self._after_reset()
            raise

    def _after_reset(self) -> None:
        """The workers were restarted: nothing defined or dropped before exists on them;
        they get this engine's device assignment again."""
        self._functions = weakref.WeakKeyDictionary()
        self.dropped.take()
        if self._configured is not None:
            self.group.call(self._configured)
        if self._capturing:
            self.group.call(ops.CaptureOutput(True))

    @property
    def functions(self) -> weakref.WeakKeyDictionary[Any, str]:
        """The functions this engine defined on the workers (fn -> id)."""
        return self._functions

    def reset_workers(self, timeout: float | None = None) -> list[ops.HostReset]:
        """Frees every value, dataset and iterator on the workers, keeping their
        functions, for the slice's next holder; what is queued to drop goes too (it is
        freed already). Returns what each host freed.

        Raises:
          Whatever the group's call raises (a lost worker, a broken group, a time-out):
          the caller must then stop the workers instead of handing them on.
        """
        resets = self.group.call(ops.ResetHost(), timeout=timeout)
        self.dropped.take()
        self._capturing = False  # the reset stopped it
        return resets

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas or self.group.num_replicas

    # ------------------------------------------------------------------ functions
    def configure(self, steps_per_run: int = 1, computation_shape: list[int] | None = None,
                  num_replicas: int | None = None) -> int:
        """Sets the workers' device assignment (as ``DeviceAssignment.build`` takes it)
        and default steps per run, before any value exists; returns the replica count."""
        shape = None if computation_shape is None else tuple(computation_shape)
        configure = ops.Configure(steps_per_run, shape, num_replicas)
        replicas = self._call(configure)[0]
        self._configured = configure
        self.steps_per_run = steps_per_run
        self._num_replicas = replicas
        return replicas

    def set_global_view(self, mesh: Sequence[tuple[str, int]],
                        batch_sharding: ShippedFunction | None) -> None:
        """Makes the group's next values those of a global-view job (see
        :class:`jaxpod.operations.SetGlobalView`), before any value exists."""
        self._call(ops.SetGlobalView(tuple((str(n), int(s)) for n, s in mesh), batch_sharding))

    def define(self, shipped: ShippedFunction) -> DefinedFunction:
        """Defines a function the caller pickled (``jaxpod.shipping.ship``)."""
        return DefinedFunction(self._call(ops.Define(shipped))[0])

    def _define(self, fn: Callable[..., Any] | DefinedFunction) -> str:
        if isinstance(fn, DefinedFunction):
            return fn.id
        try:
            return self._functions[fn]
        except (KeyError, TypeError):
            pass
        function_id = self._call(ops.Define(ship(fn)))[0]
        with contextlib.suppress(TypeError):  # not weak-referenceable: define again next time
            self._functions[fn] = function_id
        return function_id

    def _call_defined(self, fn: Callable[..., Any] | DefinedFunction,
                      operation: Callable[[str], ops.Operation[_R]]) -> list[_R]:
        """Runs ``operation(fn's id)``. The workers keep functions in a bounded cache:
        if they evicted this one since, it is defined again and the operation sent
        once more (nothing ran the first time). A caller that holds only the id (a
        ``DefinedFunction``) hears of the eviction and defines it again itself."""
        try:
            return self._call(operation(self._define(fn)))
        except UnknownFunctionError:
            if isinstance(fn, DefinedFunction):
                raise
            with contextlib.suppress(KeyError, TypeError):
                del self._functions[fn]
            return self._call(operation(self._define(fn)))

    def _to_handles(self, tree: Any) -> Any:
        def convert(x: Any) -> Any:
            if isinstance(x, GroupValue):
                if x.group is not self:
                    raise ValueError(
                        f"{x!r} belongs to another replica group; values cannot move "
                        "between groups."
                    )
                return Handle(x.info.id)
            return x

        return jax.tree.map(convert, tree, is_leaf=_is_value)

    def _wrap(self, infos: Any) -> Any:
        return jax.tree.map(self.value, infos, is_leaf=lambda x: isinstance(x, HandleInfo))

    def value(self, info: HandleInfo) -> GroupValue:
        """The value ``info`` describes, freed on the workers once dropped here."""
        value = GroupValue(info, self)
        weakref.finalize(value, self.dropped.values.append, info.id)
        return value

    def make(self, op: ops.Operation[Any], infos: Callable[[list[Any]], Any]
             ) -> tuple[Any, list[Any]]:
        """Runs ``op``, a value-making operation as sent (``run_op``, ...): the values
        it made, described by ``infos(every host's answer)``, and those answers."""
        answers = self._call(op)
        return self._wrap(infos(answers)), answers

    @contextlib.contextmanager
    def pipeline(self) -> Iterator[EnginePipeline]:
        """Holds the group to send operations ahead of the replies before them
        (:meth:`ReplicaGroup.pipeline`). After a reset seen meanwhile, the restarted
        workers get this engine's set-up once the group is let go."""
        ahead = EnginePipeline(self)
        try:
            with self.group.pipeline() as pipeline:
                ahead.pipeline = pipeline
                yield ahead
        finally:
            if ahead.reset:
                self._after_reset()

    # ------------------------------------------------------- operations as sent
    def run_op(self, function_id: str, args: Any, kwargs: Any) -> ops.Run:
        # The workers' engine checks args and kwargs, with the in-process messages.
        return ops.Run(function_id, self._to_handles(args), self._to_handles(kwargs))

    def run_spmd_op(self, function_id: str, mesh: Sequence[tuple[str, int]],
                    batch_sharding: Sequence[Any] | None, args: Any, kwargs: Any
                    ) -> ops.RunSpmd:
        axes = tuple((str(n), int(s)) for n, s in mesh)
        sharding = None if batch_sharding is None else tuple(batch_sharding)
        return ops.RunSpmd(function_id, axes, sharding, self._to_handles(args),
                           self._to_handles(kwargs or {}))

    def run_steps_op(self, function_id: str, iterator: GroupIterator | StepItems,
                     steps: int | None, initial_state: Any, wait: bool = False
                     ) -> ops.RunSteps:
        source: int | StepItems
        if isinstance(iterator, StepItems):
            source = StepItems(self._to_handles(iterator.items))
        elif isinstance(iterator, GroupIterator):
            source = iterator.id
        else:
            raise TypeError("run_steps: iterator must come from this group's distributed "
                            f"dataset, or be StepItems. Got {type(iterator).__name__}.")
        k = self.steps_per_run if steps is None else steps
        return ops.RunSteps(function_id, source, k, self._to_handles(initial_state), wait)

    # ------------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any] | DefinedFunction, args: Any = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        return self._wrap(self._call_defined(fn, lambda f: self.run_op(f, args, kwargs))[0])

    def run_steps(self, fn: Callable[..., Any] | DefinedFunction,
                  iterator: GroupIterator | StepItems, steps: int | None = None,
                  initial_state: Any = None, wait: bool = False) -> Any:
        """``strategy.run_steps``; with ``wait``, it returns once the loop's results
        are computed (not just dispatched): a caller that times loops sees their
        compute."""
        result = self._call_defined(
            fn, lambda f: self.run_steps_op(f, iterator, steps, initial_state, wait))[0]
        return self._wrap(result)

    def run_spmd(self, fn: Callable[..., Any] | DefinedFunction,
                 mesh: Sequence[tuple[str, int]], batch_sharding: Sequence[Any] | None,
                 args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
        """``strategy.spmd``'s call: ``fn`` as one ``jax.jit`` program over a mesh of
        the slice (see :class:`jaxpod.operations.RunSpmd`); returns global values.
        ``batch_sharding``: a ``PartitionSpec``'s entries, or ``None``."""
        infos = self._call_defined(
            fn, lambda f: self.run_spmd_op(f, mesh, batch_sharding, args, kwargs))[0]
        return self._wrap(infos)

    # ------------------------------------------------------------------- results
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        return self.answer(self.reduce_call(reduce_op, value, axis))

    def reduce_call(self, reduce_op: ReduceOp | str, value: Any, axis: int | None
                    ) -> ResultCall:
        """:meth:`reduce` as one operation: its result is host 0's."""
        return ResultCall(ops.Reduce(reduce_op, self._to_handles(value), axis), first_host)

    def answer(self, call: ResultCall) -> Any:
        """Runs ``call``: its result."""
        return call.answer(self._call(call.operation))

    def gather(self, value: Any, axis: int) -> Any:
        return jax.tree.map(lambda v: self.answer(self._gather_leaf(v, axis)), value,
                            is_leaf=_is_value)

    def gather_call(self, value: Any, axis: int) -> ResultCall | None:
        """:meth:`gather` as one operation, for a value of one leaf (``None``: it has
        more, one operation each)."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=_is_value)
        if len(leaves) != 1 or not _is_value(leaves[0]):
            return None
        call = self._gather_leaf(leaves[0], axis)
        return ResultCall(call.operation, lambda per_host: jax.tree.unflatten(
            treedef, [call.answer(per_host)]))

    def _gather_leaf(self, v: Any, axis: int) -> ResultCall:
        def joined(per_host: list[Any]) -> np.ndarray:  # every part in one operation
            return np.concatenate([p for _, parts in per_host for p in parts],
                                  axis=per_host[0][0])

        return ResultCall(ops.GatherParts(self._to_handles(v), axis, None, streamed=False),
                          joined)

    def _gather_call(self, v: Any, axis: int, replicas: tuple[int, ...] | None = None,
                     layout: PieceLayout | None = None, rows: tuple[int, int] | None = None,
                     padded: bool = False) -> tuple[int, list[Any]]:
        """One ``gather_parts`` operation: the normalized axis, every host's parts."""
        op = ops.GatherParts(self._to_handles(v), axis, replicas,
                             streamed=layout is not None, rows=rows, padded=padded)
        per_host = self._call(op, layout)
        return per_host[0][0], [p for _, parts in per_host for p in parts]

    def gather_parts(self, value: Any, axis: int, layout: PieceLayout | None = None) -> Any:
        """``gather``'s result per leaf as blocks of its rows, not yet joined: a caller
        that streams them never holds the joined copy, nor more than two blocks of
        ``JAXPOD_RESULT_BLOCK_BYTES`` (one operation each, the next fetched while the
        caller reads the current one). With a ``layout``, blocks of rows a replica holds come as
        ``Pieces`` cut that way (views of the workers' device memory, copied once,
        into the pieces), ready to forward. Small leaves come in one operation.
        """
        def leaf(v: Any) -> GatherParts:
            n = self.num_replicas_in_sync
            big = isinstance(v, GroupValue) and n * _nbytes(v) > RESULT_BLOCK.value()
            if isinstance(v, GroupValue) and not v.info.global_view and v.shape \
                    and -len(v.shape) <= axis < len(v.shape) and (n > 1 or big):
                ax = axis % len(v.shape)
                rows = v.info.valid_rows or (v.shape[0],) * n
                if ax == 0:  # each replica's rows in turn, streamed as they come
                    spans = [(r, a, b) for r in range(n) for a, b in _spans(rows[r], v)]
                    return GatherParts(0, (sum(rows), *v.shape[1:]), v.dtype, _fetched_ahead(
                        lambda s: self._gather_call(v, 0, (s[0],), layout, s[1:])[1][0],
                        spans or [(0, 0, 0)]))
                if big and len(set(rows)) == 1:  # each row of the result spans replicas
                    shape = (rows[0], *v.shape[1:ax], v.shape[ax] * n, *v.shape[ax + 1:])
                    return GatherParts(0, shape, v.dtype, _fetched_ahead(
                        lambda span: np.concatenate(
                            self._gather_call(v, ax, rows=span)[1], axis=ax),
                        _spans(rows[0], v, n) or [(0, 0)]))
            ax, parts = self._gather_call(v, axis)
            joined = list(parts[0].shape)
            joined[ax] = sum(p.shape[ax] for p in parts)
            return GatherParts(ax, tuple(joined), parts[0].dtype, parts)

        return jax.tree.map(leaf, value, is_leaf=_is_value)

    def fetch(self, value: GroupValue) -> np.ndarray:
        """Every replica's padded component, stacked: ``PerReplica.array`` as numpy (a
        global value: the whole array, put together from each host's shards)."""
        return self.answer(self.fetch_call(value))

    def fetch_call(self, value: GroupValue) -> ResultCall:
        """:meth:`fetch` as one operation."""
        if not value.info.global_view:
            return ResultCall(ops.FetchParts(self._to_handles(value)), lambda per_host: np.stack(
                [p for parts in per_host for p in parts]))
        return ResultCall(ops.FetchShards(self._to_handles(value)),
                          lambda per_host: _assembled(value, per_host, None))

    def fetch_parts(self, value: GroupValue, layout: PieceLayout | None = None
                    ) -> GatherParts:
        """:meth:`fetch`'s result as blocks of its rows (see :meth:`gather_parts`): a
        per-replica value's padded components one after another, a global value's
        rows assembled block by block from the shards holding them."""
        if _nbytes(value) * (1 if value.info.global_view else self.num_replicas_in_sync) \
                <= RESULT_BLOCK.value() or not value.shape:
            whole = self.fetch(value)
            return GatherParts(0, whole.shape, whole.dtype, (whole,))
        if value.info.global_view:
            return GatherParts(0, value.shape, value.dtype, _fetched_ahead(
                lambda span: _assembled(value, self._call(
                    ops.FetchShards(self._to_handles(value), span)), span),
                _spans(value.shape[0], value)))
        n = self.num_replicas_in_sync
        spans = [(r, a, b) for r in range(n) for a, b in _spans(value.shape[0], value)]
        return GatherParts(0, (n, *value.shape), value.dtype, _fetched_ahead(
            lambda s: self._gather_call(value, 0, (s[0],), layout, s[1:], padded=True)[1][0],
            spans))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        results: tuple[Any, ...] = self.answer(self.local_results_call(value))
        return results

    def local_results_call(self, value: Any) -> ResultCall:
        """:meth:`experimental_local_results` as one operation."""
        if not any(_is_value(v) for v in jax.tree.leaves(value, is_leaf=_is_value)):
            # A single value: every host answers (value,).
            return ResultCall(ops.LocalResults(self._to_handles(value)), first_host)
        return ResultCall(ops.LocalResults(self._to_handles(value)), lambda per_host: tuple(
            r for host in per_host for r in host))

    def _replica_rows(self, v: GroupValue, replica: int, layout: PieceLayout | None,
                      rows: tuple[int, int]) -> Any:
        """Rows ``rows`` of replica ``replica``'s component of ``v`` (padding dropped)."""
        return self._gather_call(v, 0, (replica,), layout, rows)[1][0]

    def local_results_parts(self, value: Any, layout: PieceLayout | None = None
                            ) -> tuple[Any, ...]:
        """:meth:`experimental_local_results` with each large leaf's components as
        blocks of rows (``GatherParts``, see :meth:`gather_parts`); the small leaves
        come in one operation."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=_is_value)
        big = [i for i, v in enumerate(leaves) if isinstance(v, GroupValue)
               and not v.info.global_view and v.shape
               and _nbytes(v) * self.num_replicas_in_sync > RESULT_BLOCK.value()]
        if not big:
            return self.experimental_local_results(value)
        n = self.num_replicas_in_sync
        small = [v for i, v in enumerate(leaves) if i not in big]
        per_replica = ([list(r) for r in self.experimental_local_results(small)] if small
                       else [[] for _ in range(n)])
        out = []
        for r in range(n):
            rest = iter(per_replica[r])
            row = []
            for i, v in enumerate(leaves):
                if i not in big:
                    row.append(next(rest))
                    continue
                rows = (v.info.valid_rows or (v.shape[0],) * n)[r]
                block = functools.partial(self._replica_rows, v, r, layout)
                row.append(GatherParts(0, (rows, *v.shape[1:]), v.dtype,
                                       _fetched_ahead(block, _spans(rows, v) or [(0, 0)])))
            out.append(jax.tree.unflatten(treedef, row))
        return tuple(out)

    def replica_value(self, value: Any, replica: int = 0) -> Any:
        """Replica ``replica``'s component of ``value``'s leaves as numpy, sent by the
        one host holding it (a mirrored state's single copy, not one per replica)."""
        if not 0 <= replica < self.num_replicas_in_sync:
            raise ValueError(f"replica_value: replica must be in [0, "
                             f"{self.num_replicas_in_sync}); got {replica}.")
        answers = self._call(ops.ReplicaValue(self._to_handles(value), replica))
        return next(a for a in answers if a is not None)

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[..., Any] | DefinedFunction) -> Any:
        return self._wrap(self._call_defined(value_fn, ops.ValuesFromFunction)[0])

    # --------------------------------------------------------------------- input
    def experimental_distribute_dataset(self, dataset: Iterable[Any],
                                        options: InputOptions | None = None) -> GroupDataset:
        """Ships ``dataset`` to every host; each reads its shard (TF's DATA sharding)."""
        return GroupDataset(self, self._call(ops.DistributeDataset(dataset, options))[0])

    def distribute_datasets_from_function(
            self, dataset_fn: Callable[..., Any] | DefinedFunction,
            options: InputOptions | None = None) -> GroupDataset:
        return GroupDataset(self, self._call_defined(
            dataset_fn, lambda f: ops.DistributeDatasetsFromFunction(f, options))[0])

    def stats(self) -> list[dict[str, Any]]:
        """Each host's values, device bytes and iterators held, the seconds it spent
        running operations (``busy_s``, over ``operations`` of them), the seconds its
        steps waited for input (``input_wait_s``) and the chunks of steps its infeeds
        have ready (``input_queue_depth``): a :class:`~jaxpod.operations.HostStats`."""
        return [dataclasses.asdict(s) for s in self._call(ops.Stats())]

    def capture_output(self, enabled: bool) -> None:
        """Starts (or stops) keeping what code prints on each host's stdout and stderr
        (it still reaches the workers' logs); read it with :meth:`take_output`."""
        self._call(ops.CaptureOutput(enabled))
        self._capturing = enabled

    def take_output(self) -> list[list[str]]:
        """Each host's complete lines printed since the last take, in host order.
        ``jax.debug.print`` text comes once the computation printing it has run."""
        return self._call(ops.TakeOutput())

    def host_reports(self, checkpoints: str | None = None) -> list[ops.HostNews]:
        """Each host's news for a job's runner, in host order, in one round trip: the
        lines printed since the last take, its input figures, its preemption notice and
        the newest committed step of the checkpoints under ``checkpoints``."""
        return self._call(ops.HostReport(checkpoints))

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str, step: int, keep: int, state: Any,
                        iterator: GroupIterator | None) -> None:
        """Starts the hosts writing ``state`` as checkpoint ``step`` under
        ``directory`` with their input positions in ``iterator``; returns once the next
        loop may change the state (the bytes reach storage in the background)."""
        self._call(ops.SaveCheckpoint(directory, step, keep, self._to_handles(state),
                                      iterator.id if iterator is not None else None))

    def wait_checkpoints(self, directory: str) -> int | None:
        """Waits until the hosts committed their writes under ``directory``; the newest
        committed step."""
        return self._call(ops.WaitCheckpoints(directory))[0]

    def restore_checkpoint(self, directory: str, step: int, keep: int, skeleton: Any,
                           init: DefinedFunction | None = None) -> tuple[Any, list[Any]]:
        """Checkpoint ``step``'s state onto the devices (``skeleton``: its frozen
        structure, each leaf its index) and each host's input position at the step
        (``keep``: the checkpoints the attempt's saves keep; ``init``: a global-view
        job's ``init_fn``, whose shardings the leaves take)."""
        answers = self._call(ops.RestoreCheckpoint(directory, step, keep, skeleton,
                                                   init.id if init else None))
        return self._wrap(answers[0][0]), [position for _, position in answers]

    # ----------------------------------------------------------------- profiles
    def start_profile(self, folder: str, seconds: float) -> None:
        """Starts a ``jax.profiler`` trace on every host into ``<folder>/host-<i>``;
        each host ends its own after ``seconds``."""
        self._call(ops.StartProfile(folder, seconds))

    def stop_profile(self) -> list[str]:
        """Ends the hosts' traces if they still run; every trace file written, in host
        order."""
        return [name for files in self._call(ops.StopProfile()) for name in files]

    def preemption_notices(self, timeout: float | None = None) -> list[ops.Notice | None]:
        """Each host's notice of a coming preemption (``None`` where none came), in
        host order. A host with one is about to be killed: checkpoint and release.

        Args:
          timeout: the call's limit (``JAXPOD_OPERATION_TIMEOUT_S`` when ``None``).
        """
        return self._call(ops.PreemptionNotices(), timeout=timeout)


@dataclass(frozen=True)
class ResultCall:
    """A result that one operation computes: the operation, and the result from
    every host's answer."""

    operation: ops.Operation[Any]
    answer: Callable[[list[Any]], Any]


def first_host(per_host: list[Any]) -> Any:
    """The answer of host 0 (where every host answers the same)."""
    return per_host[0]


class EnginePipeline:
    """An engine's operations sent ahead of the replies before them
    (:meth:`GroupEngine.pipeline`): what each drops goes with it."""

    def __init__(self, engine: GroupEngine) -> None:
        self.engine = engine
        self.pipeline: Pipeline | None = None
        #: Whether a reset restarted the workers meanwhile.
        self.reset = False

    def _open(self) -> Pipeline:
        assert self.pipeline is not None, "used outside GroupEngine.pipeline()"
        return self.pipeline

    @property
    def pending(self) -> int:
        return self._open().pending

    def can_follow(self) -> bool:
        return self._open().can_follow()

    def send(self, op: ops.Operation[Any]) -> int | None:
        """Sends ``op``; returns the first id of the objects it creates (``None``:
        too large to go ahead now, :meth:`Pipeline.send`)."""
        return self._open().send(op, self.engine.dropped)

    def receive(self) -> list[Any]:
        """The oldest unread operation's result per host, or its error."""
        try:
            return self._open().receive()
        except SliceResetError:
            self.reset = True
            raise


class GroupDataset:
    """A dataset distributed over a group's hosts."""

    def __init__(self, engine: GroupEngine, dataset_id: int) -> None:
        self._engine = engine
        self.id = dataset_id

    def __iter__(self) -> GroupIterator:
        return self.iterate()

    def iterate(self, steps_per_run: int | None = None) -> GroupIterator:
        """An iterator whose infeeds prepare ``steps_per_run`` steps at a time."""
        return GroupIterator(self._engine, self._engine._call(
            ops.CreateIterator(self.id, steps_per_run))[0])

    def free(self) -> None:
        """Drops the dataset on the workers with the next operation (its iterators
        keep running)."""
        self._engine.dropped.datasets.append(self.id)


class GroupIterator(Iterator[Any]):
    """An iterator whose infeed threads run on the workers."""

    def __init__(self, engine: GroupEngine, iterator_id: int) -> None:
        self._engine = engine
        self.id = iterator_id
        #: After a ``next``: the steps after it that every host has ready in full.
        self.full_steps_ahead = 0
        # Dropping the iterator stops its infeed threads on the workers.
        weakref.finalize(self, engine.dropped.iterators.append, iterator_id)

    def __next__(self) -> Any:
        try:
            replies = self._engine._call(ops.NextInput(self.id))
            self.full_steps_ahead = min(ahead for _, ahead in replies)
            return self._engine._wrap(replies[0][0])
        except EndOfDataError:
            raise
        except StopIteration as e:
            raise EndOfDataError(str(e)) from None


_Part = TypeVar("_Part")
_Span = TypeVar("_Span")


def _nbytes(v: GroupValue) -> int:
    """Bytes of one component of ``v`` (of the whole array, for a global value)."""
    return math.prod(v.shape) * v.dtype.itemsize


def _spans(rows: int, v: GroupValue, copies: int = 1) -> list[tuple[int, int]]:
    """``[0, rows)`` cut into spans of at most ``JAXPOD_RESULT_BLOCK_BYTES`` of ``v``'s
    rows (times ``copies``), at least one row each."""
    row_bytes = max(1, math.prod(v.shape[1:]) * v.dtype.itemsize * copies)
    step = max(1, RESULT_BLOCK.value() // row_bytes)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _assembled(value: GroupValue, per_host: list[Any], rows: tuple[int, int] | None
               ) -> np.ndarray:
    """A global value (rows ``rows`` only, if given) put together from each host's
    shards of it (``FetchShards``' answers)."""
    start, stop = rows if rows is not None else (0, value.shape[0] if value.shape else 0)
    shape = value.shape if not value.shape else (stop - start, *value.shape[1:])
    out = np.empty(shape, value.dtype)
    for shards in per_host:
        for index, data in shards:
            at = [slice(a, b) for a, b in index]
            if at:
                at[0] = slice(at[0].start - start, at[0].stop - start)
            out[tuple(at)] = data
    return out


def _fetched_ahead(fetch: Callable[[_Span], _Part], spans: Sequence[_Span]) -> Iterator[_Part]:
    """``fetch(s)`` for each of ``spans`` (at least one), as an iterator: the first
    fetched now (so its errors reach the caller before anything is sent), each
    following one on a helper thread while its predecessor is being read."""
    first = fetch(spans[0])
    return _ahead(first, fetch, spans[1:])


def _ahead(first: _Part, fetch: Callable[[_Span], _Part], rest: Sequence[_Span]
           ) -> Iterator[_Part]:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpod-gather")
    try:
        ahead = [pool.submit(fetch, r) for r in rest[:1]]
        yield first
        for r in rest[1:]:
            current = ahead.pop().result()
            ahead.append(pool.submit(fetch, r))
            yield current
        if ahead:
            yield ahead.pop().result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a cancelled reader need not wait


class DropQueue:
    """Values, iterators and datasets dropped here, freed on the workers with the next
    operation (a finalizer must not call into the group: it may run inside a call)."""

    def __init__(self) -> None:
        self.values: collections.deque[int] = collections.deque()
        self.iterators: collections.deque[int] = collections.deque()
        self.datasets: collections.deque[int] = collections.deque()

    def take(self) -> Dropped | None:
        """Empties the queue (finalizers may append meanwhile: deques are thread-safe)."""
        if not (self.values or self.iterators or self.datasets):
            return None
        return Dropped(_drain(self.values), _drain(self.iterators), _drain(self.datasets))

    def restore(self, dropped: Dropped) -> None:
        """Puts back what :meth:`take` gave, for an operation that was not sent."""
        self.values.extend(dropped.values)
        self.iterators.extend(dropped.iterators)
        self.datasets.extend(dropped.datasets)


def _drain(queue: collections.deque[int]) -> tuple[int, ...]:
    items = []
    while queue:
        items.append(queue.popleft())
    return tuple(items)
