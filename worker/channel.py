"""The operation channel: a direct, authenticated socket from the coordinator to a host
worker.

Ray starts, places and stops the host workers; their operations travel over one TCP
connection per worker instead of as Ray actor tasks. On a busy host a Ray actor call
costs 1-2 ms (submission, the actor's task queue, the reply through the core worker),
a round trip over an open socket about 0.05 ms; and results, gathered arrays included,
come straight back instead of through the object store.

Both ends prove they hold the group's key (HMAC-SHA256 over each other's random
challenge) before anything is unpickled. Messages are cloudpickle (protocol 5); large
buffers (numpy arrays) travel out of band, each received straight into its own buffer.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from jaxpod.errors import JaxpodError

#: Buffers at least this large travel out of band (no copy into the pickle).
OUT_OF_BAND_BYTES = 64 * 1024
_CHALLENGE_BYTES = 32
_COUNT = struct.Struct("<QQ")  # pickle length, number of out-of-band buffers


class ChannelClosedError(JaxpodError, ConnectionError):
    """The other end of an operation channel went away (its process died, or the group
    was stopped)."""


class ChannelAuthError(JaxpodError, PermissionError):
    """The other end of an operation channel does not hold the group's key."""


def new_key() -> bytes:
    """A fresh secret for one group's channels."""
    return secrets.token_bytes(32)


def broadcast(socks: Sequence[socket.socket], message: Any) -> None:
    """Sends ``message`` (anything cloudpickle takes) on each socket, pickled once."""
    data, buffers = _encode(message)
    for sock in socks:
        _send(sock, data, buffers)


def _encode(message: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < OUT_OF_BAND_BYTES:
            return True  # in band
        buffers.append(buffer)
        return False

    data = cloudpickle.dumps(message, protocol=5, buffer_callback=out_of_band)
    sizes = [b.raw().nbytes for b in buffers]
    header = _COUNT.pack(len(data), len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    return header + data, buffers


def _send(sock: socket.socket, data: bytes, buffers: list[pickle.PickleBuffer]) -> None:
    sock.sendall(data)
    for buffer in buffers:
        sock.sendall(buffer.raw())


def receive(sock: socket.socket) -> Any:
    """The next message (blocks; the socket's time-out applies to each read)."""
    data, buffers = _receive(sock)
    return pickle.loads(data, buffers=buffers)


def _receive(sock: socket.socket) -> tuple[bytearray, list[bytearray]]:
    """One whole message's bytes, so a message that fails to unpickle leaves the
    stream in step."""
    length, count = _COUNT.unpack(_read(sock, _COUNT.size))
    sizes = struct.unpack(f"<{count}Q", _read(sock, 8 * count)) if count else ()
    data = _read(sock, length)
    return data, [_read(sock, n) for n in sizes]


def _read(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        read = sock.recv_into(view[got:], n - got)
        if read == 0:
            raise ChannelClosedError("The operation channel was closed by the other end.")
        got += read
    return buffer


def _prove(sock: socket.socket, key: bytes) -> None:
    """Mutual challenge-response: each end shows it knows ``key``."""
    mine = secrets.token_bytes(_CHALLENGE_BYTES)
    sock.sendall(mine)
    theirs = _read(sock, _CHALLENGE_BYTES)
    sock.sendall(hmac.digest(key, bytes(theirs), hashlib.sha256))
    answer = _read(sock, hashlib.sha256().digest_size)
    if not hmac.compare_digest(bytes(answer), hmac.digest(key, mine, hashlib.sha256)):
        raise ChannelAuthError("The other end of the operation channel failed the "
                               "challenge: it does not hold this group's key.")


def connect(address: tuple[str, int], key: bytes, timeout_s: float) -> socket.socket:
    """Opens and authenticates a channel to a worker's :class:`ChannelServer`."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _prove(sock, key)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


class ChannelServer:
    """Serves one worker's operations: each message is ``handle``'s positional and
    keyword arguments, each reply its result. One connection at a time (the
    coordinator's); runs on its own daemon thread.

    Args:
      host: the address to listen on (the node's address other hosts reach).
      key: the group's secret (``new_key``), given to the worker through Ray.
      handle: runs one operation; must not raise (errors travel as results).
      failed: the reply standing for an exception raised while unpickling a message
        or pickling a result, so the caller hears of it instead of waiting.
    """

    def __init__(self, host: str, key: bytes, handle: Callable[..., Any],
                 failed: Callable[[BaseException], Any]) -> None:
        self._key = key
        self._handle = handle
        self._failed = failed
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="jaxpod-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    _prove(sock, self._key)
                    while True:
                        _send(sock, *self._answer(*_receive(sock)))
                except (ChannelClosedError, ChannelAuthError, OSError):
                    continue  # that client is gone; wait for the next

    def _answer(self, data: bytearray, buffers: list[bytearray]
                ) -> tuple[bytes, list[pickle.PickleBuffer]]:
        try:
            args, kwargs = pickle.loads(data, buffers=buffers)
            return _encode(self._handle(*args, **kwargs))
        except Exception as e:
            return _encode(self._failed(e))

    def close(self) -> None:
        self._listener.close()
