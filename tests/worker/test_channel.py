"""The operation channel: real loopback and Unix sockets, HMAC handshake, out-of-band
arrays, and the same-host grant: who may read a worker's memory, and for how long
(workers and coordinators in real subprocesses where it matters which process is
which)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from jaxpod.pieces import PieceLayout, Pieces, Streamed
from jaxpod.timeouts import wait_for
from jaxpod.worker import channel, channel_codec, channel_io, process_memory

#: How long a test waits for a grant to be revoked after its connection ended.
REVOKE_WAIT_S = 20.0


@dataclasses.dataclass
class _Ahead:
    """A message the next one may overtake (as the coordinator sends operations
    ahead of the replies before them)."""

    payload: Any
    ahead: bool = True


def _echo(message: Any, release: threading.Event) -> Any:
    """The test server's ``handle``: a message is ``(args, kwargs)``, or one wrapped in
    :class:`_Ahead`."""
    args, kwargs = message.payload if isinstance(message, _Ahead) else message
    return _echo_call(*args, release=release, **kwargs)


def _echo_call(*args: Any, release: threading.Event, slow: bool = False,
               stream: bool = False, reply_floats: int = 0, delay: float = 0.0,
               **kwargs: Any) -> Any:
    if slow:  # an operation that lasts until the test ends, for the deadline test
        release.wait(30)
    time.sleep(delay)  # an operation that takes this long (the worker's side)
    if reply_floats:  # a large reply to a small message
        return (np.arange(reply_floats, dtype=np.float32) + kwargs["n"],), kwargs
    if stream:  # as a worker answers a gather: its first argument, streamed (a view)
        streamed = Streamed(args[0])
        assert not args[0].size or np.shares_memory(args[0], np.frombuffer(streamed.data,
                                                                            np.uint8))
        return (streamed,), kwargs
    for arg in args:  # arguments reach the worker as writable arrays of their own
        if isinstance(arg, np.ndarray) and arg.ndim == 2:
            arg[0, 0] = -arg[0, 0]
    return args, kwargs


@dataclasses.dataclass
class Served:
    srv: channel.ChannelServer
    key: bytes
    address: channel.ChannelAddress  # what the test connects to
    mode: str


def _tcp_only(address: channel.ChannelAddress) -> channel.ChannelAddress:
    """The address as a coordinator on another machine uses it: its Unix socket is
    not there to connect to."""
    return dataclasses.replace(address, unix_path=None)


@pytest.fixture(params=["lent", "unix", "tcp"])
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[Served]:
    """A channel server in this process, reached over its Unix socket with replies'
    large buffers read in place (a worker on this machine) or sent through the socket
    (``JAXPOD_CHANNEL_LEND=0``), or over TCP only (a worker on another machine)."""
    monkeypatch.setenv(process_memory.LEND_ENV, "0" if request.param == "unix" else "1")
    key = channel.new_key()
    release = threading.Event()
    srv = channel.ChannelServer("127.0.0.1", key, lambda m: _echo(m, release),
                                lambda e: ("failed", repr(e)))
    assert srv.address.unix_path is not None and srv.address.unix_path.startswith("\0")
    address = _tcp_only(srv.address) if request.param == "tcp" else srv.address
    yield Served(srv, key, address, request.param)
    release.set()
    srv.close()
    srv._thread.join(10)  # its last client hung up: closing ends the serving thread
    assert not srv._thread.is_alive()
    assert srv.granted_reader is None and process_memory.granted_reader() is None


def test_round_trip_keeps_small_and_large_arrays(server: Served) -> None:
    srv, key = server.srv, server.key
    big = np.random.default_rng(0).normal(size=(300, 1000)).astype(np.float32)  # out of band
    small = np.arange(5, dtype=np.int16)
    with channel.connect(server.address, key, 10) as sock:
        lending = server.mode == "lent"
        assert sock.family == (socket.AF_INET if server.mode == "tcp" else socket.AF_UNIX)
        assert sock.lender == (os.getpid() if lending else 0)
        # The worker granted the reading to this process (as the kernel names it)
        # only where it lends (before its offer: before connect returned).
        assert process_memory.granted_reader() == (os.getpid() if lending else None)
        for n in range(3):  # several messages on one connection stay in step
            channel_io.broadcast([sock], ((big + n, small), {"n": n}))
            (got_big, got_small), kwargs = channel_io.receive(sock)
            assert srv.granted_reader == process_memory.granted_reader()
            expected = big + n
            expected[0, 0] = -expected[0, 0]  # written by the worker side
            np.testing.assert_array_equal(got_big, expected)
            np.testing.assert_array_equal(got_small, small)
            assert kwargs == {"n": n}
            # replies are received straight into bytes objects: read-only arrays
            assert not got_big.flags.writeable
    # The coordinator hung up: the grant goes with its connection.
    assert wait_for(lambda: srv.granted_reader is None, REVOKE_WAIT_S)
    assert process_memory.granted_reader() is None


def test_replies_to_messages_sent_ahead_stay_whole_when_the_next_comes_first(
        server: Served) -> None:
    """Messages sent before any reply is read: each reply, with an array a lending
    worker would lend only until its next message arrives, is its own and intact."""
    with channel.connect(server.address, server.key, 10) as sock:
        for n in range(4):  # small messages: the coordinator bounds what goes ahead
            channel_io.broadcast([sock], _Ahead(((), {"n": n, "reply_floats": 300_000})))
        for n in range(4):
            (got,), kwargs = channel_io.receive(sock)
            np.testing.assert_array_equal(got, np.arange(300_000, dtype=np.float32) + n)
            assert kwargs == {"n": n}


def _prefix(n: int) -> bytes:  # any prefix the receiver chooses, of any length
    return b"<" * (n % 5 + 1) + n.to_bytes(8, "little")


@pytest.mark.parametrize("size", [(3 << 20) + 17, 4 << 20, 1000, 0])
def test_streamed_buffers_arrive_in_the_receivers_pieces(server: Served, size: int) -> None:
    data = np.random.default_rng(1).integers(0, 255, size=size, dtype=np.uint8)
    layout = PieceLayout(piece_bytes=1 << 20, prefix=_prefix)
    with channel.connect(server.address, server.key, 10) as sock:
        channel_io.broadcast([sock], ((data,), {"stream": True}))
        reply = channel_io.receive(sock, layout=layout)
        # without a layout, the same buffer arrives as one bytes object
        channel_io.broadcast([sock], ((data,), {"stream": True}))
        (whole,), _ = channel_io.receive(sock)
        # the other way, a streamed buffer reaches the worker as a buffer of its own
        channel_io.broadcast([sock], ((Streamed(data[:100]),), {}))
        (echoed,), _ = channel_io.receive(sock)
    assert bytes(echoed) == data[:100].tobytes()
    assert type(whole) is bytes and whole == data.tobytes()
    assert reply[0] != "failed", reply
    (got,), _ = reply
    assert isinstance(got, Pieces) and got.nbytes == data.nbytes
    assert len(got.pieces) == -(-size // (1 << 20))
    assert all(type(p) is bytes for p in got.pieces)
    offset = 0
    for piece in got.pieces:
        length = min(1 << 20, data.nbytes - offset)
        prefix = _prefix(length)
        assert piece[:len(prefix)] == prefix and len(piece) == len(prefix) + length
        assert piece[len(prefix):] == data[offset:offset + length].tobytes()
        offset += length
    assert offset == data.nbytes


def test_a_reply_that_does_not_come_in_time_raises_timeout(server: Served) -> None:
    with channel.connect(server.address, server.key, 10) as sock:
        channel_io.broadcast([sock], ((), {"slow": True}))
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            channel_io.receive(sock, deadline=start + 0.2)
        assert time.monotonic() - start < 2.5  # gave up at the deadline


def test_receive_limits_left_from_earlier_deadlines_keep_later_ones(server: Served
                                                                   ) -> None:
    # The kernel's limit stays set between receives (setting it is a system call):
    # what an earlier deadline left must neither cut a later receive short nor let
    # it run past its own deadline.
    with channel.connect(server.address, server.key, 10) as sock:
        channel_io.broadcast([sock], ((1,), {}))
        assert channel_io.receive(sock, time.monotonic() + 0.05) == ((1,), {})
        # Left a limit of at most 0.05 s: no deadline now, so it waits for the reply.
        channel_io.broadcast([sock], ((2,), {"delay": 0.3}))
        assert channel_io.receive(sock) == ((2,), {})
        # As if the kernel ended a receive before a deadline it was set near: the
        # receive goes on until the reply or the deadline.
        channel_io._set_limit(sock, 0.05)
        channel_io._limits[sock] = 20.0
        channel_io.broadcast([sock], ((3,), {"delay": 0.3}))
        assert channel_io.receive(sock, time.monotonic() + 20) == ((3,), {})
        # A far deadline left a long limit: a near one still holds.
        channel_io.broadcast([sock], ((4,), {}))
        assert channel_io.receive(sock, time.monotonic() + 30) == ((4,), {})
        channel_io.broadcast([sock], ((), {"slow": True}))
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            channel_io.receive(sock, deadline=start + 0.2)
        assert time.monotonic() - start < 2.5


def test_receives_with_deadlines_set_the_kernel_limit_once(server: Served) -> None:
    # A coordinator reads a reply from every host for each operation, each with the
    # operation's deadline: setting the limit before every receive costs a system
    # call each, several per message.
    with channel.connect(server.address, server.key, 10) as sock:
        calls: list[tuple[Any, ...]] = []
        real = sock.setsockopt

        def counted(*args: Any) -> None:
            calls.append(args)
            real(*args)

        sock.setsockopt = counted  # type: ignore[method-assign]
        for n in range(20):
            payload = np.arange(300_000, dtype=np.float32) + n  # out of band: more reads
            channel_io.broadcast([sock], ((payload,), {"n": n}))
            (got,), kwargs = channel_io.receive(sock, time.monotonic() + 60)
            assert kwargs == {"n": n} and np.array_equal(got, payload)
        assert [a[1] for a in calls] == [socket.SO_RCVTIMEO]


def test_wrong_key_is_refused_and_the_server_keeps_serving(server: Served) -> None:
    with pytest.raises(channel.ChannelAuthError, match="does not hold this group's key"):
        channel.connect(server.address, channel.new_key(), 10)
    assert server.srv.granted_reader is None
    with channel.connect(server.address, server.key, 10) as sock:
        channel_io.broadcast([sock], ((1,), {}))
        assert channel_io.receive(sock) == ((1,), {})


def test_a_message_that_fails_to_unpickle_gets_the_failure_as_its_reply(
        server: Served) -> None:

    class Unloadable:
        def __reduce__(self) -> Any:
            return (_refuse, ())

    with channel.connect(server.address, server.key, 10) as sock:
        channel_io.broadcast([sock], ((Unloadable(),), {}))
        kind, message = channel_io.receive(sock)
        assert kind == "failed" and "refused on purpose" in message
        channel_io.broadcast([sock], ((2,), {}))  # the stream is still in step
        assert channel_io.receive(sock) == ((2,), {})


def _refuse() -> None:
    raise RuntimeError("refused on purpose")


def test_what_must_travel_by_value_is_cloudpickled_and_the_rest_is_not(
        server: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages are pickled by the C pickler; one holding a function or class that must
    travel by value (a lambda, a class defined in a function) falls back to cloudpickle,
    both ways."""

    class Local:
        def __init__(self, n: int) -> None:
            self.n = n

    cloudpickled: list[int] = []

    class Counted(channel_codec._CloudPickler):
        def __init__(self, file: Any, buffers: list[Any]) -> None:
            cloudpickled.append(1)
            super().__init__(file, buffers)

    monkeypatch.setattr(channel_codec, "_CloudPickler", Counted)
    plain = ((np.arange(3), {"a": (1, "x")}), {})
    by_value = ((lambda x: x + 1, Local(4)), {})
    channel_codec.encode(plain)
    assert not cloudpickled
    channel_codec.encode(by_value)
    assert cloudpickled == [1]
    with channel.connect(server.address, server.key, 10) as sock:
        channel_io.broadcast([sock], by_value)
        (fn, local), kwargs = channel_io.receive(sock)
        assert fn(2) == 3 and type(local).__qualname__.endswith("Local") and local.n == 4
        channel_io.broadcast([sock], plain)
        (array, nested), _ = channel_io.receive(sock)
        np.testing.assert_array_equal(array, np.arange(3))
        assert nested == {"a": (1, "x")} and kwargs == {}


