"""The ``Coordinator`` gRPC service: sessions and the strategy methods on their slices.

Each RPC checks the session that names it, resolves the slice and the values it refers
to (only within that session), and runs the operation on the slice's replica group in
a worker thread (the group's calls block on Ray). Results go back as value references,
or, for reductions, gathers and local results, as streamed tensors. Every exception
becomes a gRPC status through :mod:`jaxpod.service.api.status`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import grpc
import jax

import jaxpod
from jaxpod import operations as ops
from jaxpod.errors import (
    AuthenticationError,
    DependencyFailedError,
    EndOfDataError,
    HandleError,
    MalformedRequestError,
    MessageTooLargeError,
    PermissionDeniedError,
    SessionError,
    VersionMismatchError,
)
from jaxpod.operations import HandleInfo, StepItems
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import coordinator_pb2_grpc as pb_grpc
from jaxpod.proto import job_messages, tensors
from jaxpod.service.api.ahead import AheadBatch, AheadCall, prediction_error
from jaxpod.service.api.jobs import JobsServicer
from jaxpod.service.api.status import status_of
from jaxpod.service.api.stopping import Stopping
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.tokens import LOCAL, Principal, TokenBook
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.sessions import Session, SessionManager
from jaxpod.service.slices.group_engine import (
    DefinedFunction,
    GatherParts,
    GroupValue,
    ResultCall,
)
from jaxpod.service.slices.held import HeldSlice
from jaxpod.service.slices.profiles import SliceProfiler
from jaxpod.service.slices.replica_group import OPERATION_TIMEOUT
from jaxpod.shipping import ShippedFunction, runtime_versions
from jaxpod.storage import join
from jaxpod.timeouts import Cancel

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
#: A result stream: the skeleton message, then data chunks already serialized.
ResultStream = AsyncIterator[pb.ResultChunk | bytes]
#: The most bytes one Put may upload (a tensor argument); it streams in chunks.
MAX_UPLOAD_BYTES = 4 * 1024 * 1024 * 1024


class SliceProvider(Protocol):
    """Acquires slices with their replica groups started and configured."""

    def acquire(self, request: SliceRequest, slice_id: str,
                cancel: Cancel | None = None) -> HeldSlice:
        """Slices as ``request`` asks; a wait for free ones gives up once ``cancel`` is
        set (``AllocationCancelledError``)."""
        ...

    def cluster(self) -> list[ClusterSlice]: ...

    def snapshot(self) -> Sequence[Any]:
        """Every slice with its hosts and health, as the resolvers read them (objects
        with ``info``, a ``SliceInfo``, and ``problems``): for the status page."""
        ...

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        """Whether an acquire of that shape would get slices without waiting."""
        ...

    def close(self) -> None:
        """Stops every slice kept warm (service shutdown)."""


class CoordinatorService(JobsServicer, pb_grpc.CoordinatorServicer):
    """The RPC handlers (the job RPCs come from :class:`JobsServicer`).

    Args:
      slices: where slices come from (Ray allocation and host workers).
      sessions: the session table (its default lease comes from the environment).
      max_workers: threads running blocking slice operations.
      jobs: the job manager (``None``: the service takes no jobs).
    """

    def __init__(self, slices: SliceProvider, sessions: SessionManager | None = None,
                 max_workers: int = 32, jobs: JobManager | None = None,
                 tokens: TokenBook | None = None, quotas: SliceQuotas | None = None,
                 checkpoint_dir: str | None = None) -> None:
        self.slices = slices
        self.jobs = jobs
        #: Where sessions' profiles go, under ``sessions/<holder label>/``: the jobs'
        #: checkpoint dir, which every host can reach.
        self.checkpoint_dir = checkpoint_dir or (
            jobs.checkpoint_dir if jobs is not None
            else os.path.join(tempfile.gettempdir(), "jaxpod-checkpoints"))
        self.tokens = tokens
        self.sessions = sessions if sessions is not None else SessionManager()
        self.quotas = quotas if quotas is not None else SliceQuotas(tokens, self.sessions)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="jaxpod-slice")
        #: Ends the calls waiting on their clients when the service stops.
        self.stopping = Stopping()

    async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(_no_stop, fn, *args))

    def caller(self, context: Any) -> Principal:
        """Who made this call: its token's principal (:data:`LOCAL` without tokens). The
        interceptor already refused unknown tokens and roles too low for the method."""
        if self.tokens is None:
            return LOCAL
        metadata = dict(context.invocation_metadata() or ())
        who = self.tokens.identify_bearer(metadata.get("authorization"))
        if who is None:
            raise AuthenticationError("The call carried no token this service knows.")
        return who

    def audit(self, who: str, action: str, target: str, detail: str = "") -> None:
        """Records in the audit log (a service without a job store keeps none); never
        raises (:meth:`JobManager.audit`)."""
        if self.jobs is not None:
            self.jobs.audit(who, action, target, detail)

    async def audit_refusal(self, context: Any, method: str, error: Exception) -> None:
        await self._blocking(self.audit, self.caller(context).name, "refused", method,
                             str(error))

    def check_session(self, request: Any, context: Any) -> None:
        """Refuses a request naming a session its caller did not open (admins pass)."""
        session_id = getattr(request, "session_id", "")
        if session_id and self.tokens is not None:
            self.sessions.check_owner(session_id, self.caller(context))

    # ------------------------------------------------------------------ sessions
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any
                          ) -> pb.OpenSessionResponse:
        if request.protocol_version != tensors.PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"This service speaks jaxpod protocol {tensors.PROTOCOL_VERSION} (jaxpod "
                f"{jaxpod.__version__}); the client speaks protocol "
                f"{request.protocol_version} (jaxpod {request.client_version or '?'}). "
                f"Install jaxpod=={jaxpod.__version__} on the client.")
        mine = runtime_versions()
        theirs = dict(request.runtime_versions)
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: client {a}, service {b}" for k, (a, b) in diff.items())
            raise VersionMismatchError(
                f"Step functions travel as cloudpickle, which needs the same runtime on "
                f"both ends ({detail}). Use the service's versions on the client.")
        caller = self.caller(context)
        session = self.sessions.open(request.lease_s, caller.name)
        logger.info("session %s opened by %s (lease %.1fs)", session.id, caller.name,
                    session.lease_s)
        return pb.OpenSessionResponse(session_id=session.id, lease_s=session.lease_s,
                                      server_version=jaxpod.__version__,
                                      protocol_version=tensors.PROTOCOL_VERSION)

    async def Heartbeat(self, request: pb.SessionRequest, context: Any
                        ) -> pb.HeartbeatResponse:
        session = self.sessions.get(request.session_id)
        return pb.HeartbeatResponse(lease_s=session.lease_s)

    async def CloseSession(self, request: pb.SessionRequest, context: Any) -> pb.Empty:
        await self.close_session(request.session_id, "closed by its client")
        return pb.Empty()

    async def close_session(self, session_id: str, why: str) -> None:
        for held in self.sessions.close(session_id):
            await self._release(held)
        logger.info("session %s %s", session_id, why)

    async def _release(self, held: HeldSlice) -> None:
        await self._blocking(held.release)
        if self.jobs is not None:  # a queued job may take the slice
            self.jobs.wake()

    async def reap_expired(self) -> list[str]:
        """Closes every session whose lease ran out; returns their ids."""
        expired = self.sessions.expired()
        for session_id in expired:
            await self.close_session(session_id, "expired: no heartbeat within its lease")
        return expired

    async def close_all(self) -> None:
        if self.jobs is not None:  # running jobs stop and give their slices back first
            await self._blocking(self.jobs.close)
        for session in self.sessions.all():
            await self.close_session(session.id, "closed: the service is stopping")
        await self._blocking(self.slices.close)  # after the sessions: they release to it
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------------- slices
    async def AcquireSlice(self, request: pb.AcquireSliceRequest, context: Any
                           ) -> pb.SliceInfo:
        session = self.sessions.get(request.session_id)
        slice_id = f"slice-{secrets.token_hex(4)}"
        with self.quotas.reserve(session.owner, max(1, request.num_slices), "AcquireSlice"):
            held = await self.stopping.during(  # a wait for a busy slice ends at a stop
                lambda cancel: self._blocking(self.slices.acquire, slice_request(request),
                                              slice_id, cancel), "AcquireSlice")
            try:
                session.add_slice(held)
            except SessionError:
                await self._release(held)
                raise
        d = held.description
        return pb.SliceInfo(slice_id=held.id, accelerator_type=d["accelerator_type"],
                            num_slices=d["num_slices"], num_hosts=d["num_hosts"],
                            num_replicas=held.engine.num_replicas_in_sync,
                            steps_per_run=held.engine.steps_per_run,
                            slice_names=d["slice_names"])

    async def ReleaseSlice(self, request: pb.SliceRequest, context: Any) -> pb.Empty:
        held = self.sessions.get(request.session_id).pop_slice(request.slice_id)
        await self._release(held)
        return pb.Empty()

    def _slice(self, request: Any, drop: bool = True) -> tuple[Session, HeldSlice]:
        """The session and slice a request names; with ``drop``, what the client
        dropped is let go first (the workers free it with the slice's next operation)."""
        session = self.sessions.get(request.session_id)
        held = session.slice(request.slice_id)
        if drop and request.HasField("dropped"):
            held.drop(_dropped(request.dropped))
        return session, held

    def _after(self, request: Any) -> tuple[Session, HeldSlice]:
        """:meth:`_slice` for a call that follows stream operation ``after_op``: waits
        for it (in a worker thread), then lets go of what was dropped."""
        session, held = self._slice(request, drop=False)
        held.wait_applied(request.after_op, OPERATION_TIMEOUT.seconds())
        if request.HasField("dropped"):
            held.drop(_dropped(request.dropped))
        return session, held

    # ------------------------------------------------------- functions and inputs
    async def DefineFunction(self, request: pb.DefineFunctionRequest, context: Any
                             ) -> pb.DefineFunctionResponse:
        _, held = self._slice(request)
        shipped = ShippedFunction(request.payload, dict(request.runtime_versions))
        defined = await self._blocking(held.engine.define, shipped)
        return pb.DefineFunctionResponse(function_id=defined.id)

    async def Put(self, request_iterator: AsyncIterator[pb.TensorChunk], context: Any
                  ) -> pb.PutResponse:
        first: pb.TensorChunk | None = None
        parts: list[bytes] = []
        size = declared = 0
        async for chunk in request_iterator:
            if first is None:  # refused before any more of it is read
                first = chunk
                self.check_session(first, context)
                self.sessions.get(first.session_id)
                declared = _upload_size(first)
            size += len(chunk.data)
            if size > declared:
                raise ValueError(
                    f"Put: the upload sends more than the {declared} bytes its dtype "
                    f"{first.dtype} and shape {list(first.shape)} hold.")
            parts.append(chunk.data)
        if first is None:
            raise ValueError("Put: the upload stream was empty.")
        session = self.sessions.get(first.session_id)
        array = tensors.from_tensor(pb.Tensor(dtype=first.dtype, shape=first.shape,
                                              data=b"".join(parts)))
        return pb.PutResponse(blob=session.add_blob(array))

    async def DistributeDataset(self, request: pb.DistributeDatasetRequest, context: Any
                                ) -> pb.DatasetResponse:
        session, held = self._slice(request)
        source = request.WhichOneof("source")
        versions = dict(request.runtime_versions)
        options = ShippedFunction(request.options, versions) if request.options else None
        if source == "function_id":
            dataset = await self._blocking(held.engine.distribute_datasets_from_function,
                                           DefinedFunction(request.function_id), options)
        else:
            payload = (request.dataset if source == "dataset"
                       else session.blob(request.dataset_blob).tobytes())
            dataset = await self._blocking(held.engine.experimental_distribute_dataset,
                                           ShippedFunction(payload, versions), options)
        held.datasets[dataset.id] = dataset
        return pb.DatasetResponse(dataset_id=dataset.id)

    async def CreateIterator(self, request: pb.IteratorRequest, context: Any
                             ) -> pb.IteratorResponse:
        _, held = self._slice(request)
        dataset = held.dataset(request.id)
        iterator = await self._blocking(dataset.iterate, request.steps_per_run or None)
        held.iterators[iterator.id] = iterator
        return pb.IteratorResponse(iterator_id=iterator.id)

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

    # ---------------------------------------------------------- the op stream
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
        with AheadBatch(replies, self._refs, _failure) as ahead:
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
            held.drop(_dropped(request.dropped))
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
            return pb.SliceReply(op=op.op, failure=_failure(e))
        finally:
            if held is not None and not went_ahead:
                held.advanced(applied=op.op)

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
        iterator = (StepItems(self._args(session, held, request.items, uses))
                    if request.has_items else held.iterator(request.iterator_id))
        state = self._args(session, held, request.initial_state, uses)
        return AheadCall(held.engine.run_steps_op(
            request.function_id, iterator, tensors.decode(request.steps), state))

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

    _VALUE_CALLS: ClassVar[dict[str, Callable[[CoordinatorService, Session, HeldSlice, Any,
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

    _RESULT_CALLS: ClassVar[dict[str, Callable[[CoordinatorService, Session, HeldSlice, Any,
                                             set[int]], ResultCall | None]]] = {
        "reduce": _reduce_call, "gather": _gather_call,
        "local_results": _local_results_call, "fetch": _fetch_call}

    # ------------------------------------------------------------------- results
    # Each computes a numpy nest from the slice's values. The op stream runs them in
    # its order (small results); the result RPCs after ``after_op``, streaming.
    def _reduce(self, session: Session, held: HeldSlice, request: pb.ReduceRequest) -> Any:
        return held.engine.answer(self._reduce_call(session, held, request, set()))

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
        return held.engine.experimental_local_results(self._args(session, held, request.value))

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

    _RESULTS: ClassVar[dict[str, Callable[[CoordinatorService, Session, HeldSlice, Any],
                                          Any]]] = {
        "reduce": _reduce, "gather": _gather, "local_results": _local_results,
        "fetch": _fetch}

    def _result_stream(self, compute: Callable[[Session, HeldSlice, Any], Any], request: Any
                       ) -> ResultStream:
        """``compute``'s result, streamed, once the op stream applied ``after_op``."""
        def run() -> Any:
            session, held = self._after(request)
            return compute(session, held, request)

        return self._stream(run)

    async def _stream(self, compute: Callable[[], Any]) -> ResultStream:
        skeleton, data = await self._blocking(lambda: tensors.split_result(compute()))
        yield skeleton
        # Copies and waits for the workers run in a thread, not on the event loop.
        while data is not None and (
                chunks := await self._blocking(next, data, None)) is not None:
            for chunk in chunks:  # an empty part is an empty run
                yield chunk

    def Reduce(self, request: pb.ReduceRequest, context: Any) -> ResultStream:
        return self._result_stream(self._reduce, request)

    def Gather(self, request: pb.GatherRequest, context: Any) -> ResultStream:
        return self._result_stream(self._gather_in_parts, request)

    def LocalResults(self, request: pb.ValueRequest, context: Any) -> ResultStream:
        return self._result_stream(self._local_results_in_parts, request)

    def Fetch(self, request: pb.ValueRequest, context: Any) -> ResultStream:
        return self._result_stream(self._fetch_in_parts, request)

    async def Free(self, request: pb.FreeRequest, context: Any) -> pb.Empty:
        session = self.sessions.get(request.session_id)
        for blob in request.blobs:
            session.blobs.pop(blob, None)
        held = session.slices.get(request.slice_id)
        if held is not None:  # else released already: everything on it is gone
            held.drop(_dropped(request.dropped))
        return pb.Empty()

    async def SliceStats(self, request: pb.SliceRequest, context: Any
                         ) -> pb.SliceStatsResponse:
        _, held = self._slice(request)
        stats = await self._blocking(held.engine.stats)
        return pb.SliceStatsResponse(hosts=[pb.HostStats(**s) for s in stats])

    async def ProfileSlice(self, request: pb.ProfileSliceRequest, context: Any
                           ) -> pb.JobProfile:
        session, held = self._slice(request)
        if held.profiler is None:
            held.profiler = SliceProfiler(join(self.checkpoint_dir, "sessions",
                                               tensors.holder_label(session.id)))
        if request.stop:
            profile = await self._blocking(held.profiler.stop, held.engine.stop_profile)
        else:
            profile = await self._blocking(held.profiler.start, held.engine.start_profile,
                                           request.seconds)
        return job_messages.to_message(profile)

    async def ClusterStatus(self, request: pb.Empty, context: Any) -> pb.ClusterStatusResponse:
        slices = await self._blocking(self.slices.cluster)
        holders = self.slice_holders()
        return pb.ClusterStatusResponse(
            slices=[pb.ClusterSlice(name=s.name, accelerator_type=s.accelerator_type,
                                    num_hosts=s.num_hosts, holder=holders.get(s.name, ""))
                    for s in slices],
            num_sessions=len(self.sessions), server_version=jaxpod.__version__)

    def slice_holders(self) -> dict[str, str]:
        """Slice name -> who holds it: a session's :func:`~jaxpod.proto.tensors.holder_label`
        (never its id, which authorizes its calls) or ``job <id>`` (cluster status, the
        HTTP dashboard)."""
        holders = {name: tensors.holder_label(s.id) for s in self.sessions.all()
                   for h in s.slices.values()
                   for name in h.description["slice_names"]}
        if self.jobs is not None:
            holders.update(self.jobs.holders())
        return holders


# ---------------------------------------------------------------- error mapping
class _Stopped(Exception):
    """Carries a ``StopIteration`` (e.g. ``EndOfDataError``) out of a worker thread:
    neither a future nor a coroutine may raise one."""

    def __init__(self, error: StopIteration) -> None:
        super().__init__(str(error))
        self.error = error


def slice_request(message: pb.AcquireSliceRequest) -> SliceRequest:
    """An ``AcquireSlice`` request as a provider takes it."""
    return SliceRequest(message.accelerator_type, message.num_slices or 1,
                        message.steps_per_run or 1, tuple(message.computation_shape),
                        message.num_replicas, message.timeout_s)


def _dropped(message: pb.Dropped) -> ops.Dropped:
    """What a client dropped, as the slice takes it."""
    return ops.Dropped(tuple(message.value_ids), tuple(message.iterator_ids),
                       tuple(message.dataset_ids))


def _streamed(tree: Any) -> Any:
    """``tree`` with each :class:`GatherParts` leaf a result to stream as it comes
    (rows) or joined (parts along another axis)."""
    def leaf(g: Any) -> Any:
        if not isinstance(g, GatherParts):
            return g
        return tensors.RowParts(g.shape, g.dtype, g.parts) if g.axis == 0 else g.join()

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, GatherParts))


def _inline(call: ResultCall) -> Callable[[list[Any]], pb.Tree]:
    """A small result's reply tree, from every host's answer to ``call``."""
    return lambda per_host: tensors.encode(call.answer(per_host), path="result")


def _no_stop(fn: Callable[..., _T], *args: Any) -> _T:
    try:
        return fn(*args)
    except StopIteration as e:
        if not isinstance(e, EndOfDataError):
            e = EndOfDataError(str(e) or "The distributed dataset has no more input.")
        raise _Stopped(e.with_traceback(None)) from None  # frames would pin the iterator


def _failure(error: Exception) -> pb.OpFailure:
    """A stream operation's failure, as a failed call's status would carry it."""
    if isinstance(error, _Stopped):
        error = error.error
    code, details, trailers = status_of(error)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        logger.info("a stream operation failed: %s", details)
    parts = dict(trailers)
    return pb.OpFailure(code=code.value[0], details=details,
                        error=parts.get(tensors.ERROR_TRAILER, b""),
                        traceback=parts.get(tensors.TRACEBACK_TRAILER, b""),
                        caused_by=error.op if isinstance(error, DependencyFailedError) else 0)


@dataclass(frozen=True)
class MalformedRequest:
    """What a method's request deserializer gives for bytes that do not parse as its
    message (gRPC would answer ``UNKNOWN`` for the parse error itself): the handler
    refuses it as ``INVALID_ARGUMENT``, naming the method."""

    method: str
    message: str
    error: str

    def refusal(self) -> MalformedRequestError:
        return MalformedRequestError(
            f"{self.method}: the request is not a valid jaxpod.{self.message} message "
            f"({self.error}). Call the service through a jaxpod client of its own version "
            "(jaxpod.connect); other clients must build requests from "
            "proto/coordinator.proto.")


def request_deserializer(method: str, message: type[Any]) -> Callable[[bytes], Any]:
    """``message.FromString``, giving a :class:`MalformedRequest` instead of raising."""
    def deserialize(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception as e:  # DecodeError; whatever else hostile bytes provoke
            return MalformedRequest(method, message.__name__, f"{type(e).__name__}: {e}")

    return deserialize


def _checked(request: Any) -> Any:
    """Raises the refusal of a malformed request; a request stream's items are checked
    as they arrive."""
    if isinstance(request, MalformedRequest):
        raise request.refusal()
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, MalformedRequest):
            raise request.refusal()
        yield request


def _upload_size(first: pb.TensorChunk) -> int:
    """The bytes an upload's first chunk declares (its dtype and shape), refused over
    ``MAX_UPLOAD_BYTES`` before the rest is read."""
    if any(d < 0 for d in first.shape):
        raise ValueError(f"Put: the upload's shape {list(first.shape)} has a negative "
                         "dimension.")
    # Python integers: a hostile shape must not wrap around in int64.
    declared = math.prod(first.shape) * tensors.dtype_from_name(first.dtype).itemsize
    if declared > MAX_UPLOAD_BYTES:
        raise MessageTooLargeError(
            f"Put: the upload declares {declared} bytes (dtype {first.dtype}, shape "
            f"{list(first.shape)}), over the {MAX_UPLOAD_BYTES}-byte limit; split the "
            "tensor into several arguments.")
    return declared


def _unary(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _checked(request)
            self.check_session(request, context)
            return await handler(self, request, context)
        except Exception as e:
            if isinstance(e, PermissionDeniedError):
                await self.audit_refusal(context, handler.__name__, e)
            await _abort(context, e, handler.__name__)

    return wrapper


def _streaming(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[Any]:
        try:
            request = _checked(request)
            self.check_session(request, context)
            stream = handler(self, request, context)
            async for item in stream:
                yield item
        except Exception as e:
            if isinstance(e, PermissionDeniedError):
                await self.audit_refusal(context, handler.__name__, e)
            await _abort(context, e, handler.__name__)

    return wrapper


async def _abort(context: grpc.aio.ServicerContext, error: Exception, rpc: str) -> None:
    if isinstance(error, grpc.aio.AbortError):
        raise error
    code, details, trailers = status_of(error.error if isinstance(error, _Stopped) else error)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        logger.info("%s failed: %s", rpc, details)
    context.set_trailing_metadata(trailers)
    await context.abort(code, details)


def _install_error_mapping(cls: type[CoordinatorService]) -> None:
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        handler = getattr(cls, method.name)
        wrap = _streaming if method.server_streaming else _unary
        setattr(cls, method.name, wrap(handler))


_install_error_mapping(CoordinatorService)
