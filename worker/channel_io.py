"""Encoded messages over an operation channel's socket.

Each message goes whole, its out-of-band buffers after the pickle, each received
straight into its own buffer: writable numpy memory on the worker's side, ``bytes``
on the coordinator's, which can forward a buffer it received (a piece of a gathered
array) without a copy. From a worker that lends (see :mod:`~jaxpod.worker.channel`),
a reply's large buffers do not travel: it sends where they are, and the coordinator
copies them straight into its ``bytes`` objects (:mod:`~jaxpod.worker.process_memory`).
Receives are bounded by deadlines the kernel applies; the coordinator reads every
host's reply to an operation in host order while watching the later hosts' channels
(:class:`ReplyWatch`).
"""

from __future__ import annotations

import select
import socket
import struct
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpod.errors import JaxpodError
from jaxpod.pieces import PieceLayout, Pieces
from jaxpod.worker import process_memory
from jaxpod.worker.channel_codec import HEADER, OUT_OF_BAND_BYTES, Decoded, decode, encode

_PID = struct.Struct("<Q")
_LENT = struct.Struct("<QQQQ")  # buffer index, offset in it, address, length
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO's struct timeval
# Combined once: ``|`` on the socket module's flags is an enum operation in Python,
# and a coordinator checks every host's channel per operation.
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_POLL_EVENTS = select.POLLIN | select.POLLHUP | select.POLLERR


class ChannelClosedError(JaxpodError, ConnectionError):
    """The other end of an operation channel went away (its process died, or the group
    was stopped)."""


class PeerClosedError(ChannelClosedError):
    """Channel ``index`` of a group closed while the coordinator waited on another
    host's reply (see :class:`ReplyWatch`)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"operation channel {index} closed")
        self.index = index


def broadcast(socks: Sequence[socket.socket], message: Any) -> None:
    """Sends ``message`` (anything cloudpickle takes) on each socket, pickled once."""
    send(socks, encode(message))


def send(socks: Sequence[socket.socket], encoded: tuple[bytes, list[Any]]) -> None:
    """Sends a message :func:`encode` made on each socket."""
    for sock in socks:
        send_encoded(sock, *encoded)


def send_encoded(sock: socket.socket, data: bytes, buffers: list[Any], lend: bool = False,
                 copy: bool = False) -> None:
    """Sends an encoded message. With ``lend`` (a lending connection), large parts of
    its buffers go as where they are (the receiver reads them in place; the caller
    keeps them), unless ``copy``: then all go inline, in the lending format."""
    sock.sendall(data)
    if lend:
        lent, inline = [], []
        for i, buffer in enumerate(buffers):
            if buffer.nbytes >= OUT_OF_BAND_BYTES and not copy:
                lent.append(_LENT.pack(i, 0, process_memory.address_of(buffer),
                                       buffer.nbytes))
            else:
                inline.append(buffer)
        # Inline buffers are small (under OUT_OF_BAND_BYTES each): one send.
        sock.sendall(b"".join([_PID.pack(len(lent)), *lent, *inline]))
        return
    for buffer in buffers:
        sock.sendall(buffer)


def receive(sock: socket.socket, deadline: float | None = None,
            layout: PieceLayout | None = None, decoded: Decoded | None = None) -> Any:
    """The next reply (blocks; after ``deadline``, a ``time.monotonic()`` time, raises
    ``TimeoutError``). Its out-of-band buffers come as ``bytes``, each received straight
    into place, so arrays in it are read-only; with a ``layout``, :class:`Streamed`
    buffers come as :class:`Pieces` cut that way. With ``decoded``, a reply equal to
    the last one it decoded is that one's object."""
    try:
        received = receive_encoded(sock, deadline, writable=False,
                                   lender=getattr(sock, "lender", 0), layout=layout)
    except (ValueError, IndexError, struct.error, MemoryError) as e:
        # Part of a message is still unread: what follows is out of step.
        raise ChannelClosedError(f"The operation channel's message was malformed or "
                                 f"too large to receive: {e!r}.") from e
    return (decoded or decode)(*received)


