"""Serving the app with uvicorn on the running event loop (beside gRPC).

The socket is bound here first, so the port is known (``--http-port 0``) before the
server starts. ``jaxpod serve`` owns the process's signals: uvicorn's own handlers are
left out, and the service stops this server itself (:meth:`HttpServer.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

#: How long open connections (event streams) get to finish when the service stops.
GRACEFUL_S = 2


class _Server(uvicorn.Server):
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


async def start_http(app: FastAPI, host: str, port: int) -> HttpServer:
    """Binds ``host:port`` and serves ``app`` there as a task of the running loop; returns
    once it accepts connections (its lifespan has started)."""
    sock = bind(host, port)
    # log_config=None: the service's logging stays as `jaxpod serve` set it (uvicorn's
    # own records go to it, warnings and worse only).
    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=GRACEFUL_S,
                            server_header=False)
    server = _Server(config)
    # What uvicorn's Server.serve does, in two halves: start (returns once it listens),
    # then the serving loop and its shutdown as a task.
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    if server.should_exit or not server.started:
        sock.close()
        raise OSError(f"jaxpod serve: the HTTP server on {host}:{port} failed to start "
                      "(see the log above)")

    async def run() -> None:
        await server.main_loop()
        await server.shutdown(sockets=[sock])

    where = sock.getsockname()
    return HttpServer(host=where[0], port=where[1], server=server,
                      task=asyncio.create_task(run(), name="jaxpod-http"))
