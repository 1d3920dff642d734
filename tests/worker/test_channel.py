"""The operation channel: real loopback sockets, HMAC handshake, out-of-band arrays."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest

from jaxpod.worker import channel


def _echo(*args: Any, **kwargs: Any) -> Any:
    return args, kwargs


@pytest.fixture()
def server() -> Any:
    key = channel.new_key()
    srv = channel.ChannelServer("127.0.0.1", key, _echo, lambda e: ("failed", repr(e)))
    yield srv, key
    srv.close()


def test_round_trip_keeps_small_and_large_arrays(server: Any) -> None:
    srv, key = server
    big = np.random.default_rng(0).normal(size=(300, 1000)).astype(np.float32)  # out of band
    small = np.arange(5, dtype=np.int16)
    with channel.connect(srv.address, key, 10) as sock:
        for n in range(3):  # several messages on one connection stay in step
            channel.broadcast([sock], ((big + n, small), {"n": n}))
            (got_big, got_small), kwargs = channel.receive(sock)
            np.testing.assert_array_equal(got_big, big + n)
            np.testing.assert_array_equal(got_small, small)
            assert kwargs == {"n": n}
            got_big[0, 0] = 1.0  # received arrays are writable buffers of their own


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
    listener = socket.create_server(("127.0.0.1", 0))

    def peer_that_dies() -> None:  # answers the handshake, takes one message, vanishes
        conn, _ = listener.accept()
        with conn:
            channel._prove(conn, key)
            channel.receive(conn)

    thread = threading.Thread(target=peer_that_dies, daemon=True)
    thread.start()
    try:
        with channel.connect(listener.getsockname(), key, 10) as sock:
            channel.broadcast([sock], ((), {}))
            with pytest.raises(channel.ChannelClosedError, match="closed by the other end"):
                channel.receive(sock)
    finally:
        thread.join(10)
        listener.close()