class ReplyWatch:
    """Waits for each host's reply to one operation in turn, watching the later hosts'
    channels meanwhile: raises :class:`PeerClosedError` as soon as one of those closes.

    Replies are read in host order, but a host whose peer died may sit in a collective
    waiting for it until the collective's own time-out (minutes): waiting on that host
    alone would hide the dead one for as long. A channel seen with a reply waiting is
    fine (it is read in its turn) and is watched no more. One poll set serves the whole
    operation: built again at each turn it cost hosts² registrations per operation, and
    a turn whose reply was already seen takes no system call.
    """

    def __init__(self, socks: Sequence[socket.socket]) -> None:
        self._socks = socks
        self._poller = select.poll()
        self._watching: dict[int, int] = {}  # fd -> index
        self._ready: set[int] = set()
        for index, sock in enumerate(socks):
            fd = sock.fileno()
            self._watching[fd] = index
            self._poller.register(fd, _POLL_EVENTS)

    def wait(self, turn: int, deadline: float | None = None) -> None:
        """Returns once ``socks[turn]``'s reply starts to arrive (or its channel closed:
        reading it says so). Turns come in order, each once."""
        while turn not in self._ready:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("The operation channel's deadline passed.")
            for fd, _ in self._poller.poll(
                    None if remaining is None else max(1, int(remaining * 1000))):
                index = self._watching.pop(fd)
                self._poller.unregister(fd)
                if turn < index and _closed(self._socks[index]):
                    raise PeerClosedError(index)
                self._ready.add(index)
        self._ready.discard(turn)


