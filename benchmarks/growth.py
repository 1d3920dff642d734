"""How jaxpod's costs grow with the number of hosts: 1, 2, 4 (and 8) simulated hosts.

One local cluster holds one slice of each type (v4-8: 1 host, v4-16: 2, v4-32: 4,
v4-64: 8; 4 chips per host) under one ``jaxpod serve``. For each, in one run:

* ``allocation_s``: ``client.strategy(type)`` (acquire the slice, start and configure
  its host workers), the first acquisition of that type;
* ``run_reduce_p50_ms``: a trivial remote ``run`` and ``reduce`` of its result (a
  synchronous round trip through every host), p50;
* ``run_steps_vs_workers``: remote ``run_steps`` time per call over the time the
  busiest host worker spent running it (what reaching the hosts adds), medians;
* ``run_steps_vs_one_process``: the same remote time over the same program on an
  in-process ``jaxpod.TPUStrategy`` with as many CPU devices in one child process
  (plain JAX on the same devices in one process: it needs no cross-process
  collectives, which the hosts run over gloo on loopback here), calls alternating;
* ``gather_gbps``: ``strategy.gather`` of a float32 result to the client, GB/s;
* ``job_first_step_s``: a submitted job's first step seen by the client after submit,
  on the slice the strategy just gave back (warm: its workers are kept);
* ``recovery_s``: a running job's host worker SIGKILLed -> its first step after
  resuming (``benchmarks/recovery.py``'s job and measurement).

Each figure is also fitted as ``a + b * hosts`` (least squares, ``*_per_host`` is
``b``), and the times' fits are read at 64 and 256 hosts (``*_at_64``, ``*_at_256``):
a paper estimate from the per-host costs measured here, not a measurement. Every
simulated host shares this machine's cores, so a figure that grows here may grow less
on real hosts, each with its own CPUs; the fit's slope is an upper bound of the
per-host cost on this machine.

The last line of output is the JSON report (per-host-count lists under ``figures``).

Usage: ``python benchmarks/growth.py [--quick] [--hosts 1,2,4,8]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import call_times, follow_job, report
from jobs import running_service
from recovery import VICTIM_HOST, interrupted, uninterrupted

from service import Child, identity, measure_steps, percentiles_ms, replica_vector

#: The slice type with this many hosts (4 chips per host).
TYPE_BY_HOSTS = {1: "v4-8", 2: "v4-16", 4: "v4-32", 8: "v4-64"}
CHIPS_PER_HOST = 4
FIGURES = ("allocation_s", "run_reduce_p50_ms", "run_steps_vs_workers",
           "run_steps_vs_one_process", "gather_gbps", "job_first_step_s", "recovery_s")
EXTRAPOLATE_TO = (64, 256)
#: The figures read at 64 and 256 hosts: times that grow with hosts. The ratios and
#: the gather rate show no per-host trend a line could carry that far.
EXTRAPOLATED = ("allocation_s", "run_reduce_p50_ms", "job_first_step_s", "recovery_s")


def trivial_step(state: Any, batch: Any) -> Any:
    import jaxpod

    ctx = jaxpod.get_replica_context()
    return {"n": state["n"] + ctx.all_reduce("SUM", batch.sum() * 0 + 1.0)}, {}


def measure_gather(strategy: Any, mib: int, repeats: int) -> float:
    """GB/s of gathering a ``mib`` MiB float32 result (median seconds)."""
    replicas = strategy.num_replicas_in_sync
    rows = (mib << 20) // (replicas * 256 * 4)

    def fill(x: Any) -> Any:
        import jax.numpy as jnp

        return jnp.ones((rows, 256), jnp.float32) * x

    big = strategy.run(fill, args=(np.float32(2),))
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = strategy.gather(big, 0)
        if i:  # the first warms both sides up
            times.append(time.perf_counter() - start)
        assert out.shape == (rows * replicas, 256) and float(out[-1, -1]) == 2.0
    return (rows * replicas * 256 * 4) / statistics.median(times) / 1e9


def measure_first_step(client: Any, accelerator: str) -> float:
    """Seconds from submit to the client seeing the job's first step."""
    start = time.time()
    job = client.submit(trivial_step, steps=4, accelerator_type=accelerator,
                        initial_state={"n": np.float32(0)}, dataset=[np.ones((8, 2))],
                        name=f"growth-first-step-{accelerator}")
    seen = follow_job(job, lambda status: None, 300)
    return next(at for at, s in seen if s.step >= 1) - start


