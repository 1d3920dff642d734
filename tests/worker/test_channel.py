"""The operation channel: real loopback sockets, HMAC handshake, out-of-band arrays."""

from __future__ import annotations

import functools
import os
import pickle
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from jaxpod.framing import Framing, Segments, varint
from jaxpod.worker import channel, process_memory


def _echo(*args: Any, release: threading.Event, slow: bool = False, frame: int = 0,
          **kwargs: Any) -> Any:
    if slow:  # an operation that lasts until the test ends, for the deadline test
        release.wait(30)
    if frame:  # as a worker answers a gather: its first argument, framed (views of it)
        framed = Framing(tag=b"\x12", piece_bytes=frame).frame(args[0])
        assert all(np.shares_memory(args[0], np.asarray(p.parts[1])) for p in framed.pieces)
        return (framed,), kwargs
    for arg in args:  # arguments reach the worker as writable arrays of their own
        if isinstance(arg, np.ndarray) and arg.ndim == 2:
            arg[0, 0] = -arg[0, 0]
    return args, kwargs


@pytest.fixture(params=["lent", "socket"])
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A channel server in this process: replies' large buffers read in place (a
    worker on this machine) or sent through the socket (``JAXPOD_CHANNEL_LEND=0``)."""
    monkeypatch.setenv(process_memory.LEND_ENV, "1" if request.param == "lent" else "0")
    key = channel.new_key()
    release = threading.Event()
    srv = channel.ChannelServer("127.0.0.1", key, functools.partial(_echo, release=release),
                                lambda e: ("failed", repr(e)))
    yield srv, key
    release.set()
    srv.close()
    srv._thread.join(10)  # its last client hung up: closing ends the serving thread
    assert not srv._thread.is_alive()


def test_round_trip_keeps_small_and_large_arrays(server: Any) -> None:
    srv, key = server
    big = np.random.default_rng(0).normal(size=(300, 1000)).astype(np.float32)  # out of band
    small = np.arange(5, dtype=np.int16)
    with channel.connect(srv.address, key, 10) as sock:
        lending = os.environ[process_memory.LEND_ENV] == "1"
        assert sock.lender == (os.getpid() if lending else 0)
        for n in range(3):  # several messages on one connection stay in step
            channel.broadcast([sock], ((big + n, small), {"n": n}))
            (got_big, got_small), kwargs = channel.receive(sock)
            expected = big + n
            expected[0, 0] = -expected[0, 0]  # written by the worker side
            np.testing.assert_array_equal(got_big, expected)
            np.testing.assert_array_equal(got_small, small)
            assert kwargs == {"n": n}
            # replies are received straight into bytes objects: read-only arrays
            assert not got_big.flags.writeable


def test_framed_pieces_arrive_as_bytes_in_order(server: Any) -> None:
    srv, key = server
    data = np.random.default_rng(1).integers(0, 255, size=(3 << 20) + 17, dtype=np.uint8)
    with channel.connect(srv.address, key, 10) as sock:
        channel.broadcast([sock], ((data,), {"frame": 1 << 20}))
        reply = channel.receive(sock)
        # the other way, segments reach the worker as one buffer of their own
        channel.broadcast([sock], ((Segments(b"head", data[:100]),), {}))
        (echoed,), _ = channel.receive(sock)
    assert bytes(echoed) == b"head" + data[:100].tobytes()
    assert reply[0] != "failed", reply
    (got,), _ = reply
    assert got.nbytes == data.nbytes and len(got.pieces) == 4
    assert all(type(p) is bytes for p in got.pieces)
    offset = 0
    for piece in got.pieces:
        size = min(1 << 20, data.nbytes - offset)
        header = b"\x12" + varint(size)
        assert piece[:len(header)] == header and len(piece) == len(header) + size
        assert piece[len(header):] == data[offset:offset + size].tobytes()
        offset += size
    assert offset == data.nbytes


def test_a_reply_that_does_not_come_in_time_raises_timeout(server: Any) -> None:
    srv, key = server
    with channel.connect(srv.address, key, 10) as sock:
        channel.broadcast([sock], ((), {"slow": True}))
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            channel.receive(sock, deadline=start + 0.2)
        assert time.monotonic() - start < 2.5  # gave up at the deadline


def test_wrong_key_is_refused_and_the_server_keeps_serving(server: Any) -> None:
    srv, key = server
    with pytest.raises(channel.ChannelAuthError, match="does not hold this group's key"):
        channel.connect(srv.address, channel.new_key(), 10)
    with channel.connect(srv.address, key, 10) as sock:
        channel.broadcast([sock], ((1,), {}))
        assert channel.receive(sock) == ((1,), {})


def test_a_message_that_fails_to_unpickle_gets_the_failure_as_its_reply(server: Any) -> None:
    srv, key = server

    class Unloadable:
        def __reduce__(self) -> Any:
            return (_refuse, ())

    with channel.connect(srv.address, key, 10) as sock:
        channel.broadcast([sock], ((Unloadable(),), {}))
        kind, message = channel.receive(sock)
        assert kind == "failed" and "refused on purpose" in message
        channel.broadcast([sock], ((2,), {}))  # the stream is still in step
        assert channel.receive(sock) == ((2,), {})


def _refuse() -> None:
    raise RuntimeError("refused on purpose")


def test_peer_that_goes_away_mid_operation_raises_channel_closed() -> None:
    key = channel.new_key()

    def takes_one_message(conn: socket.socket) -> None:  # then vanishes
        channel._lend(conn)
        channel.receive(conn)

    listener, thread = _peer(key, takes_one_message)
    with channel.connect(listener.getsockname(), key, 10) as sock:
        channel.broadcast([sock], ((), {}))
        with pytest.raises(channel.ChannelClosedError, match="closed by the other end"):
            channel.receive(sock)
    thread.join(10)
    assert not thread.is_alive()


def test_framing_rejects_bad_settings_and_frames_empty_arrays() -> None:
    with pytest.raises(ValueError, match=r"piece_bytes must be a positive int\. Got 0"):
        Framing(tag=b"\x12", piece_bytes=0)
    with pytest.raises(ValueError, match=r"nonnegative int\. Got -1"):
        varint(-1)
    assert [varint(n) for n in (0, 127, 128, 300)] == [b"\x00", b"\x7f", b"\x80\x01",
                                                       b"\xac\x02"]
    empty = Framing(tag=b"\x12", piece_bytes=8).frame(np.zeros((0, 3), np.float32))
    assert empty.pieces == [] and empty.nbytes == 0
    # Pickled other than by the channel, segments become their concatenation.
    segments = Segments(b"ab", np.arange(3, dtype=np.uint8))
    assert segments.nbytes == 5
    assert pickle.loads(pickle.dumps(segments)) == segments.tobytes() == b"ab\x00\x01\x02"


def _peer(key: bytes, serve: Any) -> tuple[socket.socket, threading.Thread]:
    """A hand-written worker end on a thread: answers the key challenge, then runs
    ``serve(conn)``."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with listener, listener.accept()[0] as conn:
            channel._prove(conn, key)
            serve(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def test_a_worker_whose_token_does_not_read_back_sends_through_the_socket() -> None:
    key = channel.new_key()
    big = np.arange(1 << 18, dtype=np.float64)
    answers: list[bytes] = []

    def serve(conn: socket.socket) -> None:
        channel._read(conn, channel._PID.size)  # the coordinator's pid
        elsewhere = np.zeros(32, np.uint8)  # not the token it is sent with
        conn.sendall(channel._OFFER.pack(os.getpid(), elsewhere.ctypes.data)
                     + b"t" * channel._CHALLENGE_BYTES)
        answers.append(bytes(channel._read(conn, 1)))
        channel.receive(conn)
        channel._send(conn, *channel.encode(big))

    listener, thread = _peer(key, serve)
    with channel.connect(listener.getsockname(), key, 10) as sock:
        assert sock.lender == 0
        channel.broadcast([sock], ())
        np.testing.assert_array_equal(channel.receive(sock), big)
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
        channel._lend(conn)
        channel.receive(conn)
        data, buffers = channel.encode(lent)
        where = lent.ctypes.data if address is None else address
        conn.sendall(data + channel._PID.pack(1)
                     + channel._LENT.pack(index, offset, where, buffers[0].nbytes))
        with pytest.raises(channel.ChannelClosedError):
            channel._read(conn, 1)  # until the coordinator hangs up

    listener, thread = _peer(key, serve)
    with channel.connect(listener.getsockname(), key, 10) as sock:
        assert sock.lender == os.getpid()
        channel.broadcast([sock], ())
        with pytest.raises(channel.ChannelClosedError, match=error):
            channel.receive(sock)
    thread.join(10)
    assert not thread.is_alive()
