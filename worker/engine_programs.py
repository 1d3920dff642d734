"""Step programs: ``run`` and ``run_steps`` compiled over the replicas.

``run`` compiles the user's step function once per input signature as
``jax.jit(shard_map(...))`` over the mesh's replica axis; ``run_steps`` runs several
steps in one such program, a ``lax.scan`` over a loop's stacked input. Here too: how
arguments split into per-replica and mirrored values, which outputs are rows of a
partial batch, and, on several hosts, agreeing that every host could compile a step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod import trees
from jaxpod.errors import EndOfDataError, PeerHostError
from jaxpod.scope import strategy_scope
from jaxpod.values import PerReplica, is_per_replica
from jaxpod.worker.engine_core import ARRAY_TYPES, EngineCore
from jaxpod.worker.engine_input import LocalIterator, StepBatch
from jaxpod.worker.replica_context import REPLICA_AXIS, ReplicaContext, replica_context


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


class StepPrograms(EngineCore):
    """The engine's ``run`` and ``run_steps`` (a part of
    :class:`~jaxpod.worker.engine.Engine`)."""

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
            elif isinstance(leaf, ARRAY_TYPES):
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
                       batch: StepBatch, state_leaves: tuple[Any, ...]) -> _Program:
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
    def _next_steps(self, iterator: Iterator[Any], k: int) -> StepBatch:
        if isinstance(iterator, LocalIterator):
            return iterator.next_steps(k)
        items = list(itertools.islice(iterator, k))
        if not items:
            raise EndOfDataError("run_steps: the iterator has no more input.")
        return self._stack_items(items)

    def _stack_items(self, items: list[Any]) -> StepBatch:
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
        return StepBatch(treedef, arrays, self._to_global(counts[self._local_slice()]),
                         len(items), rows, valid)


# ------------------------------------------------------------------------ helpers
def _signature(leaves: Sequence[Any]) -> tuple[tuple[tuple[int, ...], str], ...]:
    """Each leaf's shape and dtype (a Python number's type), for a program cache key."""
    return tuple((tuple(getattr(x, "shape", ())),
                  trees.dtype_name(getattr(x, "dtype", type(x).__name__))) for x in leaves)


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
        if not isinstance(x, ARRAY_TYPES) and not hasattr(x, "shape"):
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


def _check_state(before: Any, after: Any) -> None:
    want = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), before)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), after)
    if want != got:
        raise TypeError(
            "run_steps: fn must return a new state with the structure, shapes and dtypes of "
            f"the state it was given. Given {want}, returned {got}."
        )
