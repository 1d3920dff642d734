"""The engine: ``tf.distribute.TPUStrategy`` semantics on a JAX mesh.

Every replica is one slot of the mesh's ``"replica"`` axis. ``run`` compiles the
user's step function once per input signature as ``jax.jit(shard_map(...))`` over that
axis; per-replica values stay on the devices as :class:`PerReplica` handles whose
global array carries the replica axis first. The same code runs in one process or in
one process per host after ``jax.distributed.initialize``: meshes are built from the
global device list and host-local data is assembled into global arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod import trees
from jaxpod.errors import EndOfDataError, PeerHostError
from jaxpod.scope import strategy_scope
from jaxpod.types import InputContext, InputOptions, ReduceOp, ValueContext
from jaxpod.values import DistributedDataset, DistributedIterator, PerReplica, is_per_replica
from jaxpod.worker import input as input_lib
from jaxpod.worker.device_assignment import DeviceAssignment
from jaxpod.worker.infeed import Chunk, Infeed, InputWait
from jaxpod.worker.program_cache import ProgramCache
from jaxpod.worker.replica_context import (
    REPLICA_AXIS,
    ReplicaContext,
    normalize_axis,
    replica_context,
)

_NP_REDUCERS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.sum, ReduceOp.MEAN: np.mean, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max}


def fetch_global(array: jax.Array) -> np.ndarray:
    """A global array as numpy on this host (small values: outputs). Every host of a
    multi-host array takes part."""
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
_COMPILE_CACHE_SIZE = 256
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Inputs:
    """The arguments of one ``run`` call, split into distributed and mirrored leaves."""

    treedef: Any
    kinds: tuple[bool, ...]  # per leaf: True if distributed (PerReplica)
    distributed: tuple[jax.Array, ...]
    mirrored: tuple[Any, ...]
    batch_rows: int | None
    valid_rows: np.ndarray | None
    batch_leaves: tuple[bool, ...]  # per distributed leaf: rows of the batch?


@dataclass(frozen=True)
class _Program:
    """A compiled step and which of its outputs are rows of the step's batch.

    ``row_outputs`` (a pytree of bools shaped like the outputs) marks outputs whose
    leading per-replica dimension follows the batch size; ``None`` when the step has no
    batch input or the probe failed (then outputs as long as the batch count as rows).
    """

    call: Callable[..., Any]
    row_outputs: Any
    #: Input signatures every host has compiled this program for (several hosts only).
    agreed: set[Hashable] = dataclasses.field(default_factory=set)


class Engine:
    """Runs step functions on the replicas of one device assignment.

    Args:
      device_assignment: which devices form each replica; ``None`` uses every device
        this process sees, one device per replica.
      steps_per_run: default number of steps ``run_steps`` runs per call.
    """

    def __init__(self, device_assignment: DeviceAssignment | None = None,
                 steps_per_run: int = 1) -> None:
        if not isinstance(steps_per_run, int) or steps_per_run < 1:
            raise ValueError(f"steps_per_run must be a positive int. Got {steps_per_run!r}.")
        self.device_assignment = device_assignment or DeviceAssignment.build()
        self.steps_per_run = steps_per_run
        self.mesh = self.device_assignment.spmd_mesh
        self._replica_sharding = NamedSharding(self.mesh, P(REPLICA_AXIS))
        self._replicated = NamedSharding(self.mesh, P())
        per_host, self.host_index, self.local_replicas = _host_layout(
            self.device_assignment.replica_devices)
        self.num_hosts = len(per_host)
        self.host_replicas = input_lib.HostReplicas(
            self.local_replicas[0], len(self.local_replicas), self.num_replicas_in_sync,
            min(per_host))
        self._compiled = ProgramCache(_COMPILE_CACHE_SIZE)
        self._full_counts: dict[int, jax.Array] = {}
        #: The time this engine's iterators waited for their input (every infeed's).
        self.input_wait = InputWait()

    # ----------------------------------------------------------------- properties
    @property
    def num_replicas_in_sync(self) -> int:
        return self.device_assignment.num_replicas

    @property
    def _num_local_replicas(self) -> int:
        return len(self.local_replicas)

    @property
    def extended(self) -> EngineExtended:
        """What the hosts' operations read beyond TF's surface (:class:`EngineExtended`)."""
        return EngineExtended(self)

    # ------------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once per replica; returns its outputs as ``PerReplica`` values.

        ``PerReplica`` arguments give each replica its own component; arrays and Python
        numbers reach every replica unchanged. ``fn`` is traced (and compiled) once per
        input signature; exceptions it raises reach the caller unchanged.

        Returns:
          The structure ``fn`` returns, with every array leaf a ``PerReplica``.
        """
        inputs = self._split_inputs("run", args, kwargs)
        # The shapes and dtypes too: the program's row probe answers for them only.
        key = ("run", fn, inputs.treedef, inputs.kinds, inputs.batch_rows,
               _signature(inputs.distributed), _signature(inputs.mirrored))
        program = self._cached(key, lambda: self._compile_run(fn, inputs))
        outputs = self._dispatch(program, inputs.distributed, inputs.mirrored,
                                 self._counts(inputs.valid_rows, inputs.batch_rows))
        return self._wrap_outputs(outputs, inputs.batch_rows, inputs.valid_rows,
                                  program.row_outputs)

    def _compile_run(self, fn: Callable[..., Any], inputs: _Inputs) -> _Program:
        treedef, kinds = inputs.treedef, inputs.kinds

        def make_body(rows: int | None) -> Callable[..., Any]:
            def body(distributed: tuple[Any, ...], mirrored: tuple[Any, ...], counts: Any
                     ) -> Any:
                leaves = _merge(kinds, [d[0] for d in distributed], mirrored)
                call_args, call_kwargs = jax.tree.unflatten(treedef, leaves)
                with strategy_scope(self), replica_context(
                        self._replica_context(counts[0], rows)):
                    out = fn(*call_args, **call_kwargs)
                return _stack_outputs("run", out)
            return body

        def probe_args(rows: int) -> tuple[Any, ...]:
            distributed = tuple(
                _grown(d, 1, rows) if is_batch else jax.ShapeDtypeStruct(d.shape, d.dtype)
                for d, is_batch in zip(inputs.distributed, inputs.batch_leaves, strict=True))
            counts = jax.ShapeDtypeStruct((self.num_replicas_in_sync,), np.int32)
            return distributed, inputs.mirrored, counts

        return self._program(make_body, (P(REPLICA_AXIS), P(), P(REPLICA_AXIS)),
                             inputs.batch_rows, probe_args, lambda out: out)

    def _program(self, make_body: Callable[[int | None], Callable[..., Any]],
                 in_specs: tuple[Any, ...], rows: int | None,
                 probe_args: Callable[[int], tuple[Any, ...]],
                 outputs_of: Callable[[Any], Any]) -> _Program:
        """Compiles ``make_body(rows)`` and finds which outputs are batch rows.

        The probe traces the step abstractly (no compile) with one more row per
        replica: outputs whose leading dimension grows with it are rows of the batch,
        whatever their size happens to be.
        """
        call = self._spmd(make_body(rows), in_specs)
        if rows is None:
            return _Program(call, None)
        try:
            grown = jax.eval_shape(self._map(make_body(rows + 1), in_specs),
                                   *probe_args(rows + 1))
        except Exception:
            return _Program(call, None)
        flags = jax.tree.map(lambda s: len(s.shape) >= 2 and s.shape[1] == rows + 1,
                             outputs_of(grown))
        return _Program(call, flags)

    def _dispatch(self, program: _Program, *args: Any) -> Any:
        """Calls ``program``. On several hosts, the first call for an input signature
        first traces and compiles it here and has every host say whether it could: a
        step that fails to trace on some hosts only (one branching on
        ``jax.process_index()``) then fails on all of them, before any host enters a
        collective the others would never reach."""
        if self.num_hosts > 1:
            signature = tuple((np.shape(a), str(getattr(a, "dtype", type(a))),
                               getattr(a, "weak_type", None), getattr(a, "sharding", None))
                              for a in jax.tree.leaves(args))
            if signature not in program.agreed:
                self._agree(lambda: program.call.lower(*args).compile())  # type: ignore[attr-defined]
                program.agreed.add(signature)
        return program.call(*args)

    def _agree(self, compile_here: Callable[[], Any]) -> None:
        """Runs ``compile_here``; returns once every host's succeeded. Raises this
        host's error, or ``PeerHostError`` where only another host's failed."""
        error: BaseException | None = None
        try:
            compile_here()
        except Exception as e:
            error = e
        ok = self._allgather_host(np.array([error is None], np.int32))
        if error is not None:
            raise error
        if not ok.all():
            failed = [h for h, flag in enumerate(ok) if not flag]
            raise PeerHostError(
                f"The step function failed to trace or compile on host(s) {failed} (see "
                "their error) and ran on none: every host must trace it alike.")

    def _map(self, body: Callable[..., Any], in_specs: tuple[Any, ...]) -> Callable[..., Any]:
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                             out_specs=P(REPLICA_AXIS), axis_names={REPLICA_AXIS},
                             check_vma=False)

    def _spmd(self, body: Callable[..., Any], in_specs: tuple[Any, ...]) -> Callable[..., Any]:
        """``jit(shard_map(body))`` over the replica axis; other axes stay automatic.

        Per-replica inputs keep the sharding they come with: a value a previous program
        left split over a replica's logical devices goes in as it is, where declaring
        it split over replicas only would refuse it (jit does not reshard a committed
        array). jit compiles once per input sharding, so a loop that feeds its outputs
        back compiles at most twice."""
        shardings = tuple(None if s == P(REPLICA_AXIS) else NamedSharding(self.mesh, s)
                          for s in in_specs)
        return jax.jit(self._map(body, in_specs), in_shardings=shardings)

    def _replica_context(self, num_valid_rows: Any, batch_rows: int | None) -> ReplicaContext:
        return ReplicaContext(self.num_replicas_in_sync, lax.axis_index(REPLICA_AXIS),
                              num_valid_rows, batch_rows)

    def _cached(self, key: Hashable, build: Callable[[], _T]) -> _T:
        return self._compiled.get(key, build)

    def _split_inputs(self, what: str, args: Any, kwargs: Any) -> _Inputs:
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"{what}: args must be a tuple or list of positional arguments. Got "
                f"{type(args).__name__}. Pass one argument as args=(x,)."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"{what}: kwargs must be a dict or None. Got {type(kwargs).__name__}.")
        tree = (tuple(args), dict(kwargs or {}))
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_per_replica)
        kinds, distributed, mirrored, batch_leaves = [], [], [], []
        batch: tuple[int, np.ndarray] | None = None
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, PerReplica):
                if leaf.num_replicas != self.num_replicas_in_sync:
                    self._check_own(what, _leaf_path(tree, i), leaf)
                kinds.append(True)
                distributed.append(leaf.array)
                batch_leaves.append(leaf.valid_rows is not None)
                if leaf.valid_rows is not None:
                    this = (leaf.shape[0], leaf.valid_rows)
                    if not _same_batch(batch, this):
                        _mixed_batches(what, _leaf_path(tree, i), batch, this)
                    batch = this
            elif isinstance(leaf, _ARRAY_TYPES):
                kinds.append(False)
                mirrored.append(self._mirrored(leaf))
            else:
                raise TypeError(
                    f"{what}: argument {_leaf_path(tree, i)} is a {type(leaf).__name__}; "
                    "every leaf of args/kwargs must be an array (numpy or jax), a Python "
                    "number or a PerReplica value. Bind other configuration with "
                    "functools.partial."
                )
        rows, valid = batch if batch is not None else (None, None)
        return _Inputs(treedef, tuple(kinds), tuple(distributed), tuple(mirrored), rows, valid,
                       tuple(batch_leaves))

    def _check_own(self, what: str, where: str, value: PerReplica) -> None:
        if value.num_replicas != self.num_replicas_in_sync:
            raise ValueError(
                f"{what}: {where} is a PerReplica value of {value.num_replicas} replicas, but "
                f"this strategy has {self.num_replicas_in_sync}. Values cannot move between "
                "strategies of different sizes."
            )

    def _mirrored(self, leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            if leaf.sharding == self._replicated:
                return leaf
            if self.num_hosts == 1 or not leaf.is_fully_addressable:
                return jax.device_put(leaf, self._replicated)
            # Every host holds this value (a typed key made from a client's argument):
            # the global array is built from each host's copy.
            data, readable = _host_readable(leaf)
            return readable(self._mirrored(np.asarray(data)))
        if self.num_hosts > 1 and np.ndim(leaf):
            arr = np.asarray(leaf)
            return jax.make_array_from_callback(arr.shape, self._replicated, lambda i: arr[i])
        return leaf

    def _counts(self, valid_rows: np.ndarray | None, rows: int | None) -> Any:
        if valid_rows is not None and np.any(valid_rows != rows):
            return self._to_global(valid_rows[self._local_slice()].astype(np.int32))
        n = rows or 0
        if n not in self._full_counts:
            full = np.full(self._num_local_replicas, n, np.int32)
            self._full_counts[n] = self._to_global(full)
        return self._full_counts[n]

    def _wrap_outputs(self, outputs: Any, rows: int | None, valid: np.ndarray | None,
                      row_outputs: Any) -> Any:
        """``PerReplica`` outputs; rows of a padded batch keep the real row counts."""
        if valid is None or np.all(valid == rows):
            return jax.tree.map(PerReplica, outputs)
        if row_outputs is None:  # no probe: every output as long as the batch is rows
            row_outputs = jax.tree.map(lambda a: True, outputs)

        def wrap(a: jax.Array, follows_batch: bool) -> PerReplica:
            is_rows = follows_batch and a.ndim >= 2 and a.shape[1] == rows
            return PerReplica(a, valid if is_rows else None)

        return jax.tree.map(wrap, outputs, row_outputs)

    # ------------------------------------------------------------------ run_steps
    def run_steps(self, fn: Callable[..., Any], iterator: Iterator[Any], steps: int | None = None,
                  initial_state: Any = None) -> Any:
        """Runs up to ``steps`` steps of ``fn`` in one compiled on-device loop.

        Each step takes the next element of ``iterator``. With ``initial_state`` the step
        is ``fn(state, inputs) -> (state, outputs)`` and the state is carried on the
        devices from step to step; without it the step is ``fn(inputs) -> outputs``.
        At the end of the input the loop runs the steps that remain; a call with no
        input left raises ``jaxpod.EndOfDataError`` (a ``StopIteration``).

        Returns:
          The last step's outputs as ``PerReplica`` values, preceded by the final
          state (``(state, outputs)``) when ``initial_state`` is given.
        """
        k = self.steps_per_run if steps is None else steps
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"run_steps: steps must be a positive int. Got {steps!r}.")
        batch = self._next_steps(iterator, k)
        has_state = initial_state is not None
        state = self._split_inputs("run_steps", (initial_state,) if has_state else (), None)
        state_leaves = tuple(
            leaf if is_dist else self._broadcast(leaf)
            for leaf, is_dist in zip(_merge(state.kinds, state.distributed, state.mirrored),
                                     state.kinds, strict=True))
        key = ("run_steps", fn, has_state, state.treedef, batch.treedef, batch.num_steps,
               batch.rows, _signature(batch.arrays), _signature(state_leaves))
        program = self._cached(key, lambda: self._compile_steps(
            fn, has_state, state.treedef, batch, state_leaves))
        new_state, outputs = self._dispatch(program, state_leaves, batch.arrays, batch.counts)
        last_valid = batch.valid_rows[:, -1] if batch.valid_rows is not None else None
        outputs = self._wrap_outputs(outputs, batch.rows, last_valid, program.row_outputs)
        if not has_state:
            return outputs
        (final_state,), _ = jax.tree.unflatten(state.treedef, [PerReplica(s) for s in new_state])
        return final_state, outputs

    def _compile_steps(self, fn: Callable[..., Any], has_state: bool, state_treedef: Any,
                       batch: _StepBatch, state_leaves: tuple[Any, ...]) -> _Program:
        def probe_args(rows: int) -> tuple[Any, ...]:
            state = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state_leaves)
            arrays = [_grown(a, 2, rows) for a in batch.arrays]
            return state, arrays, jax.ShapeDtypeStruct(batch.counts.shape, np.int32)

        return self._program(lambda rows: self._steps_body(fn, has_state, state_treedef,
                                                           batch.treedef, rows),
                             (P(REPLICA_AXIS), P(REPLICA_AXIS), P(REPLICA_AXIS)),
                             batch.rows, probe_args, lambda out: out[1])

    def _steps_body(self, fn: Callable[..., Any], has_state: bool, state_treedef: Any,
                    batch_treedef: Any, rows: int | None) -> Callable[..., Any]:
        """The ``shard_map`` body of ``run_steps``: a ``lax.scan`` over the steps."""

        def step(state: Any, xs: tuple[list[Any], Any]) -> tuple[Any, Any]:
            leaves, n_valid = xs
            inputs = jax.tree.unflatten(batch_treedef, leaves)
            with strategy_scope(self), replica_context(self._replica_context(n_valid, rows)):
                if not has_state:
                    return state, fn(inputs)
                result = fn(state, inputs)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    "run_steps: with initial_state, fn(state, inputs) must return a pair "
                    f"(new_state, outputs). Got {type(result).__name__}."
                )
            return result

        def body(state_leaves: tuple[Any, ...], arrays: list[Any], counts: Any) -> Any:
            state = None
            if has_state:
                (state,), _ = jax.tree.unflatten(state_treedef, [s[0] for s in state_leaves])
            xs = ([a[0] for a in arrays], counts[0])
            first = jax.tree.map(lambda x: x[0], xs)
            # One trace of the step serves both the carry's shapes and the loop's body.
            traced, (new_state, out) = jax.make_jaxpr(step, return_shape=True)(state, first)
            _check_state(state, new_state)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)
            call, results = jax_core.jaxpr_as_fun(traced), jax.tree.structure((new_state, out))

            def loop_body(carry: tuple[Any, Any], x: Any) -> tuple[tuple[Any, Any], None]:
                new, out = jax.tree.unflatten(results, call(*jax.tree.leaves((carry[0], x))))
                return (new, out), None

            (state, out), _ = lax.scan(loop_body, (state, zeros), xs)
            state_out = tuple(s[None] for s in jax.tree.leaves(state))
            return state_out, _stack_outputs("run_steps", out)

        return body

    def _broadcast(self, leaf: Any) -> jax.Array:
        """A mirrored value as a per-replica one (each replica gets a copy)."""
        n = self.num_replicas_in_sync
        broadcast = self._cached(("broadcast",), lambda: jax.jit(
            lambda a: jnp.broadcast_to(a, (n, *a.shape)), out_shardings=self._replica_sharding))
        return broadcast(self._mirrored(leaf))

    def _next_steps(self, iterator: Iterator[Any], k: int) -> _StepBatch:
        if isinstance(iterator, LocalIterator):
            return iterator.next_steps(k)
        items = list(itertools.islice(iterator, k))
        if not items:
            raise EndOfDataError("run_steps: the iterator has no more input.")
        return self._stack_items(items)

    def _stack_items(self, items: list[Any]) -> _StepBatch:
        """Stacks ``PerReplica`` nests from any iterator into a step batch on device."""
        split = [self._split_inputs("run_steps", item, None) for item in
                 ((item,) for item in items)]
        first = split[0]
        for s in split:
            if s.treedef != first.treedef or not all(s.kinds):
                raise TypeError(
                    "run_steps: every element of the iterator must be the same structure of "
                    "PerReplica values (e.g. from a distributed dataset). Got "
                    f"{s.treedef} after {first.treedef}."
                )
        rows = first.batch_rows
        if any(s.batch_rows != rows for s in split):
            raise ValueError("run_steps: the iterator's elements differ in batch size.")
        stack = self._cached(("stack_steps",), lambda: jax.jit(
            lambda *xs: jnp.stack(xs, axis=1), out_shardings=self._replica_sharding))
        arrays = [stack(*column) for column in zip(*(s.distributed for s in split), strict=True)]
        full = np.full(self.num_replicas_in_sync, rows or 0, np.int32)
        counts = np.stack([full if s.valid_rows is None else s.valid_rows for s in split],
                          axis=1).astype(np.int32)
        valid = None if all(s.valid_rows is None for s in split) else counts
        treedef = jax.tree.structure(items[0], is_leaf=is_per_replica)
        return _StepBatch(treedef, arrays, self._to_global(counts[self._local_slice()]),
                          len(items), rows, valid)

    # ------------------------------------------------------ cross-replica results
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces across replicas (and along ``axis`` if given); numpy results.

        With ``axis`` the reduction also runs along that axis of each replica's value;
        ``MEAN`` then divides by the true number of elements, so padding rows of a
        partial last batch never count.
        """
        op = ReduceOp.from_value(reduce_op)
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise ValueError(f"reduce: axis must be an int or None. Got {axis!r}.")

        def leaf(v: Any) -> np.ndarray:
            if self._is_global_array(v):  # one value, no replicas: see ops.Reduce
                data = fetch_global(v)
                return data if axis is None else np.asarray(_NP_REDUCERS[op](data, axis=axis))
            return self._reduce_leaf(op, self._as_per_replica("reduce", v), axis)

        return jax.tree.map(leaf, value, is_leaf=is_per_replica)

    def _is_global_array(self, value: Any) -> bool:
        """Whether ``value`` is a global ``jax.Array`` (what ``strategy.spmd`` and a
        global-view job give): laid over a mesh of its own, not this strategy's
        replicas' (whose arrays are per-replica or mirrored values)."""
        return (isinstance(value, jax.Array)
                and isinstance(value.sharding, NamedSharding)
                and value.sharding.mesh != self.mesh)

    def _reduce_leaf(self, op: ReduceOp, value: PerReplica, axis: int | None) -> np.ndarray:
        array, valid = value.array, value.padding
        if axis is None:
            array = self._drop_equal_padding("reduce with axis=None", value)
            reducer = self._cached(("reduce", op, None), lambda: self._reducer(op, None))
            return self._fetch_replicated(reducer(array))
        ax = normalize_axis(axis, array.ndim - 1, "reduce")
        if valid is not None and ax == 0:
            reducer = self._cached(("reduce_rows", op), lambda: self._row_reducer(op))
            counts = jax.device_put(valid.astype(np.int32), self._replicated)
            return self._fetch_replicated(reducer(array, counts))
        array = self._drop_equal_padding(f"reduce with axis={axis}", value)
        reducer = self._cached(("reduce", op, ax), lambda: self._reducer(op, ax))
        return self._fetch_replicated(reducer(array))

    def _reducer(self, op: ReduceOp, axis: int | None) -> Callable[..., Any]:
        axes = (0,) if axis is None else (0, axis + 1)
        fns: dict[ReduceOp, Callable[..., Any]] = {
            ReduceOp.SUM: jnp.sum, ReduceOp.MEAN: jnp.mean, ReduceOp.MIN: jnp.min,
            ReduceOp.MAX: jnp.max}
        return jax.jit(functools.partial(fns[op], axis=axes), out_shardings=self._replicated)

    def _row_reducer(self, op: ReduceOp) -> Callable[..., Any]:
        def reduce_rows(x: jax.Array, counts: jax.Array) -> jax.Array:
            mask = jnp.arange(x.shape[1])[None, :] < counts[:, None]
            mask = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
            if op in (ReduceOp.SUM, ReduceOp.MEAN):
                total = jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), axis=(0, 1))
                if op is ReduceOp.SUM:
                    return total
                return total / jnp.sum(counts)
            identity = _extreme_identity(x.dtype, op is ReduceOp.MAX)
            masked = jnp.where(mask, x, identity)
            return jnp.max(masked, axis=(0, 1)) if op is ReduceOp.MAX else jnp.min(
                masked, axis=(0, 1))

        return jax.jit(reduce_rows, out_shardings=self._replicated)

    def _drop_equal_padding(self, what: str, value: PerReplica) -> jax.Array:
        """Per-replica values without padding rows, if every replica has as many."""
        valid = value.padding
        if valid is None:
            return value.array
        if np.all(valid == valid[0]):
            n = int(valid[0])
            return self._cached(("rows", n), lambda: jax.jit(
                lambda x: x[:, :n], out_shardings=self._replica_sharding))(value.array)
        raise ValueError(
            f"{what}: the value holds rows of a partial batch and its replicas have "
            f"different numbers of real rows ({valid.tolist()}), so they cannot be combined "
            "elementwise. Reduce along the batch axis instead (axis=0)."
        )

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along ``axis``; padding rows are dropped."""
        def leaf(v: Any) -> np.ndarray:
            if self._is_global_array(v):
                raise TypeError(
                    f"gather: got a global array of shape {tuple(v.shape)} (a result of "
                    "strategy.spmd or a global-view job): it has no replicas to gather. "
                    "np.asarray(value) gives it whole.")
            return self._gather_leaf(self._as_per_replica("gather", v), axis)

        return jax.tree.map(leaf, value, is_leaf=is_per_replica)

    def _gather_parts(self, value: PerReplica, axis: int, replicas: Sequence[int] | None = None,
                     views: bool = False, padded: bool = False
                     ) -> tuple[int, list[np.ndarray]]:
        """This host's share of ``gather``: the normalized axis and its replicas' parts.

        A multi-host caller concatenates every host's parts in replica order, so no
        single host holds the whole result.

        Args:
          replicas: only these replicas' parts (those held here), so a caller can
            fetch a large result one part at a time.
          views: a part held whole by one device may be a read-only view of its
            memory (no copy; valid while ``value`` lives), for a caller that copies
            the parts at once.
          padded: each replica's whole component, padding rows included (``axis`` 0:
            the parts of ``value.array``).
        """
        value = self._as_per_replica("gather", value)
        ax = normalize_axis(axis, len(value.shape), "gather")
        if padded:
            return ax, self._local_leaf(value, padded=True, replicas=replicas, views=views)
        valid = value.padding
        if valid is not None and ax != 0 and not np.all(valid == valid[0]):
            self._drop_equal_padding(f"gather with axis={axis}", value)  # raises
        return ax, self._local_leaf(value, replicas=replicas, views=views)

    def _gather_leaf(self, value: PerReplica, axis: int) -> np.ndarray:
        ax = normalize_axis(axis, len(value.shape), "gather")
        valid = value.padding
        if valid is not None and ax != 0:
            array = self._drop_equal_padding(f"gather with axis={axis}", value)
            valid = None
        else:
            array = value.array
        array, readable = _host_readable(array)
        host = self._fetch_all(array)
        parts = [host[r] if valid is None else host[r, :valid[r]] for r in range(len(host))]
        return readable(np.concatenate(parts, axis=ax))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This host's replicas' values as a tuple (numpy), padding rows dropped."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        if not any(isinstance(v, PerReplica) for v in leaves):
            return (value,)  # a single value (TF: "this returns (value,)")
        per_leaf = [self._local_leaf(self._as_per_replica("experimental_local_results", v))
                    for v in leaves]
        return tuple(jax.tree.unflatten(treedef, [p[i] for p in per_leaf])
                     for i in range(self._num_local_replicas))

    def _replica_value(self, value: Any, replica: int) -> Any | None:
        """Replica ``replica``'s component of every ``PerReplica`` leaf of ``value``
        (numpy, padding dropped; other leaves as they are), or ``None`` when this host
        does not hold that replica: one copy of mirrored state, not one per replica."""
        if replica not in self.local_replicas:
            return None
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        return jax.tree.unflatten(treedef, [
            self._local_leaf(self._as_per_replica("replica_value", v), replicas=(replica,))[0]
            if isinstance(v, PerReplica) else v for v in leaves])

    def _local_leaf(self, value: PerReplica, padded: bool = False,
                    replicas: Sequence[int] | None = None, views: bool = False
                    ) -> list[np.ndarray]:
        """This host's replicas' components (of ``replicas`` only, if given), assembled
        from their devices' shards (with ``views``, a component one shard holds whole
        is that shard's host view, not a copy)."""
        wanted = [r for r in self.local_replicas if replicas is None or r in replicas]
        array, readable = _host_readable(value.array)
        shape = tuple(array.shape[1:])  # a key's data has one more axis than the key
        local: dict[int, np.ndarray] = {}
        for shard in array.addressable_shards:
            replica = shard.index[0].start or 0
            if replica not in wanted:
                continue
            data = np.asarray(shard.data)[0]
            if views and data.shape == shape:
                local[replica] = data  # one device holds the whole component
            else:  # a replica split over logical devices has several shards
                local.setdefault(replica, np.empty(shape, array.dtype))[
                    shard.index[1:]] = data
        valid = None if padded else value.padding
        return [readable(local[r] if valid is None else local[r][:valid[r]]) for r in wanted]

    def _padded_parts(self, value: PerReplica) -> list[np.ndarray]:
        """This host's replicas' components with their padding rows (``value.array``'s
        share of this host), for a caller that stacks every host's parts."""
        return self._local_leaf(self._as_per_replica("fetch", value), padded=True)

    def _as_per_replica(self, what: str, value: Any) -> PerReplica:
        if isinstance(value, PerReplica):
            self._check_own(what, "value", value)
            return value
        if isinstance(value, _ARRAY_TYPES):  # a mirrored value: every replica holds it
            return PerReplica(self._broadcast(value))
        raise TypeError(
            f"{what}: expected a PerReplica value (an output of strategy.run) or an array, "
            f"got {type(value).__name__}."
        )

    # -------------------------------------------------------- distributing values
    def experimental_distribute_values_from_function(
            self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls ``value_fn(ValueContext)`` for each local replica; returns PerReplica.

        Every replica's value must have one structure, shapes and dtypes. A host sees
        only its own replicas' values, so on several hosts they first compare
        descriptions of them (every host takes part even when ``value_fn`` failed on
        it), and a mismatch raises the same error on every host instead of leaving
        each with a global array of its own idea of the shape.
        """
        try:
            per_replica = [value_fn(ValueContext(r, self.num_replicas_in_sync))
                           for r in self.local_replicas]
            treedef, columns = _value_columns(per_replica, self.local_replicas)
        except Exception:
            if self.num_hosts > 1:
                self._allgather_json(None)  # the others must not wait for this host
            raise
        described = _describe_values(treedef, columns, self.local_replicas)
        if self.num_hosts > 1:
            per_host = self._allgather_json(described)
            failed = [h for h, d in enumerate(per_host) if d is None]
            if failed:
                raise PeerHostError(
                    "experimental_distribute_values_from_function: value_fn failed on "
                    f"host(s) {failed}; see their error. No value was distributed."
                )
            described = [_as_description(d) for host in per_host for d in host]
        _check_same_values(described)
        arrays = [self._to_global(np.stack(col)) for col in columns]
        return jax.tree.unflatten(treedef, [PerReplica(a) for a in arrays])

    def experimental_distribute_dataset(self, dataset: Iterable[Any],
                                        options: InputOptions | None = None) -> LocalDataset:
        """Rebatches a globally batched dataset across replicas (TF's rules).

        Each step takes one global batch split over all replicas of all hosts, so
        the result does not depend on how many hosts the replicas sit on; each host
        reads the whole dataset and keeps its own replicas' rows.
        """
        opts = _check_options(options)
        if not isinstance(dataset, Iterable):
            raise TypeError(
                "experimental_distribute_dataset: dataset must be an iterable of batches "
                f"(pytrees of arrays). Got {type(dataset).__name__}."
            )
        return LocalDataset(self, lambda: input_lib.RebatchFeed(
            dataset, opts, self.host_replicas))

    def distribute_datasets_from_function(
            self, dataset_fn: Callable[[InputContext], Iterable[Any]],
            options: InputOptions | None = None) -> LocalDataset:
        """Calls ``dataset_fn(InputContext)`` once per host; one element per replica/step."""
        _check_options(options)
        if not callable(dataset_fn):
            raise TypeError(
                "distribute_datasets_from_function: dataset_fn must be a callable taking a "
                f"jaxpod.InputContext. Got {type(dataset_fn).__name__}."
            )
        context = InputContext(self.num_hosts, self.host_index, self.num_replicas_in_sync)
        dataset = dataset_fn(context)  # once per host, as TF does; each epoch iterates it
        if not isinstance(dataset, Iterable):
            raise TypeError(
                "distribute_datasets_from_function: dataset_fn must return an iterable of "
                f"per-replica batches. It returned a {type(dataset).__name__}."
            )
        return LocalDataset(self, lambda: input_lib.FunctionFeed(
            dataset, self._num_local_replicas))

    # ------------------------------------------------------------ logical devices
    def experimental_split_to_logical_devices(self, tensor: Any,
                                              partition_dimensions: Sequence[int]) -> Any:
        """Annotates ``tensor`` to be split across this replica's logical devices."""
        sharding = self.device_assignment.split_sharding(tuple(jnp.shape(tensor)),
                                                         partition_dimensions)
        return self._constrain(tensor, sharding)

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        """Annotates ``tensor`` to be replicated to all logical devices of the replica."""
        return self._constrain(tensor, self.device_assignment.replicated_sharding())

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        """Annotates ``tensor`` for logical device ``logical_device_id``.

        XLA's SPMD partitioner has no single-device placement inside a partitioned
        program, so the value is kept whole (replicated), which gives identical results.
        """
        self.device_assignment.check_logical_device(logical_device_id)
        return self._constrain(tensor, self.device_assignment.replicated_sharding())

    def _constrain(self, tensor: Any, sharding: NamedSharding) -> Any:
        if self.device_assignment.num_cores_per_replica == 1:
            return tensor
        return lax.with_sharding_constraint(tensor, sharding)

    # ---------------------------------------------------------------------- scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Engine]:
        """Makes this the current strategy and enters the cross-replica context."""
        with strategy_scope(self):
            yield self

    # -------------------------------------------------- host-local <-> global data
    def _local_slice(self) -> slice:
        return slice(self.local_replicas[0], self.local_replicas[-1] + 1)

    def _to_global(self, local: np.ndarray) -> jax.Array:
        """Assembles this host's replicas' rows (leading axis) into a global array."""
        if self.num_hosts == 1:
            # A copy XLA owns: a CPU buffer aliasing the numpy rows would give them back
            # from XLA's threads, taking the GIL, which aborts the process at exit.
            return jax.device_put(local, self._replica_sharding, may_alias=False)
        global_shape = (self.num_replicas_in_sync, *local.shape[1:])
        return jax.make_array_from_process_local_data(self._replica_sharding, local,
                                                      global_shape)

    def _fetch_all(self, array: jax.Array) -> np.ndarray:
        """Every replica's component on this host, as numpy."""
        if array.is_fully_addressable:
            return np.asarray(array)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def _fetch_replicated(self, array: jax.Array) -> np.ndarray:
        return np.asarray(array.addressable_data(0))

    def _allgather_json(self, value: Any) -> list[Any]:
        """Every host's ``value`` (small, JSON-serializable), in host order."""
        if self.num_hosts == 1:
            return [value]
        data = np.frombuffer(json.dumps(value).encode(), np.uint8)
        sizes = self._allgather_host(np.array([data.size], np.int32))
        # Hosts' texts differ in length; padded to a power of two, so the gather's
        # program is compiled again only when the longest text doubles.
        padded = np.zeros(1 << max(6, int(sizes.max() - 1).bit_length()), np.uint8)
        padded[:data.size] = data
        texts = np.asarray(multihost_utils.process_allgather(padded, tiled=False))
        return [json.loads(texts[h, :n].tobytes()) for h, n in enumerate(sizes)]

    def _allgather_host(self, local: np.ndarray) -> np.ndarray:
        """Concatenates a small host-local array over hosts, in replica order."""
        if self.num_hosts == 1:
            return local
        return np.asarray(multihost_utils.process_allgather(local, tiled=True))


class EngineExtended:
    """What the hosts' operations and the coordinator read of an engine beyond TF's
    strategy surface (``strategy.extended`` in-process, as TF keeps such machinery
    behind ``extended``): a gather's parts, padded components, one replica's value, a
    loop's stacked steps, and small all-host gathers.

    Args:
      engine: the engine it reads.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def num_local_replicas(self) -> int:
        """The replicas on this host's devices."""
        return self._engine._num_local_replicas

    def gather_parts(self, value: PerReplica, axis: int, replicas: Sequence[int] | None = None,
                     views: bool = False, padded: bool = False
                     ) -> tuple[int, list[np.ndarray]]:
        """This host's share of ``gather`` (see :meth:`Engine._gather_parts`)."""
        return self._engine._gather_parts(value, axis, replicas, views=views, padded=padded)

    def padded_parts(self, value: PerReplica) -> list[np.ndarray]:
        """This host's replicas' components with their padding rows."""
        return self._engine._padded_parts(value)

    def replica_value(self, value: Any, replica: int) -> Any | None:
        """Replica ``replica``'s component of ``value``'s leaves, or ``None`` when this
        host does not hold that replica."""
        return self._engine._replica_value(value, replica)

    def next_steps(self, iterator: Iterator[Any], k: int) -> _StepBatch:
        """The next ``k`` steps of ``iterator`` stacked on the devices (a loop's input)."""
        return self._engine._next_steps(iterator, k)

    def allgather_json(self, value: Any) -> list[Any]:
        """Every host's ``value`` (small, JSON-serializable), in host order."""
        return self._engine._allgather_json(value)

    def allgather_host(self, local: np.ndarray) -> np.ndarray:
        """Concatenates a small host-local array over hosts, in replica order."""
        return self._engine._allgather_host(local)


def _host_readable(array: jax.Array) -> tuple[jax.Array, Callable[[Any], Any]]:
    """``array`` in a form numpy can read, and what turns such host data back: typed PRNG
    keys are read as their key data and wrapped again."""
    if not trees.is_typed_key(array):
        return array, lambda host: host
    impl = str(jax.random.key_impl(array))
    return jax.random.key_data(array), lambda host: jax.random.wrap_key_data(host, impl=impl)


def _signature(leaves: Sequence[Any]) -> tuple[tuple[tuple[int, ...], str], ...]:
    """Each leaf's shape and dtype (a Python number's type), for a program cache key."""
    return tuple((tuple(getattr(x, "shape", ())),
                  trees.dtype_name(getattr(x, "dtype", type(x).__name__))) for x in leaves)


@dataclass(frozen=True)
class _StepBatch:
    """``num_steps`` steps of input: arrays ``(replicas, steps, rows, ...)`` on device,
    and their real rows ``counts`` ``(replicas, steps)``; without the ``steps`` axis
    when taken ``stepless`` (one step, for ``next``)."""

    treedef: Any
    arrays: list[jax.Array]
    counts: jax.Array
    num_steps: int
    rows: int | None
    valid_rows: np.ndarray | None  # (replicas, steps) real rows; None: not a batch


class LocalDataset(DistributedDataset):
    """A dataset distributed over this process's engine; iterate it once per epoch."""

    def __init__(self, engine: Engine, make_feed: Callable[[], input_lib.HostFeed]) -> None:
        self._engine = engine
        self._make_feed = make_feed

    def __iter__(self) -> LocalIterator:
        return self.iterate()

    def iterate(self, steps_per_run: int | None = None) -> LocalIterator:
        """An iterator whose infeed prepares ``steps_per_run`` steps at a time (default:
        the strategy's)."""
        return LocalIterator(self._engine, self._make_feed(), steps_per_run)


class LocalIterator(DistributedIterator):
    """Yields one step of input per ``next``: a nest of ``PerReplica`` batches.

    Input is prepared ahead on an infeed thread (see :mod:`jaxpod.worker.infeed`) in
    chunks of ``steps_per_run`` steps, then of as many as the last request asked for.
    """

    def __init__(self, engine: Engine, feed: input_lib.HostFeed,
                 steps_per_run: int | None = None) -> None:
        self._engine = engine
        self._infeed = Infeed(feed, engine._to_global, engine._num_local_replicas,
                              steps_per_run or engine.steps_per_run,
                              waits=engine.input_wait)
        weakref.finalize(self, self._infeed.close)
        self._leftover: Chunk | None = None
        #: Why this iterator cannot go on (its dataset raised here or on another host):
        #: every later ``next`` raises it again, on every host, without a collective.
        self._failure: BaseException | None = None
        self._next_start: Any = None  # where the step after the last one taken starts

    def __iter__(self) -> LocalIterator:
        return self

    @property
    def prefetched(self) -> int:
        """Chunks of steps its infeed has placed on the devices, ready to take (those
        read ahead into host memory only are not counted)."""
        return self._infeed.depth

    @property
    def position(self) -> dict[str, Any] | None:
        """Where this host's input is, for a checkpoint (see
        :attr:`jaxpod.jobs.Epochs.start`): the position the step after the last one
        taken starts at (the infeed reads ahead, so the dataset's own position is further
        on) and the batch size the feed keeps. ``None`` before the first step, or when the dataset
        does not tell (:class:`jaxpod.jobs.Epochs` does)."""
        if self._next_start is None:
            return None
        return {"at": self._next_start, **self._infeed.feed.batch_of_record()}

    def __next__(self) -> Any:
        batch = self.next_steps(1, stepless=True)
        assert batch.valid_rows is not None
        valid = batch.valid_rows[:, 0]  # one array for all: a step's leaves share it
        leaves = [PerReplica(a, valid) for a in batch.arrays]
        return jax.tree.unflatten(batch.treedef, leaves)

    def full_steps_ahead(self) -> int:
        """Steps this host has ready, in order, before the first that is not full (a
        replica short of rows), the input's end or its error: if every host has ``c``,
        the next ``c`` steps are full everywhere, so a client can take them without
        waiting to hear whether the input ended."""
        if self._failure is not None:
            return 0
        ready = self._infeed.ready_chunks()
        count = 0
        for chunk in ([self._leftover] if self._leftover is not None else []) + ready:
            count += chunk.full_steps
            if chunk.full_steps < chunk.num_steps:
                break
        return count

    def next_steps(self, k: int, stepless: bool = False) -> _StepBatch:
        """Up to ``k`` steps of input, stacked; hosts agree on how many remain. With
        ``stepless`` (``next``: ``k`` is 1), the arrays and counts have no steps axis,
        and the infeed places later steps that way.

        Raises:
          EndOfDataError: no host has input left.
        """
        eng, infeed = self._engine, self._infeed
        infeed.set_stepless(stepless)
        if self._failure is not None:
            raise self._failure
        try:
            chunk = self._local_chunk(infeed, k)
        except Exception as e:
            self._failure = e
            if eng.num_hosts > 1:  # the others must not wait for this host's counts
                eng._allgather_host(np.full((eng._num_local_replicas, k), -1, np.int32))
            raise
        if chunk is None and eng.num_hosts == 1:
            raise EndOfDataError("The distributed dataset has no more input.")
        # A host whose input ended still takes part: it may be the only one.
        local = (chunk.counts if chunk is not None
                 else np.zeros((eng._num_local_replicas, k), np.int32))
        counts = eng._allgather_host(local)
        if (counts < 0).any():
            self._failure = PeerHostError(
                "The distributed dataset raised on another host of the slice (see that "
                "host's error); this iterator cannot go on. Create a new one.")
            raise self._failure
        n = int(np.count_nonzero(counts.any(axis=0)))
        if n == 0:  # before empty_chunk: an empty dataset has no element spec
            raise EndOfDataError("The distributed dataset has no more input.")
        if chunk is None:
            chunk = infeed.empty_chunk(k)
        if chunk.stepless != stepless:  # placed before next and run_steps took turns
            # Again from the host's copy: a program on the devices would have to run
            # on every host, and another host may have placed its chunk the other way.
            chunk = infeed.place(chunk.host, chunk.counts, chunk.last, chunk.positions)
        placed = chunk.placed
        # Only input already on the devices goes to a step: a step on XLA's CPU devices
        # that read input still being copied there hung in its all-reduce (7 of 8
        # devices arrived). The infeed placed it ahead, so this seldom waits.
        jax.block_until_ready(placed)
        if n < k:  # the input ended inside this chunk
            cut = eng._cached(("first_steps", n), lambda: jax.jit(
                lambda x: x[:, :n], out_shardings=eng._replica_sharding))
            placed = [cut(a) for a in placed]
        taken = chunk.positions[:n]
        if taken and taken[-1] is not None:
            self._next_start = taken[-1]
        return _StepBatch(infeed.spec.treedef, placed[:-1], placed[-1], n, infeed.rows,
                          counts[:, :n])

    def _local_chunk(self, infeed: Infeed, k: int) -> Chunk | None:
        """This host's next ``k`` steps (padded with empty steps at the end)."""
        first = self._leftover
        self._leftover = None
        if first is None:
            first = infeed.get()
            if first is None:
                return None
            if first.num_steps == k:
                return first
            infeed.set_steps(k)
        chunk, self._leftover = infeed.rechunk(first, k)
        return chunk


# ------------------------------------------------------------------------ helpers
def _grown(array: Any, axis: int, rows: int) -> jax.ShapeDtypeStruct:
    """The abstract value of ``array`` with ``rows`` rows along ``axis``."""
    shape = list(array.shape)
    shape[axis] = rows
    return jax.ShapeDtypeStruct(tuple(shape), array.dtype)


def _merge(kinds: Sequence[bool], distributed: Sequence[Any], mirrored: Sequence[Any]
           ) -> list[Any]:
    d, m = iter(distributed), iter(mirrored)
    return [next(d) if k else next(m) for k in kinds]


def _stack_outputs(what: str, out: Any) -> Any:
    """Gives every output leaf the leading replica axis of the ``shard_map`` output."""

    def leaf(path: Any, x: Any) -> jax.Array:
        if not isinstance(x, _ARRAY_TYPES) and not hasattr(x, "shape"):
            raise TypeError(
                f"{what}: fn returned a {type(x).__name__} at {_arg_path(path, 'output')}; "
                "step functions must return arrays, numbers or pytrees of them."
            )
        return jnp.asarray(x)[None]

    return jax.tree_util.tree_map_with_path(leaf, out)


def _arg_path(path: Any, root: str = "args") -> str:
    """``(args, kwargs)`` tree paths as ``args[0]['w']`` / ``kwargs['lr']``."""
    text = jax.tree_util.keystr(path)
    if root != "args":
        return root + text
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        return "kwargs" + text[3:]
    return text


def _leaf_path(tree: Any, index: int) -> str:
    """The path of ``tree``'s leaf ``index`` as ``args[0]['w']``, for a message: built
    only on error, since paths cost microseconds per leaf on every call."""
    path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_per_replica)[0][index]
    return _arg_path(path)


def _same_batch(batch: tuple[int, np.ndarray] | None, this: tuple[int, np.ndarray]) -> bool:
    return batch is None or (batch[0] == this[0] and (
        batch[1] is this[1] or np.array_equal(batch[1], this[1])))


def _mixed_batches(what: str, where: str, batch: Any, this: tuple[int, np.ndarray]
                   ) -> NoReturn:
    raise ValueError(
        f"{what}: {where} comes from a different partial batch (real rows per replica "
        f"{this[1].tolist()} of {this[0]}) than another argument ({batch[1].tolist()} of "
        f"{batch[0]}); the valid-row mask would be ambiguous. Pass inputs of one step together."
    )


#: A replica's value as hosts compare it: replica, structure, (dtype, shape) per leaf.
_Description = tuple[int, str, list[tuple[str, tuple[int, ...]]]]


def _value_columns(per_replica: list[Any], replicas: Sequence[int]
                   ) -> tuple[Any, list[list[np.ndarray]]]:
    """The values' common structure and, per leaf, every replica's array.

    Raises:
      ValueError: replicas returned different structures.
      TypeError: a leaf is not an array or a number.
    """
    leaves0, treedef = jax.tree.flatten(per_replica[0])
    columns: list[list[np.ndarray]] = [[] for _ in leaves0]
    for r, v in zip(replicas, per_replica, strict=True):
        leaves, td = jax.tree.flatten(v)
        if td != cast(Any, treedef):
            _raise_different_structures(replicas[0], str(treedef), r, str(td))
        for col, leaf in zip(columns, leaves, strict=True):
            if not isinstance(leaf, _ARRAY_TYPES):
                raise TypeError(
                    "experimental_distribute_values_from_function: value_fn must return "
                    f"arrays or numbers; replica {r} returned a {type(leaf).__name__}."
                )
            col.append(np.asarray(leaf))
    return treedef, columns


def _describe_values(treedef: Any, columns: list[list[np.ndarray]], replicas: Sequence[int]
                     ) -> list[_Description]:
    return [(r, str(treedef), [(str(col[i].dtype), col[i].shape) for col in columns])
            for i, r in enumerate(replicas)]


def _as_description(raw: list[Any]) -> _Description:
    """A description back from JSON (which made its tuples lists)."""
    r, treedef, leaves = raw
    return int(r), str(treedef), [(str(d), tuple(int(n) for n in s)) for d, s in leaves]


def _check_same_values(described: list[_Description]) -> None:
    """Raises if the replicas' values differ in structure, shape or dtype."""
    first, treedef, leaves0 = described[0]
    for r, td, _ in described[1:]:
        if td != treedef:
            _raise_different_structures(first, treedef, r, td)
    for i in range(len(leaves0)):
        if len({leaves[i] for _, _, leaves in described}) > 1:
            got = ", ".join(f"replica {r}: {leaves[i][0]}{list(leaves[i][1])}"
                            for r, _, leaves in described)
            raise ValueError(
                "Per-replica values must have the same shape and dtype on every replica; "
                f"got {got}. Pad them to a common shape."
            )


def _raise_different_structures(first: int, treedef: str, r: int, td: str) -> None:
    raise ValueError(
        "experimental_distribute_values_from_function: replicas returned different "
        f"structures: replica {first} gave {treedef}, replica {r} gave {td}."
    )


def _check_options(options: InputOptions | None) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be a jaxpod.InputOptions or None. Got {options!r}.")
    return options


def _check_state(before: Any, after: Any) -> None:
    want = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), before)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), after)
    if want != got:
        raise TypeError(
            "run_steps: fn must return a new state with the structure, shapes and dtypes of "
            f"the state it was given. Given {want}, returned {got}."
        )


def _extreme_identity(dtype: Any, is_max: bool) -> Any:
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf if is_max else jnp.inf, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.array(info.min if is_max else info.max, dtype)
    return jnp.array(not is_max, dtype)


def _host_layout(replica_devices: np.ndarray) -> tuple[list[int], int, tuple[int, ...]]:
    """(replicas of each host, this host's index, this host's replicas) of an assignment.

    Hosts are the processes that own replicas, in replica order; each replica must sit
    on one host and each host's replicas must be contiguous and in process order.
    """
    owners = []
    for r, devices in enumerate(replica_devices):
        procs = {d.process_index for d in devices}
        if len(procs) != 1:
            raise ValueError(
                f"Replica {r} spans processes {sorted(procs)}; every replica's logical "
                "devices must belong to one host. Use a computation_shape within a host."
            )
        owners.append(procs.pop())
    hosts = sorted(set(owners))
    if owners != sorted(owners):
        raise ValueError(
            f"Replicas must be ordered by host (process index); got owners {owners}."
        )
    me = jax.process_index()
    local = tuple(r for r, p in enumerate(owners) if p == me)
    if not local:
        raise ValueError(f"Process {me} owns no replica of this device assignment.")
    return [owners.count(h) for h in hosts], hosts.index(me), local
