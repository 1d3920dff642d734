"""``jaxpod serve``: the coordinator's gRPC server.

:func:`create_server` builds and binds the server (port 0 picks a free port, which
tests use); :func:`serve` runs it until SIGTERM/SIGINT, then stops gracefully: new
calls are refused, calls in flight get ``JAXPOD_SHUTDOWN_GRACE_S`` to finish, calls
that only wait on their client or on others (an op stream between batches, a job watch,
an acquire waiting for a slice another session holds) end at once
(:mod:`jaxpod.service.stopping`), and every session's slices are released. Besides the
``Coordinator`` service the server has the standard ``grpc.health.v1`` health service
(``SERVING`` once the cluster is reachable) and server reflection.

With ``http_port`` it also serves the HTTP API, Prometheus metrics and status page
(:mod:`jaxpod.service.http`) on the same event loop, on the gRPC host.

When it is listening, ``serve`` prints one line to stdout,
``JAXPOD_LISTENING {"address": "127.0.0.1:50051", "http": "127.0.0.1:8080", "pid":
...}``, which is how a parent process that started it with ``--port 0`` learns the
ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxpod.errors import (
    AllocationTimeoutError,
    AuthenticationError,
    JaxpodError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import coordinator_pb2_grpc as pb_grpc
from jaxpod.proto import tensors
from jaxpod.proto.tensors import channel_options
from jaxpod.service import roles
from jaxpod.service.coordinator import (
    CoordinatorService,
    SliceProvider,
    request_deserializer,
)
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.jobs.store import JobStore
from jaxpod.service.quotas import SliceQuotas
from jaxpod.service.resolvers.base import ALLOCATION_TIMEOUT
from jaxpod.service.sessions import SessionManager
from jaxpod.service.status import status_of
from jaxpod.service.stopping import Cancel
from jaxpod.service.tokens import TokenBook, denial
from jaxpod.timeouts import Deadline, Timeout

logger = logging.getLogger(__name__)

LISTENING = "JAXPOD_LISTENING"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
SHUTDOWN_GRACE = Timeout("JAXPOD_SHUTDOWN_GRACE_S", 10.0)
#: How long a cluster status call that arrives while the service is still connecting to
#: its cluster waits for it (under the client's ``JAXPOD_CONTROL_TIMEOUT_S``, 30 s, so
#: the client sees this error, which names the knob, rather than its own deadline).
#: Acquiring a slice waits within the allocation's own time-out instead.
CLUSTER_READY_TIMEOUT = Timeout("JAXPOD_CLUSTER_READY_TIMEOUT_S", 20.0)


class _Authorize(grpc.aio.ServerInterceptor):
    """Identifies each call's token and refuses it before any handler runs:
    ``UNAUTHENTICATED`` without a known token, ``PERMISSION_DENIED`` when its role is
    below the one :data:`jaxpod.service.roles.RPC_ROLES` names for the method (or the
    method is not in that table). Health and reflection are open.

    Tokens are looked up by their SHA-256 (:meth:`TokenBook.identify`), so response
    times do not leak them.
    """

    def __init__(self, tokens: TokenBook, audit: Callable[..., None] | None = None) -> None:
        self._tokens = tokens
        self._audit = audit  # records refusals: (who, "refused", method, why)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        method = details.method or ""
        try:
            needed = roles.rpc_role(method)
        except KeyError:
            return _refuse(await continuation(details), PermissionDeniedError(
                f"{method} has no role in this service's role table, so no token may call "
                "it."))
        if needed is None:
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("authorization")
        who = self._tokens.identify_bearer(given)
        if who is None:
            return _refuse(await continuation(details), _unknown_token(given is not None))
        if not who.may(needed):
            name = method.rsplit("/", 1)[-1]
            refusal = PermissionDeniedError(denial(who, needed, name))
            if self._audit is not None:  # it never raises: the refusal stands
                await asyncio.to_thread(self._audit, who.name, "refused", name, str(refusal))
            return _refuse(await continuation(details), refusal)
        return await continuation(details)


#: gRPC's method handler factory by (request streaming, response streaming).
_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


def _unknown_token(token_given: bool) -> AuthenticationError:
    return AuthenticationError(
        "The jaxpod service refused the token this call carried: it is none of the tokens "
        "the service accepts. Pass yours to jaxpod.connect(token=...) or set JAXPOD_TOKEN "
        "to it." if token_given else
        "The jaxpod service requires a token and this call carried none: pass "
        "jaxpod.connect(token=...) or set JAXPOD_TOKEN to your token.")


def _refuse(handler: Any, error: Exception) -> Any:
    code, details, trailers = status_of(error)

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_trailing_metadata(trailers)
        await context.abort(code, details)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(request, context)
        yield  # pragma: no cover

    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(abort_stream if handler.response_streaming else abort,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def coordinator_handlers(service: pb_grpc.CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The ``Coordinator`` service's handlers, as the generated
    ``add_CoordinatorServicer_to_server`` makes them, except that result streams may
    yield data chunks already serialized (:func:`tensors.split_result`)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        request, response = (getattr(pb, t.name) for t in (method.input_type,
                                                           method.output_type))
        serialize = (tensors.serialize_chunk if response is pb.ResultChunk
                     else response.SerializeToString)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=request_deserializer(method.name,
                                                                               request),
                                     response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


@dataclass(frozen=True)
class TlsFiles:
    """The service's TLS certificate chain and private key (PEM files)."""

    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def create_server(address: str, service: pb_grpc.CoordinatorServicer,
                  tokens: TokenBook | None = None,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                  tls: TlsFiles | None = None
                  ) -> tuple[grpc.aio.Server, int, health_async.HealthServicer]:
    """Builds the server with every service on it and binds ``address``.

    Args:
      address: ``host:port``; port 0 picks a free one.
      service: the coordinator.
      tokens: when set, every coordinator call must carry one of them as a bearer
        token, of a role its method allows (``None``: open, loopback only).
      interceptors: run before the token check (the RPC timer of ``/metrics``).
      tls: serve over TLS with this certificate (``None``: plain text).

    Returns:
      The (not yet started) server, the bound port and its health servicer (set it
      ``NOT_SERVING`` until the cluster is reachable: it starts out ``SERVING``).
    """
    audit = getattr(service, "audit", None)
    chain = [*interceptors, *([_Authorize(tokens, audit)] if tokens is not None else [])]
    server = grpc.aio.server(options=channel_options(), interceptors=chain)
    server.add_generic_rpc_handlers((coordinator_handlers(service),))
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port = (server.add_secure_port(address, tls.credentials()) if tls is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"jaxpod serve: cannot listen on {address}; is the port in use?")
    return server, port, health


