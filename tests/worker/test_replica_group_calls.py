"""ReplicaGroup.call over real operation channels (in-process channel servers standing
in for the host workers): replies stay in step when one cannot be read, a message that
does not pickle is not sent, and waiting for the group does not eat an operation's
own time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest

from jaxpod import operations as ops
from jaxpod.errors import JaxpodError
from jaxpod.operations import Envelope, RemoteError
from jaxpod.service.slices.group_handles import DropQueue
from jaxpod.service.slices.replica_group import ReplicaGroup
from jaxpod.worker import channel, channel_codec
from jaxpod.worker.result_digest import result_digest


class _Unloadable:
    """Pickles, but cannot be unpickled (its class needs an argument it is not given)."""

    def __init__(self, needed: int) -> None:
        self.needed = needed

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Unloadable, ())


Handler = Callable[..., Any]


@pytest.fixture()
def group_of() -> Iterator[Callable[[list[Handler]], ReplicaGroup]]:
    servers: list[channel.ChannelServer] = []
    groups: list[ReplicaGroup] = []

    def make(handlers: list[Handler]) -> ReplicaGroup:
        key = channel.new_key()
        for handle in handlers:
            servers.append(channel.ChannelServer(
                "127.0.0.1", key, handle, lambda e: RemoteError.of(e, "")))
        socks = [channel.connect(s.address, key, 10) for s in servers[-len(handlers):]]
        group = ReplicaGroup([], [{"num_replicas": len(handlers)}], socks)
        groups.append(group)
        return group

    yield make
    for group in groups:
        for sock in group._channels:
            sock.close()
    for server in servers:
        server.close()
        server._thread.join(10)
        assert not server._thread.is_alive()


def _host(index: int, seen: list[Any]) -> Handler:
    def handle(message: Envelope) -> Any:
        op = type(message.operation).__name__
        seen.append((index, message.seq, op, message.dropped))
        if isinstance(message.operation, ops.FetchParts) and index == 0:
            return _Unloadable(1)
        return f"host{index}-{op}-{message.seq}"
    return handle


_UNREADABLE = ops.FetchParts(ops.Handle(1))  # host 0 answers it with an unreadable reply


def test_an_unreadable_reply_leaves_the_next_replies_in_step(group_of: Any) -> None:
    seen: list[Any] = []
    group = group_of([_host(0, seen), _host(1, seen)])
    with pytest.raises(JaxpodError, match=r"Host 0's reply to operation FetchParts could "
                                          r"not be unpickled here: TypeError"):
        group.call(_UNREADABLE)
    # host 1's reply to that operation was read too: this one gets its own
    assert group.call(ops.Stats()) == ["host0-Stats-1", "host1-Stats-1"]
    assert sorted(s[:3] for s in seen) == [(0, 0, "FetchParts"), (0, 1, "Stats"),
                                           (1, 0, "FetchParts"), (1, 1, "Stats")]


def test_a_message_that_does_not_pickle_is_not_sent(group_of: Any) -> None:
    seen: list[Any] = []
    group = group_of([_host(0, seen), _host(1, seen)])
    drops = DropQueue()
    drops.values.extend([5, 6])
    with pytest.raises(TypeError, match="lock"):
        group.call(ops.Reduce("SUM", threading.Lock(), None), drops=drops)
    assert seen == [] and list(drops.values) == [5, 6]  # nothing sent, nothing lost
    assert group.call(ops.Stats(), drops=drops) == ["host0-Stats-0", "host1-Stats-0"]
    assert [d.values for _, _, _, d in seen] == [(5, 6), (5, 6)] and not drops.values


def test_waiting_for_the_group_does_not_count_against_the_time_out(group_of: Any) -> None:
    started = threading.Event()

    def handle(message: Envelope) -> Any:
        long = isinstance(message.operation, ops.Stats)
        if long:
            started.set()
        time.sleep(1.5 if long else 1.0)  # each operation's own duration
        return type(message.operation).__name__

    group = group_of([handle])
    long = threading.Thread(target=group.call, args=(ops.Stats(),), kwargs={"timeout": 3})
    long.start()
    assert started.wait(10)
    try:
        # ~1.5 s waiting for "long", then 1 s of its own: within 2 s of its own time
        assert group.call(ops.NextInput(1), timeout=2) == ["NextInput"]
    finally:
        long.join(10)
    assert group._broken is None


class _TwoArgs(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}-{b}")


def _two_hosts(group_of: Any, replies: list[Any],
               host_one: Callable[[Any], Any] = lambda reply: reply) -> Any:
    """A ``GroupEngine`` over two in-process hosts of one 2-host group; each reply
    host 1 sends goes through ``host_one`` and every reply is kept in ``replies``."""
    from jaxpod.service.slices.group_engine import GroupEngine
    from jaxpod.worker.engine import Engine
    from jaxpod.worker.host_operations import HostOperations

    hosts = [HostOperations(i, Engine(), hosts=2) for i in range(2)]

    def answer(host: int) -> Handler:
        def handle(message: Envelope) -> Any:
            reply = hosts[host].execute(message)
            reply = host_one(reply) if host == 1 else reply
            replies.append((host, type(message.operation), reply))
            return reply
        return handle

    return GroupEngine(group_of([answer(0), answer(1)]))


def test_hosts_after_the_first_answer_a_run_with_its_digest(group_of: Any) -> None:
    replies: list[Any] = []
    engine = _two_hosts(group_of, replies)
    x = np.arange(8, dtype=np.float32)
    out = engine.run(lambda x: {f"leaf{i}": x + i for i in range(100)}, args=(x,))
    gathered = engine.gather(out, axis=0)
    copies = 2 * len(jax.devices())  # each in-process host runs on all the devices
    for i in range(100):  # both hosts hold the same values, described once
        np.testing.assert_array_equal(gathered[f"leaf{i}"], np.tile(x + i, copies))
    ((_, _, first),) = [r for r in replies if r[:2] == (0, ops.Run)]
    ((_, _, second),) = [r for r in replies if r[:2] == (1, ops.Run)]
    assert isinstance(first, ops.Digested) and isinstance(second, ops.Digest)
    assert second.digest == first.digest == result_digest(first.result)
    # What host 1 sends for 100 leaves is a fraction of host 0's reply.
    assert len(channel_codec.encode(second)[0]) * 20 < len(channel_codec.encode(first)[0])
    # Operations whose results may differ between hosts go whole from each.
    assert all(not isinstance(r, ops.Digest) for _, op, r in replies if op is not ops.Run)


def test_a_host_whose_digest_differs_fails_the_operation(group_of: Any) -> None:
    def diverge(reply: Any) -> Any:
        return ops.Digest(bytes(16)) if isinstance(reply, ops.Digest) else reply

    engine = _two_hosts(group_of, [], host_one=diverge)
    with pytest.raises(ops.DivergedError, match=r"Host 1's result of operation Run "
                                                r"differs from host 0's") as info:
        engine.run(lambda x: x * 2, args=(np.arange(8, dtype=np.float32),))
    assert "failed on host(s) [1] of 2" in "\n".join(info.value.__notes__)


def test_an_exception_that_cannot_come_back_travels_as_its_description() -> None:
    error = RemoteError.of(_TwoArgs(1, 2), "tb").error
    assert type(error) is RuntimeError
    assert str(error).startswith("_TwoArgs: 1-2 (this exception could not be pickled and "
                                 "unpickled:")
    kept = RemoteError.of(KeyError("k"), "tb").error  # one that can keeps its type
    assert type(kept) is KeyError and kept.args == ("k",)


def test_a_function_the_worker_evicted_is_defined_again(
        group_of: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real HostOperations whose function cache holds one step function: running two
    in turn evicts each before its next use, and the group engine defines it again."""
    from jaxpod.service.slices.group_engine import GroupEngine
    from jaxpod.shipping import ship
    from jaxpod.worker.engine import Engine
    from jaxpod.worker.host_operations import HostOperations

    def double(x: Any) -> Any:
        return x * 2

    def shift(x: Any) -> Any:
        return x + 3

    biggest = max(len(ship(double).payload), len(ship(shift).payload))
    monkeypatch.setenv("JAXPOD_FUNCTION_CACHE_BYTES", str(biggest + 1))  # one fits
    host = HostOperations(0, Engine())
    engine = GroupEngine(group_of([host.execute]))
    x = np.arange(8, dtype=np.float32)
    for _ in range(2):
        for fn, expected in ((double, x * 2), (shift, x + 3)):
            out = engine.run(fn, args=(x,))
            np.testing.assert_array_equal(engine.gather(out, axis=0),
                                          np.tile(expected, host.engine.num_replicas_in_sync))
    assert len(host.functions._functions) == 1  # the cache really held only one