def test_peer_that_goes_away_mid_operation_raises_channel_closed() -> None:
    key = channel.new_key()

    def takes_one_message(conn: socket.socket) -> None:  # then vanishes
        channel_io.receive(conn)  # over TCP no same-host handshake follows the key's

    address, thread = _peer(key, takes_one_message, unix=False)
    with channel.connect(address, key, 10) as sock:
        channel_io.broadcast([sock], ((), {}))
        with pytest.raises(channel_io.ChannelClosedError, match="closed by the other end"):
            channel_io.receive(sock)
    thread.join(10)
    assert not thread.is_alive()


def test_piece_layouts_reject_bad_settings_and_cut_as_told() -> None:
    with pytest.raises(ValueError, match=r"piece_bytes must be a positive int\. Got 0"):
        PieceLayout(piece_bytes=0, prefix=_prefix)
    layout = PieceLayout(piece_bytes=8, prefix=_prefix)
    assert [layout.cut(n) for n in (0, 1, 8, 17)] == [[], [1], [8], [8, 8, 1]]
    # Pickled other than by the channel, a streamed buffer becomes its bytes, which are
    # little-endian C-order whatever the array's layout.
    array = np.arange(6, dtype=">i4").reshape(2, 3).T
    streamed = Streamed(array)
    assert streamed.nbytes == 24
    assert pickle.loads(pickle.dumps(streamed)) == array.astype("<i4").tobytes()