async def _set_serving(health: health_async.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        await health.set(name, status)


async def serve(address: str, make_slices: Callable[[], SliceProvider],
                tokens: TokenBook | None = None, lease_s: float | None = None,
                on_listening: Callable[..., None] | None = None,
                stop_on_stdin_eof: bool = False, state_dir: Path | None = None,
                http_port: int | None = None, checkpoint_dir: str | None = None,
                tls: TlsFiles | None = None) -> None:
    """Runs the coordinator until SIGTERM or SIGINT, then stops gracefully.

    Args:
      address: where to listen.
      make_slices: connects to the cluster (may take a while: the health service says
        ``NOT_SERVING`` until it returns).
      tokens: the tokens it accepts and their roles (``None``: open, loopback only).
      lease_s: the default session lease (else ``JAXPOD_SESSION_LEASE_S``).
      on_listening: called once bound with the gRPC ``host:port`` and, when HTTP is
        served, the HTTP one as its second argument.
      stop_on_stdin_eof: also stop when stdin closes (the parent that started this
        service as its child exited, however it exited).
      state_dir: where the job store lives (``None``: the service takes no jobs).
      http_port: serve the HTTP API, metrics and page on this port of the gRPC host
        (0 picks a free one; ``None``: no HTTP), guarded by the same token.
      checkpoint_dir: where the hosts write job checkpoints (``None``:
        ``<state_dir>/checkpoints``).
      tls: serve gRPC and HTTP over TLS with this certificate.
    """
    sessions = SessionManager(lease_s)
    quotas = SliceQuotas(tokens, sessions)
    provider = _DeferredSlices()
    store = JobStore(state_dir) if state_dir is not None else None
    jobs = (JobManager(store, provider, checkpoint_dir, quotas=quotas)
            if store is not None else None)
    service = CoordinatorService(provider, sessions, jobs=jobs, tokens=tokens, quotas=quotas,
                                 checkpoint_dir=checkpoint_dir)
    grpc_serving = False
    backend = None
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if http_port is not None:
        from jaxpod.service.http.backend import Backend  # FastAPI: only when serving HTTP
        from jaxpod.service.http.metrics import ServiceMetrics

        backend = Backend(service, provider.state, provider.snapshot, lambda: grpc_serving,
                          metrics=ServiceMetrics())
        backend.metrics.watch(backend)
        interceptors.append(backend.metrics.interceptor())
    server, port, health = create_server(address, service, tokens, interceptors, tls)
    await _set_serving(health, False)  # the health service starts out SERVING
    await server.start()
    host = address.rsplit(":", 1)[0]
    http = None
    if backend is not None and http_port is not None:
        from jaxpod.service.http.app import create_app
        from jaxpod.service.http.server import start_http

        try:
            http = await start_http(create_app(backend, tokens), host, http_port, tls)
        except BaseException:
            await server.stop(None)
            raise
        logger.info("jaxpod serve: HTTP dashboard on %s://%s/",
                    "https" if tls else "http", http.address)
    if on_listening:
        if http is not None:
            on_listening(f"{host}:{port}", http.address)
        else:
            on_listening(f"{host}:{port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop_on_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    stop_on_signals()
    if stop_on_stdin_eof:
        loop.add_reader(sys.stdin.fileno(), _stop_on_eof, stop)
    reaper = asyncio.create_task(_reap(service, stop))
    if jobs is not None:
        jobs.start()  # queued jobs wait for the cluster like acquires do
        logger.info("jobs kept in %s", store.path if store else None)
    try:
        try:
            target = await asyncio.to_thread(make_slices)
        except BaseException as e:
            provider.failed(e)  # wakes the calls waiting for the cluster, naming why
            raise
        provider.ready(target)
        # What start-up built (JAX, Ray, gRPC, FastAPI: ~10^5 objects that live as long
        # as the process) leaves the collector's view: a full collection scanned them
        # all, a pause of 0.1-0.3 s of every call, request and job loop in the process.
        gc.collect()
        gc.freeze()
        stop_on_signals()  # again: ray.init installs a SIGTERM handler that aborts 3 s in
        await _set_serving(health, True)
        grpc_serving = True
        logger.info("jaxpod serve: ready on %s:%d", host, port)
        await stop.wait()
    finally:
        logger.info("jaxpod serve: stopping (grace %.0fs)", SHUTDOWN_GRACE.seconds())
        provider.failed(ServiceUnavailableError(
            "the service was stopped (SIGTERM/SIGINT, or its parent exited) before its "
            "cluster was up"))
        grpc_serving = False
        if http is not None and backend is not None:  # first: its event streams end
            backend.stopping.set()
            await http.stop()
        await health.enter_graceful_shutdown()
        service.stopping.stop()  # calls waiting on their clients end now, not at the grace
        await server.stop(SHUTDOWN_GRACE.seconds())
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await service.close_all()
        if store is not None:
            store.close()


def _stop_on_eof(stop: asyncio.Event) -> None:
    if not os.read(sys.stdin.fileno(), 4096):
        asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
        stop.set()


class _DeferredSlices:
    """The slice provider once the cluster is up.

    The service listens before its cluster is ready (a local one takes seconds to
    start). Calls that arrive in that window wait for it, each within its own time-out
    (an acquire within its allocation time-out, which then covers the wait plus the
    allocation), on an event set when the cluster is up or failed to come up; if it
    failed, they fail naming why.
    """

    def __init__(self) -> None:
        self._settled = threading.Event()
        self._target: SliceProvider | None = None
        self._failure: BaseException | None = None

    def state(self) -> str:
        """``"connecting"``, ``"ready"`` or ``"failed"``."""
        if not self._settled.is_set():
            return "connecting"
        return "ready" if self._target is not None else "failed"

    @property
    def target(self) -> SliceProvider | None:
        """The provider, once the cluster is up (``None`` until then)."""
        return self._target

    def ready(self, target: SliceProvider) -> None:
        """The cluster is up: calls waiting for it go on to ``target``."""
        if not self._settled.is_set():
            self._target = target
            self._settled.set()

    def failed(self, error: BaseException) -> None:
        """The cluster did not come up (or the service is stopping first): calls waiting
        for it, and later ones, fail naming ``error``. No effect once ready."""
        if not self._settled.is_set():
            self._failure = error
            self._settled.set()

    def _wait(self, deadline: Deadline, what: str, limit: str, knob: str,
              late: type[JaxpodError]) -> SliceProvider:
        """The provider, once ready; ``late`` when ``deadline`` passes first (``limit``
        says what set it, ``knob`` what to raise)."""
        if not self._settled.wait(deadline.remaining()):
            raise late(
                f"{what}: the jaxpod service was still connecting to its cluster after "
                f"{deadline.total_s:g}s ({limit}); expected it ready by then. See the "
                f"service's log for what it is waiting on, or raise {knob}.")
        if self._target is None:
            error = self._failure
            raise ServiceUnavailableError(
                f"{what}: the jaxpod service's cluster did not come up "
                f"({type(error).__name__}: {error}), so it cannot hand out slices. Fix the "
                f"cause named here (more in the service's log) and start `jaxpod serve` "
                f"again.")
        return self._target

    def acquire(self, request: pb.AcquireSliceRequest, slice_id: str,
                cancel: Cancel | None = None) -> Any:
        if self._target is not None:
            return self._target.acquire(request, slice_id, cancel)
        deadline = Deadline(ALLOCATION_TIMEOUT.resolve(request.timeout_s or None))
        target = self._wait(
            deadline, f"acquiring a {request.accelerator_type or '?'} slice",
            f"the acquire's time-out: its timeout_s, else {ALLOCATION_TIMEOUT.env_var}, "
            f"default {ALLOCATION_TIMEOUT.default_s:g}s",
            f"{ALLOCATION_TIMEOUT.env_var} or pass timeout_s", AllocationTimeoutError)
        # The allocation gets what is left of the acquire's time-out.
        waited = pb.AcquireSliceRequest()
        waited.CopyFrom(request)
        waited.timeout_s = max(deadline.remaining(), 1e-3)
        return target.acquire(waited, slice_id, cancel)

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        """False until the cluster is up (a job then waits in its queue)."""
        return self._target is not None and self._target.has_free(accelerator_type,
                                                                   num_slices)

    def cluster(self) -> list[pb.ClusterSlice]:
        if self._target is not None:
            return self._target.cluster()
        timeout = CLUSTER_READY_TIMEOUT
        return self._wait(
            Deadline(timeout.seconds()), "cluster status",
            f"{timeout.env_var}, default {timeout.default_s:g}s", timeout.env_var,
            ServiceUnavailableError).cluster()

    def snapshot(self) -> Sequence[Any]:
        """The cluster's slices with their hosts (for the page); only once ready."""
        if self._target is None:
            raise ServiceUnavailableError("the cluster is not up yet")
        return self._target.snapshot()

    def close(self) -> None:
        if self._target is not None:
            self._target.close()


async def _reap(service: CoordinatorService, stop: asyncio.Event) -> None:
    interval = max(0.05, min(1.0, service.sessions.default_lease_s / 4))
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
        try:
            await service.reap_expired()
        except Exception:  # a failed release must not stop the reaper
            logger.exception("reaping expired sessions failed")
