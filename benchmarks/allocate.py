"""Time to allocate and release a whole 2-host slice on the simulated local TPU cluster.

Starts the local cluster (one v4-16: 2 hosts x 4 chips; two of them without
``--quick``, to time a 2-slice multi-slice allocation as well), connects as a driver,
warms up, then times ``allocate("v4-16")`` + ``release()`` 10 times. ``release()``
returns once the hosts show their chips free again, so each round trip ends with the
slice ready for the next request.

The last line printed is one JSON object:
``{"benchmark": "allocate", "figures": {...}, "targets": {"allocate_release_s_p50": ...}}``.

Usage: ``python benchmarks/allocate.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import ray

from jaxpod.service.capacity.allocation import Allocation
from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.local_cluster import LocalTPUCluster
from jaxpod.service.capacity.resolvers.ray import connect

TARGET_S = 1.0
ROUNDS = 10


def _round_trips(allocate: Callable[[], Allocation], rounds: int) -> dict[str, list[float]]:
    """``rounds`` allocate + release pairs, timed separately and together."""
    times: dict[str, list[float]] = {"allocate": [], "release": [], "both": []}
    for _ in range(rounds):
        start = time.perf_counter()
        allocation = allocate()
        allocated = time.perf_counter()
        allocation.release()
        released = time.perf_counter()
        times["allocate"].append(allocated - start)
        times["release"].append(released - allocated)
        times["both"].append(released - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one slice, one warm-up round (CI); the 10 timed rounds stay")
    args = parser.parse_args(argv)
    slices = "v4-16" if args.quick else "v4-16,v4-16"
    figures: dict[str, float] = {}
    start = time.perf_counter()
    with LocalTPUCluster(slices) as cluster:
        figures["cluster_start_s"] = time.perf_counter() - start
        connect(cluster.address)
        try:
            allocator = SliceAllocator()

            def one_slice() -> Allocation:
                return allocator.allocate("v4-16", timeout_s=60)

            figures["first_allocate_release_s"] = _round_trips(one_slice, 1)["both"][0]
            _round_trips(one_slice, 1 if args.quick else 3)  # warm-up
            times = _round_trips(one_slice, ROUNDS)
            if not args.quick:
                two = _round_trips(lambda: allocator.allocate("v4-16", 2, timeout_s=60), ROUNDS)
                figures["two_slice_allocate_release_s_p50"] = statistics.median(two["both"])
        finally:
            ray.shutdown()
    figures.update({
        "allocate_s_p50": statistics.median(times["allocate"]),
        "release_s_p50": statistics.median(times["release"]),
        "allocate_release_s_p50": statistics.median(times["both"]),
        "allocate_release_s_max": max(times["both"]),
        "rounds": ROUNDS,
    })
    p50 = figures["allocate_release_s_p50"]
    for name, value in figures.items():
        print(f"{name:38s} {value:.4f}" if isinstance(value, float) else f"{name:38s} {value}")
    print(json.dumps({
        "benchmark": "allocate",
        "figures": {k: round(v, 6) for k, v in figures.items()},
        "targets": {"allocate_release_s_p50": {
            "value": round(p50, 6), "target": f"< {TARGET_S}", "met": p50 < TARGET_S}},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