def read_replies(socks: Sequence[socket.socket], deadline: float | None,
                 layout: PieceLayout | None, into: list[Any], decoded: Decoded | None
                 ) -> list[tuple[int, Exception]]:
    """Reads each host's reply to one operation, in host order, into ``into``
    (``decoded``: the operation's :class:`Decoded`; ``None``: each reply decoded); a
    reply that did not unpickle is ``None`` there, and returned with its error (it was
    read whole: the stream is in step). Raises ``TimeoutError`` or ``OSError`` with
    what came before in ``into``."""
    watch = ReplyWatch(socks)
    unreadable: list[tuple[int, Exception]] = []
    for host, sock in enumerate(socks):
        watch.wait(host, deadline)
        try:
            into.append(receive(sock, deadline, layout, decoded))
        except (TimeoutError, OSError):
            raise
        except Exception as e:
            into.append(None)
            unreadable.append((host, e))
    return unreadable


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (nothing is consumed)."""
    try:
        return sock.recv(1, _PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def receive_encoded(sock: socket.socket, deadline: float | None, writable: bool,
                    lender: int = 0, layout: PieceLayout | None = None
                    ) -> tuple[bytearray, list[Any], int]:
    """One whole message's bytes, so a message that fails to unpickle leaves the
    stream in step: the pickle, the out-of-band buffers, how many of those (the last
    ones) were Streamed. Out-of-band buffers are ``writable`` numpy memory (not
    zeroed first, unlike a bytearray, and on huge pages when large) or ``bytes``
    (Streamed ones as :class:`Pieces` under a ``layout``); from a ``lender`` (its
    pid), with their large parts read in place."""
    length, plain, streamed = HEADER.unpack(read_exactly(sock, HEADER.size, deadline))
    count = plain + streamed
    sizes = struct.unpack(f"<{count}Q", read_exactly(sock, 8 * count, deadline)) if count else ()
    data = read_exactly(sock, length, deadline)
    if writable:
        return data, [read_exactly(sock, n, deadline, np.empty(n, np.uint8)) for n in sizes], \
            streamed
    places = [_Place(n, layout if i >= plain else None) for i, n in enumerate(sizes)]
    if not lender:
        for place in places:
            for view in place.views:
                read_exactly(sock, view.nbytes, deadline, view)
        return data, [p.received() for p in places], streamed
    (lent_count,) = _PID.unpack(read_exactly(sock, _PID.size, deadline))
    lent: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    for i, offset, address, n in _LENT.iter_unpack(
            read_exactly(sock, _LENT.size * lent_count, deadline)):
        lent[i].append((offset, address, n))
    reads: list[tuple[memoryview, int]] = []
    for place, spans in zip(places, lent, strict=True):  # the rest came inline
        at = 0
        for offset, address, n in [*spans, (place.nbytes, 0, 0)]:
            if not at <= offset <= offset + n <= place.nbytes:
                raise ChannelClosedError(  # the stream cannot be in step after this
                    f"The worker lent a span of {n} bytes at offset {offset} of a "
                    f"{place.nbytes}-byte buffer, after offset {at}.")
            for view, _ in place.spans(at, offset):
                read_exactly(sock, view.nbytes, deadline, view)
            reads += [(view, address + skip) for view, skip in place.spans(offset, offset + n)]
            at = offset + n
    try:
        process_memory.read_into(lender, reads)
    except OSError as e:  # the stream is in step; the worker is most likely gone
        raise ChannelClosedError(
            f"Could not read the reply's buffers in the worker's memory: {e}.") from e
    return data, [p.received() for p in places], streamed


class _Place:
    """Where one out-of-band buffer of ``nbytes`` is received: one ``bytes`` object,
    or, under a ``layout``, one per piece behind its prefix."""

    def __init__(self, nbytes: int, layout: PieceLayout | None) -> None:
        self.nbytes = nbytes
        self._layout = layout
        self._objects: list[bytes] = []
        self.views: list[memoryview] = []  # where the buffer's bytes go, in order
        for n in (layout.cut(nbytes) if layout is not None else [nbytes]):
            prefix = layout.prefix(n) if layout is not None else b""
            obj, view = process_memory.new_bytes(len(prefix) + n)
            view[:len(prefix)] = prefix
            self._objects.append(obj)
            self.views.append(view[len(prefix):])

    def spans(self, start: int, end: int) -> list[tuple[memoryview, int]]:
        """The views of the buffer's bytes ``[start, end)``, each with its distance
        from ``start``."""
        out, at = [], 0
        for view in self.views:
            lo, hi = max(start, at), min(end, at + view.nbytes)
            if lo < hi:
                out.append((view[lo - at:hi - at], lo - start))
            at += view.nbytes
        return out

    def received(self) -> bytes | Pieces:
        if self._layout is None:
            return self._objects[0]
        return Pieces(self._objects, self.nbytes)


def read_exactly(sock: socket.socket, n: int, deadline: float | None = None,
                 into: Any = None) -> Any:
    """``n`` bytes, received straight into ``into`` (default: a new bytearray). A
    blocking receive waits for all of them, unless a time-out or signal cuts it short."""
    buffer = bytearray(n) if into is None else into
    view = memoryview(buffer).cast("B")
    got, exact = 0, False
    while got < n:
        _limit(sock, deadline, exact)
        try:
            got += _checked(sock.recv_into(view[got:], n - got, socket.MSG_WAITALL))
        except BlockingIOError:  # the kernel's limit ran out: the deadline, or early
            if deadline is None:  # none was set (_limit cleared it): not a blocking socket
                raise
            exact = True
    return buffer


def _checked(received: int) -> int:
    if received == 0:
        raise ChannelClosedError("The operation channel was closed by the other end.")
    return received


#: Each socket's receive limit in the kernel now (SO_RCVTIMEO, seconds; absent or 0:
#: none). A message takes several receives, and a coordinator reads one from every
#: host per operation: the limit is set again only when it is far from what the
#: deadline leaves, not before every receive (a system call each).
_limits: weakref.WeakKeyDictionary[socket.socket, float] = weakref.WeakKeyDictionary()
_LIMIT_SLACK = 0.1


def _limit(sock: socket.socket, deadline: float | None, exact: bool = False) -> None:
    """Bounds the next receive by ``deadline``, to within ``_LIMIT_SLACK`` of the time
    left, or exactly (after a receive that the kernel ended early). The socket stays
    blocking (a time-out in Python would make it non-blocking, and a non-blocking
    receive returns whatever has arrived instead of filling its buffer); the kernel
    applies the limit."""
    current = _limits.get(sock, 0.0)
    if deadline is None:
        if current:
            _set_limit(sock, 0.0)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("The operation channel's deadline passed.")
    if exact or not left * (1 - _LIMIT_SLACK) <= current <= left * (1 + _LIMIT_SLACK):
        _set_limit(sock, left)


def _set_limit(sock: socket.socket, left: float) -> None:
    seconds = int(left)
    micros = max(int((left - seconds) * 1e6), 0 if seconds or not left else 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(seconds, micros))
    _limits[sock] = left