def measure_hosts(client: Any, hosts: int, quick: bool) -> dict[str, float]:
    accelerator = TYPE_BY_HOSTS[hosts]
    chips = hosts * CHIPS_PER_HOST
    steps = 20
    start = time.perf_counter()
    strategy = client.strategy(accelerator, steps_per_run=steps)
    figures = {"allocation_s": time.perf_counter() - start}
    child = None
    try:
        value = strategy.experimental_distribute_values_from_function(replica_vector)
        calls = 30 if quick else 200
        p50, _ = percentiles_ms(call_times(
            lambda: strategy.reduce("SUM", strategy.run(identity, args=(value,)), axis=None),
            calls, warmup=10))
        figures["run_reduce_p50_ms"] = p50
        child = Child(chips, steps)
        child.wait_ready()
        times = measure_steps(strategy, child, steps, 2 if quick else 9)
        figures["run_steps_vs_workers"] = times["remote"] / times["workers"]
        figures["run_steps_vs_one_process"] = times["remote"] / times["plain"]
        child.close()
        child = None
        figures["gather_gbps"] = measure_gather(strategy, 16 if quick else 64,
                                                2 if quick else 7)
    finally:
        if child is not None:
            child.close()
        strategy.close()
    figures["job_first_step_s"] = measure_first_step(client, accelerator)
    expected, _, _ = uninterrupted(client, f"growth-reference-{accelerator}", accelerator)
    figures["recovery_s"] = interrupted(
        client, f"growth-recovery-{accelerator}", signal.SIGKILL, min(VICTIM_HOST, hosts - 1),
        expected, accelerator)["to_first_step_s"]
    print(f"{hosts} host(s), {accelerator}: " + ", ".join(
        f"{k} {v:.4g}" for k, v in figures.items()), flush=True)
    return figures


def fit(hosts: list[int], values: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``a + b * hosts``."""
    b, a = np.polyfit(np.asarray(hosts, float), np.asarray(values, float), 1)
    return float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--hosts", default=None,
                        help="host counts, from 1,2,4,8 (default 1,2,4,8; 1,2 with "
                             "--quick, a smoke run)")
    args = parser.parse_args()
    counts = [int(h) for h in (args.hosts or ("1,2" if args.quick else "1,2,4,8"))
              .split(",")]
    unknown = [h for h in counts if h not in TYPE_BY_HOSTS]
    if unknown or len(counts) < 2:
        parser.error(f"--hosts takes two or more of {sorted(TYPE_BY_HOSTS)}; got {args.hosts}")

    import jaxpod
    from jaxpod.service.capacity.local_cluster import LocalTPUCluster

    measured: dict[int, dict[str, float]] = {}
    types = ",".join(TYPE_BY_HOSTS[h] for h in counts)
    with LocalTPUCluster(types) as cluster, \
            running_service(cluster.address, "growth") as service, \
            jaxpod.connect(service.address, token=service.token) as client:
        for hosts in counts:
            measured[hosts] = measure_hosts(client, hosts, args.quick)

    figures: dict[str, Any] = {"hosts": counts, "cores": os.cpu_count(),
                               "chips_per_host": CHIPS_PER_HOST}
    for name in FIGURES:
        values = [measured[h][name] for h in counts]
        a, b = fit(counts, values)
        figures[name] = [round(v, 4) for v in values]
        figures[f"{name}_per_host"] = round(b, 5)
        for at in EXTRAPOLATE_TO if name in EXTRAPOLATED else ():
            figures[f"{name}_at_{at}"] = round(a + b * at, 4)
    report("growth", figures, {})


if __name__ == "__main__":
    main()
