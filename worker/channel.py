"""The operation channel: a direct, authenticated socket from the coordinator to a host
worker.

Ray starts, places and stops the host workers; their operations travel over one
connection per worker instead of as Ray actor tasks: a Unix-domain socket where the
coordinator runs on the worker's machine, else TCP. On a busy host a Ray actor call
costs 1-2 ms (submission, the actor's task queue, the reply through the core worker),
a round trip over an open socket about 0.05 ms; and results, gathered arrays included,
come straight back instead of through the object store.

Both ends prove they hold the group's key (HMAC-SHA256 over each other's random
challenge) before anything is unpickled. Messages are pickles (protocol 5), made by the
standard C pickler, which takes half the time of cloudpickle for an operation's message
(about 15 against 30 µs), and by cloudpickle only where it fails: a class or function
that must travel by value, such as a user's exception class the worker loaded by value.
The C pickler refuses any class or function it cannot find as itself by name, so it
never sends by name what cloudpickle would send by value, bar a ``__main__``'s own,
which the service's and the worker's (jaxpod's entry points) never put in a message.
Large buffers (numpy arrays) travel out of band, each received straight into its own
buffer: writable numpy memory on the worker's side, ``bytes`` on the coordinator's,
which can forward a buffer it received (a piece of a gathered array) without a copy.
:class:`~jaxpod.pieces.Streamed` buffers (a view of gathered rows) travel out of band
too; the receiving end may take each in pieces of its own layout, every piece received
straight into its own ``bytes`` object behind a prefix it writes
(:class:`~jaxpod.pieces.PieceLayout`), so neither end copies or frames them.

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
import io
import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from jaxpod import settings
from jaxpod.errors import JaxpodError
from jaxpod.pieces import PieceLayout, Pieces, Streamed
from jaxpod.worker import process_memory

#: How long a connecting peer has to answer the key challenge.
HANDSHAKE_TIMEOUT = settings.CHANNEL_HANDSHAKE_TIMEOUT
#: Buffers at least this large travel out of band (no copy into the pickle).
OUT_OF_BAND_BYTES = 64 * 1024
_CHALLENGE_BYTES = 32
#: pickle length, number of out-of-band buffers: pickle's own, then Streamed ones
_COUNT = struct.Struct("<QQQ")
_PID = struct.Struct("<Q")
_OFFER = struct.Struct("<QQ")  # the worker's pid, the address of its token
_LENT = struct.Struct("<QQQQ")  # buffer index, offset in it, address, length
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO's struct timeval
_UCRED = struct.Struct("@iII")  # SO_PEERCRED's struct ucred: pid, uid, gid
_YES, _NO = b"\x01", b"\x00"
# Combined once: ``|`` on the socket module's flags is an enum operation in Python,
# and a coordinator checks every host's channel per operation.
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_POLL_EVENTS = select.POLLIN | select.POLLHUP | select.POLLERR


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


class ChannelClosedError(JaxpodError, ConnectionError):
    """The other end of an operation channel went away (its process died, or the group
    was stopped)."""


class PeerClosedError(ChannelClosedError):
    """Channel ``index`` of a group closed while the coordinator waited on another
    host's reply (see :class:`ReplyWatch`)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"operation channel {index} closed")
        self.index = index


class ChannelAuthError(JaxpodError, PermissionError):
    """The other end of an operation channel does not hold the group's key."""


class Connection(socket.socket):
    """An authenticated channel socket, as :func:`connect` opens it."""

    #: The worker's pid where it lends its replies' large buffers in place, else 0.
    lender: int = 0


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


class _OutOfBand:
    """Takes large buffers and :class:`Streamed` ones out of the pickle, so that they
    travel out of band, as they are. Mixed into a pickler class. A Streamed buffer is
    pickled as a call of :func:`_streamed_slot` with its index, which the receiving
    :class:`_Unpickler` resolves to the buffer it received. That is done in
    ``reducer_override``, which the C pickler calls only for objects of types without
    a fast path of their own; a ``persistent_id`` would be called for every object, a
    Python call per string and int that made encoding a 1000-leaf state's infos take
    three times as long."""

    def __init__(self, file: io.BytesIO, buffers: list[Any]) -> None:
        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            if buffer.raw().nbytes < OUT_OF_BAND_BYTES:
                return True  # in band
            buffers.append(buffer.raw())
            return False

        super().__init__(file, protocol=5, buffer_callback=out_of_band)  # type: ignore[call-arg]
        self.streamed: list[Streamed] = []

    def _slot(self, obj: Streamed) -> tuple[Any, tuple[int]]:
        self.streamed.append(obj)
        return _streamed_slot, (len(self.streamed) - 1,)


