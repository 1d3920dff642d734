"""The operation channel: a direct, authenticated socket from the coordinator to a host
worker.

Ray starts, places and stops the host workers; their operations travel over one
connection per worker instead of as Ray actor tasks: a Unix-domain socket where the
coordinator runs on the worker's machine, else TCP. On a busy host a Ray actor call
costs 1-2 ms (submission, the actor's task queue, the reply through the core worker),
a round trip over an open socket about 0.05 ms; and results, gathered arrays included,
come straight back instead of through the object store.

Both ends prove they hold the group's key (HMAC-SHA256 over each other's random
challenge) before anything is unpickled. Messages are pickles, large buffers out of
band (:mod:`~jaxpod.worker.channel_codec`), sent and received whole
(:mod:`~jaxpod.worker.channel_io`).

A worker listens on TCP and on a Unix socket in the abstract namespace (a random
name; :class:`ChannelAddress` carries both). The coordinator tries the Unix socket
first: it connects only on the worker's machine (in its network namespace). Over it
and only over it, once the peer has proved it holds the key, the worker lets the
process the kernel names as the peer (``SO_PEERCRED``, never a pid the peer claims)
read its memory, for as long as that connection lasts (Yama's ``PR_SET_PTRACER``,
revoked however the connection ends), and a reply's large buffers do not travel at
all: the worker sends where they are and keeps them until its next message arrives,
and the coordinator copies them straight into its ``bytes`` objects
(:mod:`~jaxpod.worker.process_memory`), after reading back a random token to check
that it can. Over TCP nothing is granted and everything travels through the socket.
``JAXPOD_CHANNEL_LEND=0`` (on either end) turns lending off.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpod import settings
from jaxpod.errors import JaxpodError
from jaxpod.worker import process_memory
from jaxpod.worker.channel_codec import decode, encode
from jaxpod.worker.channel_io import read_exactly, receive_encoded, send_encoded

#: How long a connecting peer has to answer the key challenge.
HANDSHAKE_TIMEOUT = settings.CHANNEL_HANDSHAKE_TIMEOUT
_CHALLENGE_BYTES = 32
_OFFER = struct.Struct("<QQ")  # the worker's pid, the address of its token
_UCRED = struct.Struct("@iII")  # SO_PEERCRED's struct ucred: pid, uid, gid
_YES, _NO = b"\x01", b"\x00"


@dataclass(frozen=True)
class ChannelAddress:
    """Where a worker's :class:`ChannelServer` listens (it travels through Ray).

    Attributes:
      host: the address other machines reach the worker at.
      port: its TCP port there.
      unix_path: its Unix socket's name, in the abstract namespace (a leading NUL),
        reachable only on the worker's machine; ``None`` where there is none. An
        address without it reaches the worker as a coordinator elsewhere does.
    """

    host: str
    port: int
    unix_path: str | None = None


class ChannelAuthError(JaxpodError, PermissionError):
    """The other end of an operation channel does not hold the group's key."""


class Connection(socket.socket):
    """An authenticated channel socket, as :func:`connect` opens it."""

    #: The worker's pid where it lends its replies' large buffers in place, else 0.
    lender: int = 0


def new_key() -> bytes:
    """A fresh secret for one group's channels."""
    return secrets.token_bytes(32)


def _prove(sock: socket.socket, key: bytes) -> None:
    """Mutual challenge-response: each end shows it knows ``key``."""
    mine = secrets.token_bytes(_CHALLENGE_BYTES)
    sock.sendall(mine)
    theirs = read_exactly(sock, _CHALLENGE_BYTES)
    sock.sendall(hmac.digest(key, bytes(theirs), hashlib.sha256))
    answer = read_exactly(sock, hashlib.sha256().digest_size)
    if not hmac.compare_digest(bytes(answer), hmac.digest(key, mine, hashlib.sha256)):
        raise ChannelAuthError("The other end of the operation channel failed the "
                               "challenge: it does not hold this group's key.")


def peer_pid(sock: socket.socket) -> int:
    """The pid of a Unix socket's peer as the kernel records it (the connecting
    process, or the listening one), 0 where it is outside this pid namespace."""
    pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                              _UCRED.size))
    return int(pid)


def _borrow(sock: socket.socket) -> int:
    """The coordinator's half of the same-host check, on a Unix connection: the
    worker's pid if this process reads the worker's memory (it read the worker's
    token there), else 0."""
    wanted = process_memory.enabled()
    sock.sendall(_YES if wanted else _NO)
    pid, address = _OFFER.unpack(read_exactly(sock, _OFFER.size))
    token = bytes(read_exactly(sock, _CHALLENGE_BYTES))
    # Read only the process the kernel says is listening, whatever the offer names.
    can = (wanted and pid == peer_pid(sock)
           and process_memory.reads_back(pid, address, token))
    sock.sendall(_YES if can else _NO)
    return pid if can else 0


