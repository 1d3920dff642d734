"""Serving the app with uvicorn on the running event loop (beside gRPC).

The socket is bound here first, so the port is known (``--http-port 0``) before the
server starts. The server runs through uvicorn's documented API: ``Server.serve`` as a
task, waited on until ``Server.started`` is set, stopped by ``should_exit``. ``jaxpod
serve`` owns the process's signals: uvicorn's own handlers are left out (its
``capture_signals`` hook), and the service stops this server itself
(:meth:`HttpServer.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from jaxpod import settings
from jaxpod.timeouts import Deadline

#: How long open connections (event streams) get to finish when the service stops.
GRACEFUL_S = 2
#: How long the server may take to start listening (its app's lifespan startup).
START = settings.HTTP_START_TIMEOUT
#: How often the start is checked (a task that ends wakes the check at once).
START_POLL_S = 0.01


class _Server(uvicorn.Server):
    # The hook uvicorn's serve() installs its SIGINT/SIGTERM handlers through.
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # `jaxpod serve` handles SIGTERM/SIGINT and stops this server


@dataclass
class HttpServer:
    """A running HTTP server: where it listens and its serving task."""

    host: str
    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    Raises:
      OSError: the address cannot be bound; the message names it and what to do.
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
    except OSError as e:
        raise OSError(f"jaxpod serve: cannot listen for HTTP on {host}:{port} ({e}); is the "
                      "port in use? Pass another --http-port (0 picks a free one).") from e
    sock.setblocking(False)
    return sock


async def start_http(app: FastAPI, host: str, port: int, tls: Any = None) -> HttpServer:
    """Binds ``host:port`` and serves ``app`` there as a task of the running loop; returns
    once it accepts connections (its lifespan has started). ``tls``: serve HTTPS with
    its ``cert`` and ``key`` files (a ``jaxpod.service.api.server.TlsFiles``).

    Raises:
      OSError: the address cannot be bound, or the server failed to start (its lifespan
        failed, or it did not start within ``JAXPOD_HTTP_START_TIMEOUT_S``).
    """
    sock = bind(host, port)
    # log_config=None: the service's logging stays as `jaxpod serve` set it (uvicorn's
    # own records go to it, warnings and worse only).
    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=GRACEFUL_S,
                            server_header=False,
                            ssl_certfile=str(tls.cert) if tls else None,
                            ssl_keyfile=str(tls.key) if tls else None)
    server = _Server(config)

    async def serve() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit as e:
            # uvicorn exits the process when the app fails to start; here that ends
            # this task only (a SystemExit would escape the event loop).
            raise OSError(f"jaxpod serve: the HTTP server on {host}:{port} failed to "
                          f"start (exit status {e.code}; see the log above)") from None
        finally:
            sock.close()  # uvicorn closes it on shutdown, not when startup fails

    task = asyncio.create_task(serve(), name="jaxpod-http")
    try:
        await _started(server, task, f"{host}:{port}")
    except BaseException:
        task.cancel()  # it may still be starting (or this wait was cancelled)
        raise
    where = sock.getsockname()
    return HttpServer(host=where[0], port=where[1], server=server, task=task)


async def _started(server: uvicorn.Server, task: asyncio.Task[None], where: str) -> None:
    """Returns once ``server`` accepts connections.

    Raises:
      OSError: ``task`` (the server's ``serve``) ended first, or ``START`` passed.
    """
    deadline = Deadline(START.seconds())
    while not server.started:  # uvicorn tells its start by this flag only
        if task.done():
            failed = None if task.cancelled() else task.exception()
            if isinstance(failed, OSError):
                raise failed
            cause = f" ({failed!r})" if failed else ""
            raise OSError(f"jaxpod serve: the HTTP server on {where} stopped before it "
                          f"started{cause}; see the log above") from failed
        if deadline.expired():
            raise OSError(f"jaxpod serve: the HTTP server on {where} did not start within "
                          f"{deadline.total_s:g} s; set {START.env_var} to wait longer")
        await asyncio.wait({task}, timeout=min(START_POLL_S, deadline.remaining()))