class _Pickler(_OutOfBand, pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        return self._slot(obj) if type(obj) is Streamed else NotImplemented


class _CloudPickler(_OutOfBand, cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is Streamed:
            return self._slot(obj)
        return super().reducer_override(obj)


def _streamed_slot(index: int) -> Any:
    """Stands for a message's Streamed buffer number ``index``: only a receiving
    :class:`_Unpickler` calls it, as the buffer it received."""
    raise RuntimeError(f"Streamed buffer {index} was unpickled outside the channel.")


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: Any, buffers: list[Any], streamed: list[Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._streamed = streamed

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _streamed_slot.__name__:
            return self._streamed.__getitem__
        return super().find_class(module, name)


def encode(message: Any) -> tuple[bytes, list[Any]]:
    """The message's header and pickle; then what travels out of band, in order:
    pickle's buffers (memoryviews) and :class:`Streamed` buffers' data. Raises whatever
    cloudpickle raises, before anything is sent."""
    try:
        return _encode(message, _Pickler)
    except Exception:  # something only cloudpickle takes (see the module's docstring)
        return _encode(message, _CloudPickler)


def _encode(message: Any, pickler_class: type[_Pickler] | type[_CloudPickler]
            ) -> tuple[bytes, list[Any]]:
    buffers: list[Any] = []
    file = io.BytesIO()
    pickler = pickler_class(file, buffers)
    pickler.dump(message)
    data = file.getvalue()
    streamed = [s.data for s in pickler.streamed]
    sizes = [b.nbytes for b in buffers] + [s.nbytes for s in streamed]
    header = (_COUNT.pack(len(data), len(buffers), len(streamed))
              + struct.pack(f"<{len(sizes)}Q", *sizes))
    return header + data, buffers + streamed


def _send(sock: socket.socket, data: bytes, buffers: list[Any], lend: bool = False,
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


def _loads(data: Any, buffers: list[Any], streamed: int) -> Any:
    """Unpickles a received message; its last ``streamed`` buffers were Streamed."""
    if not streamed:
        return pickle.loads(data, buffers=buffers)
    split = len(buffers) - streamed
    return _Unpickler(data, buffers[:split], buffers[split:]).load()


class Decoded:
    """Decodes the replies of one operation, each distinct one once: hosts in lockstep
    answer alike (the same value ids and shapes), and unpickling every host's copy
    cost the coordinator the hosts times the reply's size per operation (a 1000-leaf
    state from 256 hosts: half a second). A reply equal to the one before it, byte
    for byte, is the same object; replies with out-of-band buffers are always decoded
    (comparing them would cost as much)."""

    def __init__(self) -> None:
        self._last: tuple[bytearray, Any] | None = None

    def __call__(self, data: bytearray, buffers: list[Any], streamed: int) -> Any:
        if buffers:
            return _loads(data, buffers, streamed)
        if self._last is not None and self._last[0] == data:
            return self._last[1]
        value = _loads(data, buffers, streamed)
        self._last = (data, value)
        return value


def receive(sock: socket.socket, deadline: float | None = None,
            layout: PieceLayout | None = None, decoded: Decoded | None = None) -> Any:
    """The next reply (blocks; after ``deadline``, a ``time.monotonic()`` time, raises
    ``TimeoutError``). Its out-of-band buffers come as ``bytes``, each received straight
    into place, so arrays in it are read-only; with a ``layout``, :class:`Streamed`
    buffers come as :class:`Pieces` cut that way. With ``decoded``, a reply equal to
    the last one it decoded is that one's object."""
    try:
        received = _receive(sock, deadline, writable=False,
                            lender=getattr(sock, "lender", 0), layout=layout)
    except (ValueError, IndexError, struct.error, MemoryError) as e:
        # Part of a message is still unread: what follows is out of step.
        raise ChannelClosedError(f"The operation channel's message was malformed or "
                                 f"too large to receive: {e!r}.") from e
    return (decoded or _loads)(*received)


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


def _receive(sock: socket.socket, deadline: float | None, writable: bool, lender: int = 0,
             layout: PieceLayout | None = None) -> tuple[bytearray, list[Any], int]:
    """One whole message's bytes, so a message that fails to unpickle leaves the
    stream in step: the pickle, the out-of-band buffers, how many of those (the last
    ones) were Streamed. Out-of-band buffers are ``writable`` numpy memory (not
    zeroed first, unlike a bytearray, and on huge pages when large) or ``bytes``
    (Streamed ones as :class:`Pieces` under a ``layout``); from a ``lender`` (its
    pid), with their large parts read in place."""
    length, plain, streamed = _COUNT.unpack(_read(sock, _COUNT.size, deadline))
    count = plain + streamed
    sizes = struct.unpack(f"<{count}Q", _read(sock, 8 * count, deadline)) if count else ()
    data = _read(sock, length, deadline)
    if writable:
        return data, [_read(sock, n, deadline, np.empty(n, np.uint8)) for n in sizes], \
            streamed
    places = [_Place(n, layout if i >= plain else None) for i, n in enumerate(sizes)]
    if not lender:
        for place in places:
            for view in place.views:
                _read(sock, view.nbytes, deadline, view)
        return data, [p.received() for p in places], streamed
    (lent_count,) = _PID.unpack(_read(sock, _PID.size, deadline))
    lent: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    for i, offset, address, n in _LENT.iter_unpack(_read(sock, _LENT.size * lent_count,
                                                          deadline)):
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
                _read(sock, view.nbytes, deadline, view)
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


def _read(sock: socket.socket, n: int, deadline: float | None = None, into: Any = None
          ) -> Any:
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
    pid, address = _OFFER.unpack(_read(sock, _OFFER.size))
    token = bytes(_read(sock, _CHALLENGE_BYTES))
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
    wanted = _read(sock, 1) == _YES
    reader = peer_pid(sock)
    granted = (wanted and process_memory.enabled()
               and process_memory.allow_reader(reader))
    token = np.frombuffer(secrets.token_bytes(_CHALLENGE_BYTES), np.uint8).copy()
    borrowed = False
    try:
        sock.sendall(_OFFER.pack(os.getpid() if granted else 0, token.ctypes.data)
                     + token.tobytes())
        borrowed = _read(sock, 1) == _YES and granted
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
                message = _receive(sock, None, writable=True)
                # A lent reply lives until the coordinator has read it, which it has
                # once its next message arrives, unless that was sent ahead of it.
                reply = None
                reply, ahead = self._answer(*message)
                _send(sock, reply[0], reply[1], lend=bool(reader), copy=ahead)
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
            message = _loads(data, buffers, streamed)
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