def _lend(sock: socket.socket) -> int:
    """The worker's half of the same-host check, on a Unix connection whose peer has
    proved it holds the key: grants the peer (by its kernel-reported pid) the reading
    of this process's memory. Returns that pid if the peer reads replies in place (the
    caller revokes the grant when the connection ends), else 0, nothing left granted."""
    wanted = read_exactly(sock, 1) == _YES
    reader = peer_pid(sock)
    granted = (wanted and process_memory.enabled()
               and process_memory.allow_reader(reader))
    token = np.frombuffer(secrets.token_bytes(_CHALLENGE_BYTES), np.uint8).copy()
    borrowed = False
    try:
        sock.sendall(_OFFER.pack(os.getpid() if granted else 0, token.ctypes.data)
                     + token.tobytes())
        borrowed = read_exactly(sock, 1) == _YES and granted
    finally:
        if granted and not borrowed:  # refused, or the peer went away mid-handshake
            process_memory.revoke_reader(reader)
    return reader if borrowed else 0


def connect(address: ChannelAddress, key: bytes, timeout_s: float) -> Connection:
    """Opens and authenticates a channel to a worker's :class:`ChannelServer`: over
    its Unix socket where that connects (the worker is on this machine; only then may
    it lend), else over TCP."""
    sock = _open(address, timeout_s)
    try:
        local = sock.family == socket.AF_UNIX
        if not local:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _prove(sock, key)
        lender = _borrow(sock) if local else 0
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    conn = Connection(fileno=sock.detach())
    conn.setblocking(True)
    conn.lender = lender
    return conn


def _open(address: ChannelAddress, timeout_s: float) -> socket.socket:
    """A connected socket: the Unix one where it connects, else TCP. Only a failed
    Unix connect falls back; what fails after it (the key proof) is the answer."""
    if address.unix_path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(address.unix_path)
            return sock
        except OSError:  # another machine, or another network namespace
            sock.close()
    return socket.create_connection((address.host, address.port), timeout=timeout_s)


def _listen_unix() -> tuple[socket.socket, str] | None:
    """A listening Unix socket under a random abstract name (Linux's: no file to
    leave behind if the worker dies), or ``None`` where there is no such namespace."""
    if not sys.platform.startswith("linux"):
        return None
    name = f"\0jaxpod-channel-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen()
    except OSError:
        sock.close()
        return None
    return sock, name


class ChannelServer:
    """Serves one worker's operations: each message is given to ``handle``, each
    reply is what it returns. One connection at a time (the coordinator's), over TCP
    or over its Unix socket (see the module's docstring); runs on its own daemon
    thread.

    Args:
      host: the address to listen on (the node's address other hosts reach).
      key: the group's secret (``new_key``), given to the worker through Ray.
      handle: runs one operation; must not raise (errors travel as results).
      failed: the reply standing for an exception raised while unpickling a message
        or pickling a result, so the caller hears of it instead of waiting.
    """

    def __init__(self, host: str, key: bytes, handle: Callable[[Any], Any],
                 failed: Callable[[BaseException], Any]) -> None:
        self._key = key
        self._handle = handle
        self._failed = failed
        self._listeners = [socket.create_server((host, 0))]
        unix = _listen_unix()
        if unix is not None:
            self._listeners.append(unix[0])
        self.address = ChannelAddress(host, self._listeners[0].getsockname()[1],
                                      unix[1] if unix is not None else None)
        self._reader: int | None = None
        self._thread = threading.Thread(target=self._serve, name="jaxpod-channel",
                                        daemon=True)
        self._thread.start()

    @property
    def granted_reader(self) -> int | None:
        """The pid the connection being served was granted the reading of this
        process's memory (its Unix peer's), if any."""
        return self._reader

    def _serve(self) -> None:
        while True:
            try:
                ready, _, _ = select.select(self._listeners, [], [])
                sock, _ = ready[0].accept()
            except (OSError, ValueError):  # ValueError: select on a closed socket
                return  # closed
            with sock:
                try:
                    self._serve_connection(sock)
                except Exception:  # one bad connection must not end the serving
                    continue  # that client is gone or out of step; wait for the next

    def _serve_connection(self, sock: socket.socket) -> None:
        local = sock.family == socket.AF_UNIX
        if not local:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A connection that never proves itself must not hold the server.
        sock.settimeout(HANDSHAKE_TIMEOUT.seconds())
        _prove(sock, self._key)  # before anything is granted
        reader = _lend(sock) if local else 0
        self._reader = reader or None
        try:
            sock.settimeout(None)
            reply: tuple[bytes, list[Any]] | None = None
            while True:
                message = receive_encoded(sock, None, writable=True)
                # A lent reply lives until the coordinator has read it, which it has
                # once its next message arrives, unless that was sent ahead of it.
                reply = None
                reply, ahead = self._answer(*message)
                send_encoded(sock, reply[0], reply[1], lend=bool(reader), copy=ahead)
        finally:  # however the connection ends, its reader may read no more
            self._reader = None
            if reader:
                process_memory.revoke_reader(reader)

    def _answer(self, data: bytearray, buffers: list[np.ndarray], streamed: int
                ) -> tuple[tuple[bytes, list[Any]], bool]:
        """The encoded reply, and whether the message said the next one may come
        before the reply is read (its ``ahead``)."""
        ahead = False
        try:
            message = decode(data, buffers, streamed)
            ahead = bool(getattr(message, "ahead", False))
            return encode(self._handle(message)), ahead
        except Exception as e:
            return encode(self._failed(e)), ahead

    def close(self) -> None:
        """Stops accepting (closing alone does not wake a thread blocked waiting for a
        connection); a connection being served ends when its coordinator closes it."""
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
