"""Engine overhead against plain JAX on the same devices.

1. ``run_steps`` (K steps in one on-device loop, input from a distributed dataset)
   against a hand-written ``jax.jit`` + ``shard_map`` + ``lax.scan`` loop doing the
   same training math on the same input; both pay for moving the input to the devices.
   Target: time-per-step ratio <= 1.05.
2. ``run`` of a trivial function against a bare jitted call on the same array.
   Target: <= 2x.

Usage: python benchmarks/engine.py [--quick] [--devices N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import interleaved_medians, report, target, use_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--steps", type=int, default=100, help="steps per run_steps call (K)")
    args = parser.parse_args()

    use_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpod

    k = args.steps
    repeats = 5 if args.quick else 15
    strategy = jaxpod.TPUStrategy(steps_per_run=k)
    n = strategy.num_replicas_in_sync
    mesh = strategy.mesh
    rows, features, hidden = 32, 64, 256
    global_batch = rows * n
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * k, features)).astype(np.float32)
    y = rng.normal(size=(global_batch * k, 1)).astype(np.float32)
    batches = [(x[i:i + global_batch], y[i:i + global_batch])
               for i in range(0, len(x), global_batch)]
    params = {"w1": rng.normal(size=(features, hidden)).astype(np.float32) * 0.05,
              "w2": rng.normal(size=(hidden, 1)).astype(np.float32) * 0.05}

    def loss_fn(p: dict, xb: jax.Array, yb: jax.Array) -> jax.Array:
        return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] - yb) ** 2)

    def sgd(p: dict, grads: dict) -> dict:
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

    # --- jaxpod: run_steps over a distributed dataset
    def jaxpod_step(p: dict, batch: tuple) -> tuple:
        ctx = jaxpod.get_replica_context()
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        return sgd(p, ctx.all_reduce("MEAN", grads)), {"loss": loss}

    # A repeating dataset (like tf.data's .repeat()) read by one iterator, as in training.
    iterator = iter(strategy.experimental_distribute_dataset(itertools.cycle(batches)))
    carried = {"jaxpod": params, "plain": None}

    def run_jaxpod() -> None:
        # K steps per call; the state stays on the devices between calls.
        state, out = strategy.run_steps(jaxpod_step, iterator,
                                        initial_state=carried["jaxpod"])
        carried["jaxpod"] = state
        out["loss"].array.block_until_ready()

    # --- plain JAX: the same math, hand-written
    def plain_body(p: dict, xs: jax.Array, ys: jax.Array) -> tuple:
        p = jax.tree.map(lambda a: a[0], p)

        def one(p: dict, batch: tuple) -> tuple:
            loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
            return sgd(p, lax.pmean(grads, "replica")), loss

        p, losses = lax.scan(one, p, (xs[0], ys[0]))
        return jax.tree.map(lambda a: a[None], p), losses[-1][None]

    sharding = NamedSharding(mesh, P("replica"))
    plain = jax.jit(jax.shard_map(plain_body, mesh=mesh, in_specs=P("replica"),
                                  out_specs=P("replica"), check_vma=False))
    carried["plain"] = jax.device_put(
        jax.tree.map(lambda a: np.broadcast_to(a, (n, *a.shape)), params), sharding)

    def run_plain() -> None:
        # Same host work a user must do: stack K global batches, split per replica, place.
        xs = np.stack([b[0] for b in batches]).reshape(k, n, rows, features).swapaxes(0, 1)
        ys = np.stack([b[1] for b in batches]).reshape(k, n, rows, 1).swapaxes(0, 1)
        carried["plain"], loss = plain(carried["plain"], jax.device_put(xs, sharding),
                                       jax.device_put(ys, sharding))
        loss.block_until_ready()

    loop = interleaved_medians({"jaxpod": run_jaxpod, "plain": run_plain}, repeats)

    # --- per-call overhead of run for a trivial function
    def trivial(v: jax.Array) -> jax.Array:
        return v + 1

    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((4,), ctx.replica_id_in_sync_group, np.float32))
    bare = jax.jit(trivial)
    calls = 200 if args.quick else 1000

    def many_runs() -> None:
        for _ in range(calls):
            out = strategy.run(trivial, args=(value,))
        out.array.block_until_ready()

    def many_bare() -> None:
        for _ in range(calls):
            out = bare(value.array)
        out.block_until_ready()

    call = interleaved_medians({"run": many_runs, "bare": many_bare}, repeats)
    step_ratio = loop["jaxpod"] / loop["plain"]
    call_ratio = call["run"] / call["bare"]
    figures = {
        "devices": n, "steps_per_call": k, "per_replica_rows": rows,
        "run_steps_ms_per_step": round(1e3 * loop["jaxpod"] / k, 4),
        "plain_scan_ms_per_step": round(1e3 * loop["plain"] / k, 4),
        "run_steps_vs_plain_ratio": round(step_ratio, 4),
        "run_us_per_call": round(1e6 * call["run"] / calls, 2),
        "bare_jit_us_per_call": round(1e6 * call["bare"] / calls, 2),
        "run_vs_bare_jit_ratio": round(call_ratio, 4),
        "repeats": repeats,
    }
    for name, value_ in figures.items():
        print(f"{name:>28}: {value_}")
    report("engine", figures, {
        "run_steps_vs_plain_ratio": target(step_ratio, "<=", 1.05),
        "run_vs_bare_jit_ratio": target(call_ratio, "<=", 2.0),
    })


if __name__ == "__main__":
    main()
