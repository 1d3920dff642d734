"""The strategy methods over a :class:`ReplicaGroup`: what the coordinator drives.

``GroupEngine`` gives the coordinator (and, through it, the remote client) the same
methods as the in-process engine, for a replica group spread over several hosts.
Values stay on the workers as :class:`GroupValue` handles (with the engine's other
handles, in :mod:`~jaxpod.service.slices.group_handles`); step and dataset functions
travel once as cloudpickle bytes. Here: the engine's calls (functions defined once,
handles in, values out, what a reset of the workers undoes), the value-making and input
methods, the hosts' figures, output, checkpoints and profiles, and operations sent
ahead (:class:`EnginePipeline`). Results come back as numpy through the methods it
inherits from :class:`~jaxpod.service.slices.group_results.GroupResults`, large ones in
blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax

from jaxpod import operations as ops
from jaxpod.errors import SliceResetError, UnknownFunctionError
from jaxpod.operations import Handle, HandleInfo
from jaxpod.pieces import PieceLayout
from jaxpod.service.slices.group_handles import (
    DefinedFunction,
    DropQueue,
    GroupDataset,
    GroupIterator,
    GroupValue,
    is_group_value,
)
from jaxpod.service.slices.group_results import GroupResults
from jaxpod.service.slices.replica_group import Pipeline, ReplicaGroup
from jaxpod.shipping import ShippedFunction, ship
from jaxpod.types import InputOptions

_R = TypeVar("_R")


class GroupEngine(GroupResults):
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
                      operation: Callable[[str], ops.Operation[_R]],
                      timeout: float | None = None) -> list[_R]:
        """Runs ``operation(fn's id)`` (``timeout``: its limit, as :meth:`_call`). The
        workers keep functions in a bounded cache: if they evicted this one since, it
        is defined again and the operation sent once more (nothing ran the first
        time). A caller that holds only the id (a ``DefinedFunction``) hears of the
        eviction and defines it again itself."""
        try:
            return self._call(operation(self._define(fn)), timeout=timeout)
        except UnknownFunctionError:
            if isinstance(fn, DefinedFunction):
                raise
            with contextlib.suppress(KeyError, TypeError):
                del self._functions[fn]
            return self._call(operation(self._define(fn)), timeout=timeout)

    def handles(self, tree: Any) -> Any:
        def convert(x: Any) -> Any:
            if isinstance(x, GroupValue):
                if x.group is not self:
                    raise ValueError(
                        f"{x!r} belongs to another replica group; values cannot move "
                        "between groups."
                    )
                return Handle(x.info.id)
            return x

        return jax.tree.map(convert, tree, is_leaf=is_group_value)

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
        return ops.Run(function_id, self.handles(args), self.handles(kwargs))

    def run_spmd_op(self, function_id: str, mesh: Sequence[tuple[str, int]],
                    batch_sharding: Sequence[Any] | None, args: Any, kwargs: Any
                    ) -> ops.RunSpmd:
        axes = tuple((str(n), int(s)) for n, s in mesh)
        sharding = None if batch_sharding is None else tuple(batch_sharding)
        return ops.RunSpmd(function_id, axes, sharding, self.handles(args),
                           self.handles(kwargs or {}))


    # ------------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any] | DefinedFunction, args: Any = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        return self.make_values(fn, lambda f: self.run_op(f, args, kwargs))

    def make_values(self, fn: Callable[..., Any] | DefinedFunction,
                    operation: Callable[[str], ops.Operation[Any]],
                    timeout: float | None = None) -> Any:
        """Runs ``operation(fn's id)``, an operation that makes values (its value
        arguments as :meth:`handles` gives them): the values it made. ``timeout``: its
        limit (``JAXPOD_OPERATION_TIMEOUT_S`` when ``None``)."""
        return self._wrap(self._call_defined(fn, operation, timeout)[0])


    def run_spmd(self, fn: Callable[..., Any] | DefinedFunction,
                 mesh: Sequence[tuple[str, int]], batch_sharding: Sequence[Any] | None,
                 args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
        """``strategy.spmd``'s call: ``fn`` as one ``jax.jit`` program over a mesh of
        the slice (see :class:`jaxpod.operations.RunSpmd`); returns global values.
        ``batch_sharding``: a ``PartitionSpec``'s entries, or ``None``."""
        infos = self._call_defined(
            fn, lambda f: self.run_spmd_op(f, mesh, batch_sharding, args, kwargs))[0]
        return self._wrap(infos)

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
        self._call(ops.SaveCheckpoint(directory, step, keep, self.handles(state),
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

    def save_memory_checkpoint(self, job: str, step: int, state: Any,
                               iterator: GroupIterator | None) -> None:
        """Has the hosts keep ``state`` as in-memory checkpoint ``step`` of ``job``, each
        on its node and its peer's, with their input positions in ``iterator``; returns
        once the copies are dispatched."""
        self._call(ops.SaveMemoryCheckpoint(job, step, self.handles(state),
                                            iterator.id if iterator is not None else None))

    def memory_holdings(self, job: str, mesh: tuple[tuple[str, int], ...] | None
                        ) -> list[dict[int, dict[int, Any]]]:
        """What each host's node holds of ``job``'s in-memory checkpoints, in host order
        (``mesh``: a global-view job's axes)."""
        return self._call(ops.MemoryHoldings(job, mesh))

    def restore_memory_checkpoint(self, job: str, step: int, sources: Sequence[int],
                                  skeleton: Any, init: DefinedFunction | None = None) -> Any:
        """In-memory checkpoint ``step`` of ``job`` onto the devices, host ``g``'s
        shards from host ``sources[g]``'s node (``skeleton``, ``init``: as
        :meth:`restore_checkpoint`'s)."""
        answers = self._call(ops.RestoreMemoryCheckpoint(job, step, tuple(sources), skeleton,
                                                         init.id if init else None))
        return self._wrap(answers[0])

    def drop_memory_checkpoints(self, job: str) -> None:
        """Removes ``job``'s in-memory checkpoints from the hosts' nodes."""
        self._call(ops.DropMemoryCheckpoints(job))

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
