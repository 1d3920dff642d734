"""The operation channel: a direct, authenticated socket from the coordinator to a host
worker.

Ray starts, places and stops the host workers; their operations travel over one TCP
connection per worker instead of as Ray actor tasks. On a busy host a Ray actor call
costs 1-2 ms (submission, the actor's task queue, the reply through the core worker),
a round trip over an open socket about 0.05 ms; and results, gathered arrays included,
come straight back instead of through the object store.

Both ends prove they hold the group's key (HMAC-SHA256 over each other's random
challenge) before anything is unpickled. Messages are cloudpickle (protocol 5); large
buffers (numpy arrays) travel out of band, each received straight into its own buffer:
writable numpy memory on the worker's side, ``bytes`` on the coordinator's, which can
forward a buffer it received (a framed piece of a gathered array) without a copy.
:class:`~jaxpod.framing.Segments` travel out of band too, as one buffer sent from
several (a piece's header and a view of the rows), so neither end copies them.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from jaxpod.errors import JaxpodError
from jaxpod.framing import Segments
from jaxpod.timeouts import Timeout

#: How long a connecting peer has to answer the key challenge.
HANDSHAKE_TIMEOUT = Timeout("JAXPOD_CHANNEL_HANDSHAKE_TIMEOUT_S", 10.0)
#: Buffers at least this large travel out of band (no copy into the pickle).
OUT_OF_BAND_BYTES = 64 * 1024
_CHALLENGE_BYTES = 32
#: pickle length, number of out-of-band buffers: pickle's own, then Segments
_COUNT = struct.Struct("<QQQ")
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO's struct timeval


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
    send(socks, encode(message))


def send(socks: Sequence[socket.socket], encoded: tuple[bytes, list[Any]]) -> None:
    """Sends a message :func:`encode` made on each socket."""
    for sock in socks:
        _send(sock, *encoded)


class _Pickler(cloudpickle.Pickler):
    """Takes :class:`Segments` out of the pickle (as persistent ids, resolved by the
    receiving :class:`_Unpickler`) so that they travel out of band, unjoined."""

    def __init__(self, file: io.BytesIO, buffers: list[Any]) -> None:
        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            if buffer.raw().nbytes < OUT_OF_BAND_BYTES:
                return True  # in band
            buffers.append(buffer.raw())
            return False

        super().__init__(file, protocol=5, buffer_callback=out_of_band)
        self.segmented: list[Segments] = []

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is not Segments:
            return None
        self.segmented.append(obj)
        return len(self.segmented) - 1


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: Any, buffers: list[Any], segmented: list[Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._segmented = segmented

    def persistent_load(self, pid: Any) -> Any:
        return self._segmented[pid]


def encode(message: Any) -> tuple[bytes, list[Any]]:
    """The message's header and pickle; then what travels out of band, in order:
    pickle's buffers (memoryviews) and :class:`Segments`. Raises whatever pickling
    raises, before anything is sent."""
    buffers: list[Any] = []
    file = io.BytesIO()
    pickler = _Pickler(file, buffers)
    pickler.dump(message)
    data = file.getvalue()
    sizes = [b.nbytes for b in buffers] + [s.nbytes for s in pickler.segmented]
    header = (_COUNT.pack(len(data), len(buffers), len(pickler.segmented))
              + struct.pack(f"<{len(sizes)}Q", *sizes))
    return header + data, buffers + pickler.segmented


def _send(sock: socket.socket, data: bytes, buffers: list[Any]) -> None:
    sock.sendall(data)
    for buffer in buffers:
        for part in buffer.parts if type(buffer) is Segments else (buffer,):
            sock.sendall(part)


def _loads(data: Any, buffers: list[Any], segmented: int) -> Any:
    """Unpickles a received message; its last ``segmented`` buffers were Segments."""
    split = len(buffers) - segmented
    return _Unpickler(data, buffers[:split], buffers[split:]).load()


def receive(sock: socket.socket, deadline: float | None = None) -> Any:
    """The next reply (blocks; after ``deadline``, a ``time.monotonic()`` time, raises
    ``TimeoutError``). Its out-of-band buffers come as ``bytes``, each received straight
    into place, so arrays in it are read-only."""
    try:
        received = _receive(sock, deadline, writable=False)
    except BlockingIOError:  # the kernel's receive limit (see _limit) ran out
        raise TimeoutError("The operation channel's deadline passed.") from None
    finally:
        if deadline is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(0, 0))
    return _loads(*received)


def _receive(sock: socket.socket, deadline: float | None, writable: bool
             ) -> tuple[bytearray, list[Any], int]:
    """One whole message's bytes, so a message that fails to unpickle leaves the
    stream in step: the pickle, the out-of-band buffers, how many of those (the last
    ones) were Segments. Out-of-band buffers are ``writable`` numpy memory (not
    zeroed first, unlike a bytearray, and on huge pages when large) or ``bytes``."""
    length, plain, segmented = _COUNT.unpack(_read(sock, _COUNT.size, deadline))
    count = plain + segmented
    sizes = struct.unpack(f"<{count}Q", _read(sock, 8 * count, deadline)) if count else ()
    data = _read(sock, length, deadline)
    if writable:
        buffers = [_read(sock, n, deadline, np.empty(n, np.uint8)) for n in sizes]
    else:
        buffers = [_read_bytes(sock, n, deadline) for n in sizes]
    return data, buffers, segmented


def _read(sock: socket.socket, n: int, deadline: float | None = None, into: Any = None
          ) -> Any:
    buffer = bytearray(n) if into is None else into
    view = memoryview(buffer).cast("B")
    got = 0
    while got < n:
        _limit(sock, deadline)
        got += _checked(sock.recv_into(view[got:], n - got))
    return buffer


def _read_bytes(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes as one ``bytes`` object, received straight into it (a blocking
    receive waits for all of them) when no time-out or signal cuts it short."""
    pieces = []
    while n > 0:
        _limit(sock, deadline)
        piece = sock.recv(n, socket.MSG_WAITALL)
        n -= _checked(len(piece))
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _checked(received: int) -> int:
    if received == 0:
        raise ChannelClosedError("The operation channel was closed by the other end.")
    return received


def _limit(sock: socket.socket, deadline: float | None) -> None:
    """Bounds the next receive by ``deadline``. The socket stays blocking (a time-out
    in Python would make it non-blocking, and a non-blocking receive returns whatever
    has arrived instead of filling its buffer); the kernel applies the limit."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("The operation channel's deadline passed.")
    seconds = int(left)
    micros = max(int((left - seconds) * 1e6), 0 if seconds else 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(seconds, micros))


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
                    # A connection that never proves itself must not hold the server.
                    sock.settimeout(HANDSHAKE_TIMEOUT.seconds())
                    _prove(sock, self._key)
                    sock.settimeout(None)
                    while True:
                        _send(sock, *self._answer(*_receive(sock, None, writable=True)))
                except (ChannelClosedError, ChannelAuthError, OSError):
                    continue  # that client is gone; wait for the next

    def _answer(self, data: bytearray, buffers: list[np.ndarray], segmented: int
                ) -> tuple[bytes, list[Any]]:
        try:
            args, kwargs = _loads(data, buffers, segmented)
            return encode(self._handle(*args, **kwargs))
        except Exception as e:
            return encode(self._failed(e))

    def close(self) -> None:
        self._listener.close()