def _peer(key: bytes, serve: Any, unix: bool = True
          ) -> tuple[channel.ChannelAddress, threading.Thread]:
    """A hand-written worker end on a thread, listening on a Unix socket (where the
    same-host handshake follows the key's) or on TCP: answers the key challenge, then
    runs ``serve(conn)``."""
    if unix:
        name = f"\0jaxpod-test-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(name)
        listener.listen()
        address = channel.ChannelAddress("127.0.0.1", 0, name)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        address = channel.ChannelAddress("127.0.0.1", listener.getsockname()[1])

    def run() -> None:
        with listener, listener.accept()[0] as conn:
            channel._prove(conn, key)
            serve(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return address, thread


# A process that holds 32 known bytes and says where they are.
_HOLDER = """
import os, sys
import numpy as np
token = np.frombuffer(b"jaxpod-token-" + b"x" * 19, np.uint8).copy()
print(os.getpid(), token.ctypes.data, flush=True)
sys.stdin.read()
"""


def test_a_worker_that_offers_another_process_is_not_read() -> None:
    """A peer that names another process (whose token does read back there) is not
    read: the coordinator reads only the pid the kernel gives as the socket's peer."""
    key = channel.new_key()
    answers: list[bytes] = []
    with subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            pid, where = (int(x) for x in holder.stdout.readline().split())
            token = b"jaxpod-token-" + b"x" * 19
            assert process_memory.reads_back(pid, where, token)  # readable from here

            def serve(conn: socket.socket) -> None:
                assert channel_io.read_exactly(conn, 1) == channel._YES  # the coordinator would
                conn.sendall(channel._OFFER.pack(pid, where) + token)
                answers.append(bytes(channel_io.read_exactly(conn, 1)))

            address, thread = _peer(key, serve)
            with channel.connect(address, key, 10) as sock:
                assert sock.family == socket.AF_UNIX and sock.lender == 0
            thread.join(10)
            assert not thread.is_alive()
        finally:
            holder.kill()
    assert answers == [channel._NO]


def test_a_worker_whose_token_does_not_read_back_sends_through_the_socket() -> None:
    key = channel.new_key()
    big = np.arange(1 << 18, dtype=np.float64)
    answers: list[bytes] = []

    def serve(conn: socket.socket) -> None:
        channel_io.read_exactly(conn, 1)  # whether the coordinator would borrow
        elsewhere = np.zeros(32, np.uint8)  # not the token it is sent with
        conn.sendall(channel._OFFER.pack(os.getpid(), elsewhere.ctypes.data)
                     + b"t" * channel._CHALLENGE_BYTES)
        answers.append(bytes(channel_io.read_exactly(conn, 1)))
        channel_io.receive(conn)
        channel_io.send_encoded(conn, *channel_codec.encode(big))

    address, thread = _peer(key, serve)
    with channel.connect(address, key, 10) as sock:
        assert sock.family == socket.AF_UNIX and sock.lender == 0
        channel_io.broadcast([sock], ())
        np.testing.assert_array_equal(channel_io.receive(sock), big)
    thread.join(10)
    assert not thread.is_alive()
    assert answers == [b"\x00"]


@pytest.mark.parametrize(("index", "offset", "address", "error"), [
    (0, 0, 8, "Could not read the reply's buffers in the worker's memory"),  # nothing at 8
    (0, 100, None, "lent a span of 131072 bytes at offset 100 of a 131072-byte buffer"),
    (5, 0, None, "malformed or too large to receive: IndexError"),  # no buffer 5
])
def test_a_lent_buffer_that_cannot_be_read_raises_channel_closed(
        index: int, offset: int, address: int | None, error: str) -> None:
    key = channel.new_key()
    lent = np.zeros(1 << 17, np.uint8)

    def serve(conn: socket.socket) -> None:
        reader = channel._lend(conn)
        try:
            assert reader == os.getpid()  # this process is the peer
            channel_io.receive(conn)
            data, buffers = channel_codec.encode(lent)
            where = lent.ctypes.data if address is None else address
            conn.sendall(data + channel_io._PID.pack(1)
                         + channel_io._LENT.pack(index, offset, where, buffers[0].nbytes))
            with pytest.raises(channel_io.ChannelClosedError):
                channel_io.read_exactly(conn, 1)  # until the coordinator hangs up
        finally:
            process_memory.revoke_reader(reader)

    peer, thread = _peer(key, serve)
    with channel.connect(peer, key, 10) as sock:
        assert sock.lender == os.getpid()
        channel_io.broadcast([sock], ())
        with pytest.raises(channel_io.ChannelClosedError, match=error):
            channel_io.receive(sock)
    thread.join(10)
    assert not thread.is_alive()
    assert process_memory.granted_reader() is None


# A worker: a channel server in a process of its own, whose operations report its
# grant (the reader granted now, the server's view of it, and every grant ever made)
# or return a large array. It prints its pickled address, then serves until stdin ends.
_WORKER = """
import pickle, sys
import numpy as np
from jaxpod.worker import channel, process_memory

granted = []
allow = process_memory.allow_reader
def counting_allow(pid):
    granted.append(pid)
    return allow(pid)
process_memory.allow_reader = counting_allow

def handle(message):
    op, arg = message
    if op == "grant":
        return process_memory.granted_reader(), server.granted_reader, list(granted)
    return (np.arange(arg, dtype=np.float64) * 3).reshape(-1, 1024)

server = channel.ChannelServer("127.0.0.1", bytes.fromhex(sys.argv[1]), handle, repr)
print(pickle.dumps(server.address).hex(), flush=True)
sys.stdin.read()
server.close()
"""

# A coordinator in a process of its own: connects to the worker over its Unix socket,
# prints its pid and the worker's grant, then closes the connection when told to
# ("close") or waits to be killed.
_COORDINATOR = """
import os, pickle, sys
from jaxpod.worker import channel, channel_io

address = pickle.loads(bytes.fromhex(sys.argv[1]))
conn = channel.connect(address, bytes.fromhex(sys.argv[2]), 30)
channel_io.broadcast([conn], ("grant", None))
reader, served, _ = channel_io.receive(conn)
print(os.getpid(), conn.family == channel.socket.AF_UNIX, reader, served, flush=True)
if sys.stdin.readline().strip() == "close":
    conn.close()
    print("closed", flush=True)
sys.stdin.read()
"""


@dataclasses.dataclass
class Worker:
    pid: int
    address: channel.ChannelAddress
    key: bytes


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    key = channel.new_key()
    with subprocess.Popen([sys.executable, "-c", _WORKER, key.hex()], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            address = pickle.loads(bytes.fromhex(proc.stdout.readline()))
            assert isinstance(address, channel.ChannelAddress) and address.unix_path
            yield Worker(proc.pid, address, key)
        finally:
            proc.kill()


def _grant(worker: Worker) -> tuple[int | None, int | None, list[int]]:
    """The worker's grant now (its process's, its server's) and every grant it made,
    asked over TCP, which grants nothing. It waits for any connection being served."""
    with channel.connect(_tcp_only(worker.address), worker.key, 30) as sock:
        channel_io.broadcast([sock], ("grant", None))
        return channel_io.receive(sock, time.monotonic() + 30)


def _revoked(worker: Worker) -> bool:
    reader, served, _ = _grant(worker)
    return reader is None and served is None


@pytest.mark.parametrize("unix_path", [None, "\0jaxpod-channel-not-on-this-machine"])
def test_a_coordinator_on_another_machine_is_granted_nothing(
        worker: Worker, unix_path: str | None) -> None:
    """Over TCP (no Unix socket given, or one that is not on this machine) nothing is
    granted and large replies travel through the socket."""
    _, _, before = _grant(worker)
    address = dataclasses.replace(worker.address, unix_path=unix_path)
    with channel.connect(address, worker.key, 10) as sock:
        assert sock.family == socket.AF_INET and sock.lender == 0
        channel_io.broadcast([sock], ("grant", None))
        assert channel_io.receive(sock) == (None, None, before)  # no grant was ever made
        channel_io.broadcast([sock], ("array", 1 << 18))
        got = channel_io.receive(sock)
    np.testing.assert_array_equal(got, (np.arange(1 << 18) * 3.0).reshape(-1, 1024))


def test_a_coordinator_on_this_machine_is_granted_exactly_its_own_pid(
        worker: Worker) -> None:
    _, _, before = _grant(worker)
    with channel.connect(worker.address, worker.key, 10) as sock:
        assert sock.family == socket.AF_UNIX
        assert channel.peer_pid(sock) == worker.pid  # the kernel's word, both ways
        assert sock.lender == worker.pid  # it lends: replies are read in place
        channel_io.broadcast([sock], ("grant", None))
        # Granted to this process, as the kernel named the socket's peer; once.
        assert channel_io.receive(sock) == (os.getpid(), os.getpid(), [*before, os.getpid()])
        for n in (1 << 16, 1 << 22):  # 512 KiB, 32 MiB
            channel_io.broadcast([sock], ("array", n))
            got = channel_io.receive(sock)
            np.testing.assert_array_equal(got, (np.arange(n) * 3.0).reshape(-1, 1024))
            assert not got.flags.writeable  # read into a bytes object of its own
    assert wait_for(lambda: _revoked(worker), REVOKE_WAIT_S)


@pytest.mark.parametrize("end", ["close", "sigkill"])
def test_the_grant_is_revoked_when_the_connection_ends(worker: Worker, end: str) -> None:
    """A coordinator process that closes its connection, or is killed with it open:
    the worker revokes the grant its pid was given."""
    with subprocess.Popen([sys.executable, "-c", _COORDINATOR, pickle.dumps(worker.address
                                                                           ).hex(),
                           worker.key.hex()],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as coord:
        try:
            assert coord.stdin is not None and coord.stdout is not None
            pid, unix, reader, served = coord.stdout.readline().split()
            assert (int(pid), unix) == (coord.pid, "True")
            assert reader == served == str(coord.pid)  # that process's pid, not ours
            if end == "close":
                coord.stdin.write("close\n")
                coord.stdin.flush()
                assert coord.stdout.readline() == "closed\n"
            else:
                coord.send_signal(signal.SIGKILL)
                assert coord.wait(REVOKE_WAIT_S) == -signal.SIGKILL
            assert wait_for(lambda: _revoked(worker), REVOKE_WAIT_S)
        finally:
            coord.kill()


def test_a_peer_without_the_key_is_granted_nothing_on_the_unix_socket(
        worker: Worker) -> None:
    _, _, before = _grant(worker)
    with pytest.raises(channel.ChannelAuthError):
        channel.connect(worker.address, channel.new_key(), 10)
    # By hand: a wrong answer to the worker's challenge, then the byte that asks to
    # borrow: the worker hangs up, nothing granted.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        assert worker.address.unix_path is not None
        raw.connect(worker.address.unix_path)
        channel_io.read_exactly(raw, channel._CHALLENGE_BYTES)
        raw.sendall(b"c" * channel._CHALLENGE_BYTES + b"d" * 32 + channel._YES)
        channel_io.read_exactly(raw, 32)  # the worker's answer to our challenge
        try:
            hung_up = raw.recv(1) == b""
        except ConnectionResetError:  # it closed with our borrow byte unread
            hung_up = True
        assert hung_up
    assert _grant(worker) == (None, None, before)  # no grant was ever made


def test_a_later_hosts_closed_channel_is_seen_while_an_earlier_one_is_silent() -> None:
    # Host 0 says nothing (as when it waits in a collective for a dead peer); host 1
    # already replied; host 2's end closes. Waiting for host 0's turn must end with
    # host 2's loss, not wait out the deadline (it would raise TimeoutError instead).
    pairs = [socket.socketpair() for _ in range(3)]
    ours = [a for a, _ in pairs]
    try:
        pairs[1][1].sendall(b"reply")
        pairs[2][1].close()
        with pytest.raises(channel_io.PeerClosedError) as lost:
            channel_io.ReplyWatch(ours).wait(0, time.monotonic() + 60)
        assert lost.value.index == 2
        assert ours[1].recv(16, socket.MSG_PEEK) == b"reply"  # nothing consumed
        pairs[0][1].sendall(b"x")
        watch = channel_io.ReplyWatch(ours[:2])
        watch.wait(0, time.monotonic() + 60)  # its turn: returns
        watch.wait(1, time.monotonic())  # seen waiting while host 0's turn came
        with pytest.raises(TimeoutError):  # silent, and the deadline already past
            channel_io.ReplyWatch(ours[:1]).wait(0, time.monotonic() - 1)
    finally:
        for a, b in pairs:
            a.close()
            b.close()


class _CountedPoll:
    """A poll set that counts its waits (the system calls a watch makes)."""

    def __init__(self, poller: Any) -> None:
        self.poller, self.polls = poller, 0

    def poll(self, timeout: Any) -> Any:
        self.polls += 1
        return self.poller.poll(timeout)

    def unregister(self, fd: int) -> None:
        self.poller.unregister(fd)


def test_replies_already_waiting_are_seen_in_one_wait_for_the_whole_operation() -> None:
    # A coordinator reads every host's reply to an operation in host order. Replies
    # that came together cost one wait, not one per host (and the watch registers
    # each channel once, not each later one again at every turn).
    pairs = [socket.socketpair() for _ in range(64)]
    ours = [a for a, _ in pairs]
    try:
        for _, theirs in pairs:
            theirs.sendall(b"reply")
        watch = channel_io.ReplyWatch(ours)
        counted = watch._poller = _CountedPoll(watch._poller)  # type: ignore[assignment]
        for host in range(len(ours)):
            watch.wait(host, time.monotonic() + 60)
            assert ours[host].recv(16) == b"reply"
        assert counted.polls == 1
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_identical_replies_decode_once_and_different_ones_each(server: Served) -> None:
    # Hosts in lockstep answer an operation alike: the coordinator decodes one copy.
    # A reply that differs, or that carries out-of-band buffers, is decoded itself.
    # (One worker here: its replies in a row stand for the hosts' replies.)
    infos = {f"w{i}": (i, (4, i), "float32") for i in range(50)}
    big = np.arange(300_000, dtype=np.float32)
    with channel.connect(server.address, server.key, 10) as sock:
        decoded = channel_codec.Decoded()

        def reply(message: Any) -> Any:
            channel_io.broadcast([sock], message)
            return channel_io.receive(sock, None, None, decoded)

        first, second, third, one, two = (reply(m) for m in [
            ((infos,), {}), ((infos,), {}), ((infos,), {"ahead": 3}), ((big,), {}),
            ((big,), {})])
        assert first == second == ((infos,), {}) and second is first
        assert third == ((infos,), {"ahead": 3})
        assert one is not two
        assert np.array_equal(one[0][0], big) and np.array_equal(two[0][0], big)


@pytest.mark.parametrize("needs_cloudpickle", [False, True])
def test_streamed_buffers_travel_out_of_band_with_either_pickler(
        needs_cloudpickle: bool) -> None:
    array = np.arange(20_000, dtype=np.float32)  # 80 KB: over OUT_OF_BAND_BYTES
    offset = 7
    # A lambda only cloudpickle takes: the message goes through the other pickler.
    extra = (lambda x: x + offset) if needs_cloudpickle else offset
    message = {"streamed": [Streamed(array), Streamed(array[::-1])], "extra": extra}
    data, buffers = channel_codec.encode(message)
    assert [memoryview(b).nbytes for b in buffers] == [array.nbytes] * 2
    assert len(data) < 1024  # the arrays are not in the pickle
    a, b = socket.socketpair()
    with a, b:
        channel_io.send([a], (data, buffers))
        got = channel_io.receive(b, time.monotonic() + 10)
    assert got["streamed"] == [array.tobytes(), array[::-1].tobytes()]
    if needs_cloudpickle:
        assert got["extra"](1) == 1 + offset
    else:
        assert got["extra"] == offset
