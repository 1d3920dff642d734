"""What each strategy method's request asks of a held slice's ``GroupEngine``.

:class:`EngineCalls` (a mixin of ``CoordinatorService``) turns a request's trees into
the slice's values (:meth:`~EngineCalls._args`) and new values into ``ValueRef`` trees
(:meth:`~EngineCalls._refs`), and keeps the tables the operation stream and the result
RPCs look operations up in: the value-making calls (``run``, ``run_steps``,
``distribute_values``, ``next``), the small results computed by one operation, and the
results computed on the coordinator (whole, or in blocks to stream).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax

from jaxpod import operations as ops
from jaxpod.errors import HandleError
from jaxpod.operations import HandleInfo, StepItems
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.service.api.ahead import AheadCall
from jaxpod.service.sessions import Session
from jaxpod.service.slices.group_handles import GroupValue, is_group_value
from jaxpod.service.slices.group_results import GatherParts, ResultCall
from jaxpod.service.slices.held import HeldSlice
from jaxpod.types import ReduceOp


class EngineCalls:
    """The strategy methods' requests as engine calls on the slice they name."""

    def _args(self, session: Session, held: HeldSlice, tree: pb.Tree,
              uses: set[int] | None = None) -> Any:
        """The values a request's tree stands for (``uses`` gets the value ids)."""
        def leaf(node: pb.Tree) -> Any:
            kind = node.WhichOneof("node")
            if kind == "blob":
                return session.blob(node.blob)
            if kind == "value":
                if node.value.slice_id != held.id:
                    raise HandleError(
                        f"Value #{node.value.id} lives on slice {node.value.slice_id}, not on "
                        f"this strategy's slice {held.id}; values cannot move between "
                        "strategies. Gather it and pass the array instead.")
                if uses is not None:
                    uses.add(node.value.id)
                return held.value(node.value.id)
            raise ValueError(f"A {kind} node cannot be an argument.")

        return tensors.decode(tree, leaf)

    def _refs(self, held: HeldSlice, result: Any, op: int) -> tuple[pb.Tree, dict[int, Any]]:
        """The new values (``GroupValue``s, or their ``HandleInfo``s) as ValueRefs,
        numbered for operation ``op`` (``SliceOp``), and the values by those ids (not
        yet kept)."""
        made: dict[int, Any] = {}

        def leaf(x: Any, path: str) -> Any:
            if isinstance(x, GroupValue | HandleInfo):
                info = x.info if isinstance(x, GroupValue) else x
                value_id = ops.output_id(op, len(made))
                made[value_id] = x
                valid = info.valid_rows
                return pb.Tree(value=pb.ValueRef(
                    id=value_id, slice_id=held.id, shape=info.shape, dtype=info.dtype,
                    has_valid_rows=valid is not None, valid_rows=valid or (),
                    global_view=info.global_view))
            return tensors.NOT_HANDLED

        return tensors.encode(result, leaf, "result"), made


    # Value-making operations, as sent: ahead of the replies before them when predicted.
    def _run_call(self, session: Session, held: HeldSlice, request: pb.RunRequest,
                   uses: set[int]) -> AheadCall:
        args = self._args(session, held, request.args, uses)
        kwargs = self._args(session, held, request.kwargs, uses)
        if request.mesh_axes:  # strategy.spmd
            mesh = list(zip(request.mesh_axes, request.mesh_shape, strict=True))
            return AheadCall(held.engine.run_spmd_op(
                request.function_id, mesh, tensors.decode(request.batch_sharding), args,
                kwargs))
        return AheadCall(held.engine.run_op(request.function_id, args, kwargs))

    def _run_steps_call(self, session: Session, held: HeldSlice,
                        request: pb.RunStepsRequest, uses: set[int]) -> AheadCall:
        engine = held.engine
        source = (StepItems(engine.handles(self._args(session, held, request.items, uses)))
                  if request.has_items else held.iterator(request.iterator_id).id)
        state = engine.handles(self._args(session, held, request.initial_state, uses))
        steps = tensors.decode(request.steps)
        return AheadCall(ops.RunSteps(request.function_id, source,
                                      engine.steps_per_run if steps is None else steps, state))

    def _distribute_values_call(self, session: Session, held: HeldSlice,
                                 request: pb.DistributeValuesRequest, uses: set[int]
                                 ) -> AheadCall:
        return AheadCall(ops.ValuesFromFunction(request.function_id))

    def _next_call(self, session: Session, held: HeldSlice, request: pb.IteratorRequest,
                    uses: set[int]) -> AheadCall:
        iterator = held.iterator(request.id)

        def answered(results: list[Any], reply: pb.SliceReply) -> None:
            iterator.full_steps_ahead = min(ahead for _, ahead in results)
            reply.full_steps_ahead = iterator.full_steps_ahead

        return AheadCall(ops.NextInput(iterator.id), lambda results: results[0][0], answered)

    _VALUE_CALLS: ClassVar[dict[str, Callable[[EngineCalls, Session, HeldSlice, Any,
                                         set[int]], AheadCall]]] = {
        "run": _run_call, "run_steps": _run_steps_call,
        "distribute_values": _distribute_values_call, "next": _next_call}

    # Small results computed by one operation, sent behind the operations in flight.
    def _reduce_call(self, session: Session, held: HeldSlice, request: pb.ReduceRequest,
                     uses: set[int]) -> ResultCall:
        value = self._args(session, held, request.value, uses)
        op, axis = tensors.decode(request.reduce_op), tensors.decode(request.axis)
        return held.engine.reduce_call(op, value, axis)

    def _gather_call(self, session: Session, held: HeldSlice, request: pb.GatherRequest,
                     uses: set[int]) -> ResultCall | None:
        value = self._args(session, held, request.value, uses)
        return held.engine.gather_call(value, tensors.decode(request.axis))

    def _local_results_call(self, session: Session, held: HeldSlice,
                            request: pb.ValueRequest, uses: set[int]) -> ResultCall:
        return held.engine.local_results_call(self._args(session, held, request.value, uses))

    def _fetch_call(self, session: Session, held: HeldSlice, request: pb.ValueRequest,
                    uses: set[int]) -> ResultCall:
        return held.engine.fetch_call(self._args(session, held, request.value, uses))

    _RESULT_CALLS: ClassVar[dict[str, Callable[[EngineCalls, Session, HeldSlice, Any,
                                             set[int]], ResultCall | None]]] = {
        "reduce": _reduce_call, "gather": _gather_call,
        "local_results": _local_results_call, "fetch": _fetch_call}

    # ------------------------------------------------------------------- results
    # Each computes a numpy nest from the slice's values. The op stream runs them in
    # its order (small results); the result RPCs after ``after_op``, streaming.
    def _reduce(self, session: Session, held: HeldSlice, request: pb.ReduceRequest) -> Any:
        return held.engine.answer(self._reduce_call(session, held, request, set()))

    def _reduce_in_parts(self, session: Session, held: HeldSlice, request: pb.ReduceRequest
                         ) -> Any:
        """:meth:`_reduce`; of global values with ``axis=None``, which it gives whole
        (``ops.Reduce``'s rule), each leaf is fetched in blocks of rows as a fetch is,
        never assembled on one host nor held here whole."""
        value = self._args(session, held, request.value)
        reduce_op, axis = tensors.decode(request.reduce_op), tensors.decode(request.axis)
        ReduceOp.from_value(reduce_op)  # a bad op is an error whatever the value
        leaves = jax.tree.leaves(value, is_leaf=is_group_value)
        if axis is None and leaves and all(
                isinstance(v, GroupValue) and v.info.global_view for v in leaves):
            return _streamed(jax.tree.map(
                lambda v: held.engine.fetch_parts(v, tensors.DATA_PIECES), value,
                is_leaf=is_group_value))
        return held.engine.reduce(reduce_op, value, axis)

    def _gather(self, session: Session, held: HeldSlice, request: pb.GatherRequest) -> Any:
        value = self._args(session, held, request.value)
        return held.engine.gather(value, tensors.decode(request.axis))

    def _gather_in_parts(self, session: Session, held: HeldSlice,
                         request: pb.GatherRequest) -> Any:
        """:meth:`_gather`, with large leaves left in blocks of rows to stream one by
        one: the coordinator holds a few blocks, never the result."""
        value = self._args(session, held, request.value)
        return _streamed(held.engine.gather_parts(value, tensors.decode(request.axis),
                                                  tensors.DATA_PIECES))

    def _local_results(self, session: Session, held: HeldSlice, request: pb.ValueRequest
                       ) -> Any:
        return held.engine.local_results(self._args(session, held, request.value))

    def _local_results_in_parts(self, session: Session, held: HeldSlice,
                                request: pb.ValueRequest) -> Any:
        """:meth:`_local_results`, with large leaves left in blocks of rows."""
        value = self._args(session, held, request.value)
        return _streamed(held.engine.local_results_parts(value, tensors.DATA_PIECES))

    def _fetch(self, session: Session, held: HeldSlice, request: pb.ValueRequest) -> Any:
        return held.engine.fetch(self._args(session, held, request.value))

    def _fetch_in_parts(self, session: Session, held: HeldSlice, request: pb.ValueRequest
                        ) -> Any:
        """:meth:`_fetch`, with a large value left in blocks of rows."""
        value = self._args(session, held, request.value)
        if not isinstance(value, GroupValue):
            return held.engine.fetch(value)  # the engine says what it takes
        return _streamed(held.engine.fetch_parts(value, tensors.DATA_PIECES))

    _RESULTS: ClassVar[dict[str, Callable[[EngineCalls, Session, HeldSlice, Any], Any]]] = {
        "reduce": _reduce, "gather": _gather, "local_results": _local_results,
        "fetch": _fetch}


def dropped(message: pb.Dropped) -> ops.Dropped:
    """What a client dropped, as the slice takes it."""
    return ops.Dropped(tuple(message.value_ids), tuple(message.iterator_ids),
                       tuple(message.dataset_ids))


def _streamed(tree: Any) -> Any:
    """``tree`` with each :class:`GatherParts` leaf a result to stream as it comes
    (rows) or joined (parts along another axis)."""
    def leaf(g: Any) -> Any:
        if not isinstance(g, GatherParts):
            return g
        # bounded: GatherParts.join joins arrays; it waits on nothing
        return tensors.RowParts(g.shape, g.dtype, g.parts) if g.axis == 0 else g.join()

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, GatherParts))

