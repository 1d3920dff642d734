"""The coordinator's share of each operation at pod host counts: reading every host's
reply, on 8, 64 and 256 channels.

A replica group's coordinator reads each host's reply to every operation, in host
order, on one thread (``channel_io.read_replies``, as ``ReplicaGroup`` calls it). This
measures that step alone, at host counts no simulated cluster here reaches: one socket
pair per host, whose far end holds the host's reply already (written untimed before
each operation, as if every host had answered). The reply is a ``run``'s on a state of
``LEAVES`` leaves (its ``ValueInfos``, the same on every host, as hosts in lockstep
answer). So each figure is the coordinator's CPU per operation for the replies alone;
on a pod, the hosts' sockets are on other machines and the same reads come from the
network.

Figures, for each host count ``n``:

* ``ms_per_op_<n>``: median time to read and decode every host's reply;
* ``decode_each_ms_per_op_<n>``: the same, each reply decoded on its own (no
  ``channel_codec.Decoded``: what the coordinator did before), for comparison;
* ``marginal_us_per_host_<a>_to_<b>``: what each host from ``a`` to ``b`` adds.

Targets: ``ms_per_op_256_vs_64`` (<= 4: four times the hosts cost at most four times
the time; the one decode makes it less) and ``decode_once_vs_each_256`` (<= 0.5). The
marginal figures are differences of medians taken minutes apart, within this
machine's noise at 8 hosts: read them, do not target them.

The last line of output is the JSON report.

Usage: ``python benchmarks/fan_in.py [--quick]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import report, target

from jaxpod import trees
from jaxpod.operations import Digest, Digested, HandleInfo
from jaxpod.service.slices.replica_group import undigest
from jaxpod.worker import channel_codec, channel_io
from jaxpod.worker.result_digest import result_digest

HOSTS = (8, 64, 256)
LEAVES = 1000
DEADLINE_S = 60.0


def run_reply(leaves: int) -> Any:
    """What a host answers a ``run`` whose state has ``leaves`` leaves: their infos."""
    return trees.freeze({f"layer{i}": {"w": HandleInfo(2 * i, (512, 512), "float32", None),
                                       "b": HandleInfo(2 * i + 1, (512,), "float32", None)}
                         for i in range(leaves // 2)}, "result")


Encoded = tuple[bytes, list[Any]]


def read_replies(decode_once: bool) -> Callable[[list[socket.socket], float], list[Any]]:
    """Reads every host's reply as ``ReplicaGroup`` does, with one
    ``channel_codec.Decoded`` per operation, and resolves digests; without
    ``decode_once``, each reply decoded (as it did before ``channel_codec.Decoded``)."""

    def read(socks: list[socket.socket], deadline: float) -> list[Any]:
        out: list[Any] = []
        unreadable = channel_io.read_replies(socks, deadline, None, out,
                                             channel_codec.Decoded() if decode_once else None)
        assert not unreadable, unreadable
        return undigest(out, "Run")

    return read


def op_times(read: Callable[[list[socket.socket], float], list[Any]], hosts: int,
             first: Encoded, others: Encoded, expected: Any, repeats: int) -> list[float]:
    """Seconds per operation of ``read`` over ``hosts`` channels, each reply written
    before the clock starts: ``first`` on host 0's, ``others`` on the rest."""
    pairs = [socket.socketpair() for _ in range(hosts)]
    ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    try:
        times = []
        for _ in range(repeats + 1):  # the first: warm-up
            channel_io.send(theirs[:1], first)
            channel_io.send(theirs[1:], others)
            start = time.perf_counter()
            replies = read(ours, time.monotonic() + DEADLINE_S)
            times.append(time.perf_counter() - start)
            assert len(replies) == hosts and replies[-1] == expected
        return times[1:]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    args = parser.parse_args()
    # Two descriptors per host.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * max(HOSTS) + 256)),
                                                hard))
    repeats = 20 if args.quick else 100  # an operation at 256 hosts takes ~10 ms
    reply = run_reply(LEAVES)
    full = channel_codec.encode(reply)
    digest = result_digest(reply)
    assert digest is not None
    first, others = (channel_codec.encode(Digested(reply, digest)),
                     channel_codec.encode(Digest(digest)))
    figures: dict[str, Any] = {"leaves": LEAVES, "reply_bytes": len(full[0]),
                               "digest_reply_bytes": len(others[0]), "repeats": repeats}
    for hosts in HOSTS:
        now = statistics.median(op_times(read_replies(True), hosts, first, others, reply,
                                         repeats))
        once = statistics.median(op_times(read_replies(True), hosts, full, full, reply,
                                          repeats))
        each = statistics.median(op_times(read_replies(False), hosts, full, full, reply,
                                          2 if args.quick else 10))
        figures[f"ms_per_op_{hosts}"] = round(now * 1e3, 3)
        figures[f"full_ms_per_op_{hosts}"] = round(once * 1e3, 3)
        figures[f"decode_each_ms_per_op_{hosts}"] = round(each * 1e3, 3)
        figures[f"kib_per_op_{hosts}"] = round(
            (len(first[0]) + (hosts - 1) * len(others[0])) / 1024, 1)
        figures[f"full_kib_per_op_{hosts}"] = round(hosts * len(full[0]) / 1024, 1)
        print(f"{hosts} hosts: {now * 1e3:.2f} ms per operation with digests "
              f"({figures[f'kib_per_op_{hosts}']} KiB), {once * 1e3:.2f} with whole "
              f"results decoded once ({figures[f'full_kib_per_op_{hosts}']} KiB), "
              f"{each * 1e3:.2f} decoding each", flush=True)
    for a, b in itertools.pairwise(HOSTS):
        added = (figures[f"ms_per_op_{b}"] - figures[f"ms_per_op_{a}"]) / (b - a) * 1e3
        figures[f"marginal_us_per_host_{a}_to_{b}"] = round(added, 2)
    last = HOSTS[-1]
    report("fan_in", figures, {
        f"ms_per_op_{last}_vs_64": target(
            figures[f"ms_per_op_{last}"] / figures["ms_per_op_64"], "<=", last / 64),
        f"kib_vs_full_{last}": target(
            figures[f"kib_per_op_{last}"] / figures[f"full_kib_per_op_{last}"], "<=", 0.05),
        f"digest_vs_full_{last}": target(
            figures[f"ms_per_op_{last}"] / figures[f"full_ms_per_op_{last}"], "<=", 0.9),
        f"decode_once_vs_each_{last}": target(
            figures[f"full_ms_per_op_{last}"] / figures[f"decode_each_ms_per_op_{last}"],
            "<=", 0.5),
    })


if __name__ == "__main__":
    main()
