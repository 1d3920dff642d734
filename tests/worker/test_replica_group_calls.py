"""ReplicaGroup.call over real operation channels (in-process channel servers standing
in for the host workers): replies stay in step when one cannot be read, a message that
does not pickle is not sent, and waiting for the group does not eat an operation's
own time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jaxpod.errors import JaxpodError
from jaxpod.operations import RemoteError
from jaxpod.service.group_engine import DropQueue
from jaxpod.service.replica_group import ReplicaGroup
from jaxpod.worker import channel


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
    def handle(seq: int, op: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((index, seq, op, kwargs.get("dropped")))
        if op == "unreadable" and index == 0:
            return _Unloadable(1)
        return f"host{index}-{op}-{seq}"
    return handle


def test_an_unreadable_reply_leaves_the_next_replies_in_step(group_of: Any) -> None:
    seen: list[Any] = []
    group = group_of([_host(0, seen), _host(1, seen)])
    with pytest.raises(JaxpodError, match=r"Host 0's reply to operation 'unreadable' could "
                                          r"not be unpickled here: TypeError"):
        group.call("unreadable")
    # host 1's reply to that operation was read too: this one gets its own
    assert group.call("next") == ["host0-next-1", "host1-next-1"]
    assert sorted(s[:3] for s in seen) == [(0, 0, "unreadable"), (0, 1, "next"),
                                           (1, 0, "unreadable"), (1, 1, "next")]


def test_a_message_that_does_not_pickle_is_not_sent(group_of: Any) -> None:
    seen: list[Any] = []
    group = group_of([_host(0, seen), _host(1, seen)])
    drops = DropQueue()
    drops.values.extend([5, 6])
    with pytest.raises(TypeError, match="lock"):
        group.call("op", threading.Lock(), drops=drops)
    assert seen == [] and list(drops.values) == [5, 6]  # nothing sent, nothing lost
    assert group.call("op", drops=drops) == ["host0-op-0", "host1-op-0"]  # number unused
    assert [d.values for _, _, _, d in seen] == [(5, 6), (5, 6)] and not drops.values


def test_waiting_for_the_group_does_not_count_against_the_time_out(group_of: Any) -> None:
    started = threading.Event()

    def handle(seq: int, op: str, *args: Any, **kwargs: Any) -> Any:
        if op == "long":
            started.set()
        time.sleep(1.5 if op == "long" else 1.0)  # each operation's own duration
        return op

    group = group_of([handle])
    long = threading.Thread(target=group.call, args=("long",), kwargs={"timeout": 3})
    long.start()
    assert started.wait(10)
    try:
        # ~1.5 s waiting for "long", then 1 s of its own: within 2 s of its own time
        assert group.call("short", timeout=2) == ["short"]
    finally:
        long.join(10)
    assert group._broken is None


class _TwoArgs(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}-{b}")


def test_an_exception_that_cannot_come_back_travels_as_its_description() -> None:
    error = RemoteError.of(_TwoArgs(1, 2), "tb").error
    assert type(error) is RuntimeError
    assert str(error).startswith("_TwoArgs: 1-2 (this exception could not be pickled and "
                                 "unpickled:")
    kept = RemoteError.of(KeyError("k"), "tb").error  # one that can keeps its type
    assert type(kept) is KeyError and kept.args == ("k",)
