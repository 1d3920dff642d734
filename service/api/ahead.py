"""Stream operations sent to a slice's hosts ahead of the replies before them.

The coordinator answers a batch of a client's stream operations in order. An
operation the client predicted (asynchronous dispatch: its outputs' shapes, dtypes
and valid rows are known before it runs) need not wait for the replies to the ones
before it: its predicted values get their ids at once (a block per operation,
``ReplicaGroup.pipeline``), so the next operation can name them, and the hosts find
the next message waiting when they finish one. They still run them one at a time, in
one order (DESIGN §1). Each reply is then checked against its prediction.

What can go wrong, and what the client hears (its reply, in order):

* an operation fails on every host: it fails; those sent behind it that used its
  outputs found them missing on every host alike, and are answered
  ``DependencyFailedError`` naming it (what they made anyway is freed);
* it fails on some hosts only: it dispatches (a partial failure restarts the slice,
  failing what was sent behind it with ``SliceResetError``), or the next operation
  was not sent before its replies were read (``Operation.followable``);
* its outputs differ from the prediction: it fails with ``AsyncPredictionError``, its
  values are freed, and its dependents are answered as above.

A small result that one operation computes (a ``reduce``, a fetch, local results, a
one-leaf ``gather``; its answer inline) may also follow operations in flight: nothing is
sent behind it before its reply is read.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxpod import operations as ops
from jaxpod.errors import AsyncPredictionError, DependencyFailedError
from jaxpod.operations import HandleInfo, op_of
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.service.slices.group_engine import EnginePipeline
from jaxpod.service.slices.group_handles import GroupValue
from jaxpod.service.slices.group_results import first_host
from jaxpod.service.slices.held import HeldSlice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AheadCall:
    """How one stream operation is sent: the operation for the hosts, where its new
    values' infos are in the hosts' results, and what to add to its reply; or, for a
    small result, its reply's tree from the hosts' results."""

    operation: ops.Operation[Any]
    infos: Callable[[list[Any]], Any] = first_host
    answered: Callable[[list[Any], pb.SliceReply], None] | None = None
    result: Callable[[list[Any]], pb.Tree] | None = None


@dataclass
class _Sent:
    op: pb.SliceOp
    held: HeldSlice
    call: AheadCall
    #: The predicted values by the client's ids, kept on the slice while it runs.
    made: dict[int, GroupValue]
    #: Operations sent ahead before it whose outputs it uses.
    producers: set[int] = field(default_factory=set)


#: The coordinator's numbering of new values: (slice, values or infos, op) -> their
#: tree and the values by the client's ids.
Refs = Callable[[HeldSlice, Any, int], tuple[pb.Tree, dict[int, Any]]]


class AheadBatch:
    """One batch's operations sent ahead, and the replies of the batch, in order.

    Args:
      replies: where each operation's reply goes, in the batch's order.
      refs: the coordinator's numbering of new values (``CoordinatorService._refs``).
      failure: the reply for an exception (``error_mapping.op_failure``).
    """

    def __init__(self, replies: list[pb.SliceReply], refs: Refs,
                 failure: Callable[[Exception], pb.OpFailure]) -> None:
        self._replies = replies
        self._refs = refs
        self._failure = failure
        self._sent: deque[_Sent] = deque()
        self._held: HeldSlice | None = None
        self._pipeline: EnginePipeline | None = None
        self._close: contextlib.ExitStack | None = None

    def __enter__(self) -> AheadBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def takes(self, op: pb.SliceOp, held: HeldSlice) -> bool:
        """Whether ``op`` (a predicted one of a kind that can go ahead) goes now;
        replies it may not be sent behind are received first."""
        if self._held is not held or (self._pipeline is not None and self._pipeline.reset):
            self.finish()  # a new pipeline (after a reset: on set-up workers)
        self._make_room()
        return op.predicted

    def follows(self, held: HeldSlice) -> bool:
        """Whether operations of ``held`` are in flight that one more may be sent
        behind now (a result: there is nothing to gain ahead of nothing)."""
        if self._held is not held or self._pipeline is None or self._pipeline.reset:
            return False
        self._make_room()
        return bool(self._pipeline.pending)

    def _make_room(self) -> None:
        """Receives the replies that the next operation may not be sent behind."""
        while self._pipeline is not None and self._pipeline.pending and \
                not self._pipeline.can_follow():
            self._receive_one()

    def send(self, op: pb.SliceOp, held: HeldSlice, call: AheadCall, uses: set[int]) -> None:
        """Sends ``op`` as ``call``; its predicted values (``op.expect``) are kept on the
        slice under the client's ids. Raises what sending raises: nothing was sent."""
        refs: list[pb.ValueRef] = []

        def predicted(node: pb.Tree) -> None:
            refs.append(node.value)

        if op.predicted:
            tensors.decode(op.expect, predicted)
        held.check_new_ids([ref.id for ref in refs])
        if self._pipeline is None:
            self._close = contextlib.ExitStack()
            self._pipeline = self._close.enter_context(held.engine.pipeline())
            self._held = held
        in_flight = {s.op.op for s in self._sent}
        while (first_id := self._pipeline.send(call.operation)) is None:
            self._receive_one()  # too large to go ahead of the replies unread
        made = {ref.id: held.engine.value(HandleInfo(
            first_id + i, tuple(ref.shape), ref.dtype,
            tuple(ref.valid_rows) if ref.has_valid_rows else None, ref.global_view))
            for i, ref in enumerate(refs)}
        held.keep_values(made)
        self._sent.append(_Sent(op, held, call, made, {op_of(i) for i in uses} & in_flight))

    def finish(self) -> None:
        """Receives every reply still unread and lets the slice's group go."""
        try:
            while self._sent:
                self._receive_one()
        finally:
            close, self._close = self._close, None
            self._pipeline = self._held = None
            if close is not None:
                try:  # after a reset, the new workers' set-up runs here
                    close.close()
                except Exception:
                    logger.exception("setting up the slice's restarted workers failed")

    def _receive_one(self) -> None:
        sent = self._sent.popleft()
        held, number = sent.held, sent.op.op
        assert self._pipeline is not None
        try:
            error: Exception | None = None
            results: list[Any] | None = None
            try:
                results = self._pipeline.receive()
            except Exception as e:
                error = e
            failed = sorted(p for p in sent.producers if p in held.failed_ops)
            if failed:  # its inputs never existed: what it did is not kept
                error = DependencyFailedError(
                    f"Not run: it uses an output of operation #{failed[0]} on this "
                    "slice, which failed.", failed[0])
            elif results is not None and sent.call.result is None:
                error = self._check(sent, results)
            if error is not None:
                if results is not None:  # made on the hosts: freed with the next call
                    held.engine.dropped.restore(sent.call.operation.created(results[0]))
                for value_id in sent.made:
                    held.values.pop(value_id, None)
                held.failed(number)
                self._replies.append(pb.SliceReply(op=number, failure=self._failure(error)))
                return
            assert results is not None
            if sent.call.result is not None:
                self._replies.append(pb.SliceReply(op=number, tree=sent.call.result(results)))
                return
            reply = pb.SliceReply(op=number, done=True)
            if sent.call.answered is not None:
                sent.call.answered(results, reply)
            self._replies.append(reply)
        finally:
            held.advanced(applied=number)

    def _check(self, sent: _Sent, results: list[Any]) -> Exception | None:
        """An ``AsyncPredictionError`` if the values made are not the ones predicted:
        their description, or the ids the hosts gave them."""
        tree, made = self._refs(sent.held, sent.call.infos(results), sent.op.op)
        if tree != sent.op.expect:
            return prediction_error(sent.op, tree)
        if made.keys() != sent.made.keys() or any(
                info.id != sent.made[i].info.id for i, info in made.items()):
            return prediction_error(sent.op, tree, "the hosts numbered them otherwise")
        return None


def prediction_error(op: pb.SliceOp, made: pb.Tree, difference: str = ""
                     ) -> AsyncPredictionError:
    """The failure of operation ``op`` whose outputs (``made``) are not the predicted
    ones."""
    return AsyncPredictionError(
        f"Operation #{op.op} ({op.WhichOneof('body')}) made outputs other than its earlier "
        "calls with the same argument shapes, so the handles it returned were wrong "
        f"({difference or _difference(op.expect, made)}): its function's Python code "
        "depends on more than those shapes when traced (global state, a random choice). "
        "Make it depend only on its arguments, or set JAXPOD_ASYNC_DISPATCH=0.")


def _difference(expected: pb.Tree, made: pb.Tree) -> str:
    """The first difference between predicted and real outputs, for the message."""
    from google.protobuf import text_format

    want = text_format.MessageToString(expected, as_one_line=True)
    got = text_format.MessageToString(made, as_one_line=True)
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
              min(len(want), len(got)))
    start = max(0, at - 60)
    return f"predicted ...{want[start:at + 60]}..., made ...{got[start:at + 60]}..."
