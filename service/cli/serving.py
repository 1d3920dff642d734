"""The ``jaxpod serve`` process: the gRPC server, the HTTP dashboard, the sessions, the
jobs and the slice provider, on one event loop until SIGTERM/SIGINT.

:func:`serve` runs the coordinator, then stops gracefully: new calls are refused, calls
in flight get ``JAXPOD_SHUTDOWN_GRACE_S`` to finish, calls that only wait on their
client or on others (an op stream between batches, a job watch, an acquire waiting for
a slice another session holds) end at once (:mod:`jaxpod.service.api.stopping`), and
every session's slices are released. With ``http_port`` it also serves the HTTP API,
Prometheus metrics and status page (:mod:`jaxpod.service.http`) on the same event
loop, on the gRPC host.

When it is listening, it calls ``on_listening`` (``jaxpod serve`` prints one line to
stdout, ``JAXPOD_LISTENING {"address": "127.0.0.1:50051", "http": "127.0.0.1:8080",
"pid": ...}``, which is how a parent process that started it with ``--port 0`` learns
the ports).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import grpc.aio

from jaxpod import settings
from jaxpod.errors import ServiceUnavailableError
from jaxpod.service.api.coordinator import CoordinatorService, SliceProvider
from jaxpod.service.api.server import TlsFiles, create_server, set_serving
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.tokens import TokenBook
from jaxpod.service.capacity.deferred import DeferredSlices
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.jobs.retention import RetentionPolicy
from jaxpod.service.jobs.store import JobStore
from jaxpod.service.sessions import SessionManager

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE = settings.SHUTDOWN_GRACE


async def serve(address: str, make_slices: Callable[[], SliceProvider],
                tokens: TokenBook | None = None, lease_s: float | None = None,
                on_listening: Callable[..., None] | None = None,
                stop_on_stdin_eof: bool = False, state_dir: Path | None = None,
                http_port: int | None = None, checkpoint_dir: str | None = None,
                tls: TlsFiles | None = None, provider_kind: str = "ray",
                retention: RetentionPolicy | None = None) -> None:
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
      provider_kind: what ``make_slices`` connects to, ``"ray"`` or ``"processes"``
        (the name of ``/readyz``'s check of it).
      retention: what is kept of finished jobs (``None``: the settings').
    """
    sessions = SessionManager(lease_s)
    quotas = SliceQuotas(tokens, sessions)
    provider = DeferredSlices()
    store = JobStore(state_dir) if state_dir is not None else None
    jobs = (JobManager(store, provider, checkpoint_dir, quotas=quotas, retention=retention,
                       teams=tokens.teams if tokens is not None else None)
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
                          metrics=ServiceMetrics(), provider_kind=provider_kind)
        backend.metrics.watch(backend)
        interceptors.append(backend.metrics.interceptor())
    server, port, health = create_server(address, service, tokens, interceptors, tls)
    await set_serving(health, False)  # the health service starts out SERVING
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
        await set_serving(health, True)
        grpc_serving = True
        logger.info("jaxpod serve: ready on %s:%d", host, port)
        await stop.wait()  # bounded: the service serves until told to stop
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


async def _reap(service: CoordinatorService, stop: asyncio.Event) -> None:
    interval = max(0.05, min(1.0, service.sessions.default_lease_s / 4))
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)  # bounded: timeout
        try:
            await service.reap_expired()
        except Exception:  # a failed release must not stop the reaper
            logger.exception("reaping expired sessions failed")
