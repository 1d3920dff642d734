"""The ``Stream`` RPC: a slice's operations, applied in the order the client sent them.

:class:`OpStreamServicer` (a mixin of ``CoordinatorService``) reads batches of
``SliceOp`` s, applies each on its held slice (the engine call comes from
:class:`~jaxpod.service.api.engine_calls.EngineCalls`' tables) and answers each with a
``SliceReply``: new values' refs, a small result inline, or the operation's failure. A
predicted operation goes ahead of the replies before it (:mod:`jaxpod.service.api.ahead`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.service.api.ahead import AheadBatch, AheadCall, prediction_error
from jaxpod.service.api.engine_calls import EngineCalls, dropped
from jaxpod.service.api.error_mapping import op_failure
from jaxpod.service.api.stopping import Stopping
from jaxpod.service.auth.tokens import Principal, TokenBook
from jaxpod.service.sessions import Session, SessionManager
from jaxpod.service.slices.group_results import ResultCall
from jaxpod.service.slices.held import HeldSlice

_T = TypeVar("_T")


class OpStreamServicer(EngineCalls):
    """``Stream``; the class using it provides ``sessions``, ``tokens``, ``stopping``,
    ``caller``, ``_blocking`` and ``_slice``."""

    sessions: SessionManager
    tokens: TokenBook | None
    stopping: Stopping

    if TYPE_CHECKING:
        def caller(self, context: Any) -> Principal: ...

        async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T: ...

        def _slice(self, request: Any, drop: bool = True) -> tuple[Session, HeldSlice]: ...

    async def Stream(self, request_iterator: AsyncIterator[pb.SliceOps], context: Any
                     ) -> AsyncIterator[pb.SliceReplies]:
        # One operation at a time, in the order sent: each may use the values of the
        # ones before it, and the replica group keeps that order on every host. What
        # arrived together runs in one hand-off to a thread.
        joined: set[HeldSlice] = set()  # the slices this stream counts as open on
        caller = self.caller(context) if self.tokens is not None else None
        try:
            while (batch := await self.stopping.next(request_iterator, "Stream")) is not None:
                yield await self._blocking(self._apply_all, batch, joined, caller)
        finally:
            for held in joined:
                held.advanced(streams=-1)

    def _apply_all(self, batch: pb.SliceOps, joined: set[HeldSlice],
                   caller: Principal | None) -> pb.SliceReplies:
        replies: list[pb.SliceReply] = []
        with AheadBatch(replies, self._refs, op_failure) as ahead:
            for op in batch.ops:
                reply = self._apply(op, joined, caller, ahead)
                if reply is not None:
                    replies.append(reply)
        return pb.SliceReplies(replies=replies)

    def _apply(self, op: pb.SliceOp, joined: set[HeldSlice], caller: Principal | None,
               ahead: AheadBatch) -> pb.SliceReply | None:
        """Runs one stream operation; its failure becomes the reply's, not the stream's.
        ``None``: it went ahead (:mod:`jaxpod.service.api.ahead`), which answers it. Any
        other runs once those sent ahead before it are answered."""
        kind = op.WhichOneof("body")
        held: HeldSlice | None = None
        went_ahead = False
        try:
            if kind is None:
                raise ValueError(f"Stream: operation #{op.op} has no body.")
            request = getattr(op, kind)
            if caller is not None:
                self.sessions.check_owner(request.session_id, caller)
            session, held = self._slice(request, drop=False)
            if held not in joined:
                joined.add(held)
                held.advanced(streams=1)
            held.advanced(received=op.op)
            held.drop(dropped(request.dropped))
            if kind in self._VALUE_CALLS and ahead.takes(op, held):
                uses: set[int] = set()
                ahead.send(op, held,
                           self._VALUE_CALLS[kind](self, session, held, request, uses), uses)
                went_ahead = True
                return None
            if kind in self._RESULT_CALLS and ahead.follows(held):
                uses = set()
                call = self._RESULT_CALLS[kind](self, session, held, request, uses)
                if call is not None:
                    ahead.send(op, held, AheadCall(call.operation, result=_inline(call)),
                               uses)
                    went_ahead = True
                    return None
            ahead.finish()
            if kind in self._RESULTS:  # small: every tensor inline in the reply
                result = self._RESULTS[kind](self, session, held, request)
                return pb.SliceReply(op=op.op, tree=tensors.encode(result, path="result"))
            made_by = self._VALUE_CALLS[kind](self, session, held, request, set())
            result, answers = held.engine.make(made_by.operation, made_by.infos)
            tree, made = self._refs(held, result, op.op)
            if op.predicted and tree != op.expect:
                raise prediction_error(op, tree)
            held.keep_values(made)
            reply = (pb.SliceReply(op=op.op, done=True) if op.predicted
                     else pb.SliceReply(op=op.op, tree=tree))
            if made_by.answered is not None:
                made_by.answered(answers, reply)
            return reply
        except Exception as e:
            ahead.finish()  # the replies before this one's, in order
            if held is not None:
                held.failed(op.op)
            return pb.SliceReply(op=op.op, failure=op_failure(e))
        finally:
            if held is not None and not went_ahead:
                held.advanced(applied=op.op)


def _inline(call: ResultCall) -> Callable[[list[Any]], pb.Tree]:
    """A small result's reply tree, from every host's answer to ``call``."""
    return lambda per_host: tensors.encode(call.answer(per_host), path="result")
