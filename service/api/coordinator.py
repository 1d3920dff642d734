"""The ``Coordinator`` gRPC service: sessions and the strategy methods on their slices.

Each RPC checks the session that names it, resolves the slice and the values it refers
to (only within that session), and runs the operation on the slice's replica group in
a worker thread (the group's calls block on Ray). Results go back as value references,
or, for reductions, gathers and local results, as streamed tensors. Every exception
becomes a gRPC status through :mod:`jaxpod.service.api.status`.

:class:`CoordinatorService` holds the sessions and slices and answers their RPCs here;
its other RPCs come from mixins: the strategy methods'
(:mod:`~jaxpod.service.api.strategy_methods`), the operation stream's
(:mod:`~jaxpod.service.api.op_stream`, over the engine calls of
:mod:`~jaxpod.service.api.engine_calls`) and the jobs' (:mod:`~jaxpod.service.api.jobs`);
:mod:`~jaxpod.service.api.error_mapping` wraps them all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import jaxpod
from jaxpod.errors import AuthenticationError, SessionError, VersionMismatchError
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import coordinator_pb2_grpc as pb_grpc
from jaxpod.proto import tensors
from jaxpod.service.api.engine_calls import dropped
from jaxpod.service.api.error_mapping import install_error_mapping, no_stop
from jaxpod.service.api.jobs import JobsServicer
from jaxpod.service.api.op_stream import OpStreamServicer
from jaxpod.service.api.stopping import Stopping
from jaxpod.service.api.strategy_methods import ResultStream, StrategyMethodsServicer
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.tokens import LOCAL, Principal, TokenBook
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.sessions import Session, SessionManager
from jaxpod.service.slices.held import HeldSlice
from jaxpod.service.slices.replica_group import OPERATION_TIMEOUT
from jaxpod.shipping import runtime_versions
from jaxpod.timeouts import Cancel

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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


class CoordinatorService(StrategyMethodsServicer, OpStreamServicer, JobsServicer,
                         pb_grpc.CoordinatorServicer):
    """The RPC handlers (the strategy methods' come from :class:`StrategyMethodsServicer`
    and :class:`OpStreamServicer`, the job RPCs from :class:`JobsServicer`).

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
        return await loop.run_in_executor(self._pool, functools.partial(no_stop, fn, *args))

    async def _stream(self, compute: Callable[[], Any]) -> ResultStream:
        skeleton, data = await self._blocking(lambda: tensors.split_result(compute()))
        yield skeleton
        # Copies and waits for the workers run in a thread, not on the event loop.
        while data is not None and (
                chunks := await self._blocking(next, data, None)) is not None:
            for chunk in chunks:  # an empty part is an empty run
                yield chunk

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
            held.drop(dropped(request.dropped))
        return session, held

    def _after(self, request: Any) -> tuple[Session, HeldSlice]:
        """:meth:`_slice` for a call that follows stream operation ``after_op``: waits
        for it (in a worker thread), then lets go of what was dropped."""
        session, held = self._slice(request, drop=False)
        held.wait_applied(request.after_op, OPERATION_TIMEOUT.seconds())
        if request.HasField("dropped"):
            held.drop(dropped(request.dropped))
        return session, held

    async def ClusterStatus(self, request: pb.Empty, context: Any) -> pb.ClusterStatusResponse:
        slices = await self._blocking(self.slices.cluster)
        holders = self.slice_holders()
        return pb.ClusterStatusResponse(
            slices=[pb.ClusterSlice(name=s.name, accelerator_type=s.accelerator_type,
                                    num_hosts=s.num_hosts, holder=holders.get(s.name, ""))
                    for s in slices],
            num_sessions=len(self.sessions), server_version=jaxpod.__version__,
            teams=[pb.TeamShare(**share) for share in self.team_shares()])

    def team_shares(self) -> list[dict[str, Any]]:
        """How the teams share the slices now (empty: no teams, or no jobs)."""
        return self.jobs.dispatcher.team_shares() if self.jobs is not None else []

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


def slice_request(message: pb.AcquireSliceRequest) -> SliceRequest:
    """An ``AcquireSlice`` request as a provider takes it."""
    return SliceRequest(message.accelerator_type, message.num_slices or 1,
                        message.steps_per_run or 1, tuple(message.computation_shape),
                        message.num_replicas, message.timeout_s)


install_error_mapping(CoordinatorService)
