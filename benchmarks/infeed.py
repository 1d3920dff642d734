"""Infeed overlap: input preparation runs while the devices compute.

A dataset whose producer takes ``T_in`` per batch (simulated I/O latency) feeds a step
that takes ``T_c`` on the devices. Run serially that costs ``T_in + T_c`` per step; with
the infeed thread preparing the next batches during the current step it should cost
about ``max(T_in, T_c)``. Target: steady-state step time <= 1.15 x max(T_in, T_c).
Also reports the achieved overlap: (serial - measured) / min(T_in, T_c), 1.0 = perfect.

Usage: python benchmarks/infeed.py [--quick] [--t-in-ms 20] [--devices 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import median_time, report, target, use_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (CI smoke run)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--t-in-ms", type=float, default=20.0, help="producer time per batch")
    args = parser.parse_args()

    use_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import jaxpod

    strategy = jaxpod.TPUStrategy()
    n = strategy.num_replicas_in_sync
    t_in = args.t_in_ms / 1e3
    steps = 20 if args.quick else 60
    rows, features = 8, 128
    rng = np.random.default_rng(0)
    batch = rng.normal(size=(rows * n, features)).astype(np.float32)

    def make_step(iterations: int):
        def step(x: jax.Array) -> jax.Array:
            w = jnp.eye(features, dtype=x.dtype) * 0.999
            y = lax.fori_loop(0, iterations, lambda _, y: jnp.tanh(y @ w), x)
            return jaxpod.get_replica_context().all_reduce("SUM", jnp.sum(y))
        return step

    # Calibrate the device step to take about T_in (the hardest case: equal halves).
    value = strategy.experimental_distribute_values_from_function(lambda _: batch[:rows])
    def step_time(fn: object) -> float:
        return median_time(lambda: strategy.run(fn, args=(value,)).array.block_until_ready(),
                           repeats=5, warmup=2)

    iterations = 16
    while (t_c := step_time(make_step(iterations))) < t_in and iterations < 1 << 16:
        iterations *= 2
    # One proportional correction brings T_c close to T_in.
    iterations = max(1, round(iterations * t_in / t_c))
    step_fn = make_step(iterations)
    t_c = step_time(step_fn)

    def slow_dataset(count: int):
        for _ in range(count):
            time.sleep(t_in)  # stands in for reading and decoding input
            yield batch

    def measure() -> float:
        it = iter(strategy.experimental_distribute_dataset(slow_dataset(steps + 3)))
        for _ in range(3):  # reach steady state: prefetch queue full, step compiled
            strategy.run(step_fn, args=(next(it),)).array.block_until_ready()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            strategy.run(step_fn, args=(next(it),)).array.block_until_ready()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    measured = measure()
    bound = max(t_in, t_c)
    serial = t_in + t_c
    overlap = (serial - measured) / min(t_in, t_c)
    ratio = measured / bound
    figures = {"devices": n, "t_in_ms": round(t_in * 1e3, 3), "t_c_ms": round(t_c * 1e3, 3),
               "step_ms": round(measured * 1e3, 3), "serial_ms": round(serial * 1e3, 3),
               "ratio_to_max": round(ratio, 4), "overlap": round(overlap, 4),
               "steps": steps}
    for name, v in figures.items():
        print(f"{name:>14}: {v}")
    report("infeed", figures, {"step_vs_max_ratio": target(ratio, "<=", 1.15)})


if __name__ == "__main__":
    main()
