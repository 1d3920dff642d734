"""A global-view (``mesh=``) job's step rate against plain ``jax.distributed``.

One run on one simulated v4-16 (``LocalTPUCluster``: 2 hosts x 4 chips, JAX on CPU,
gloo across the hosts). Both sides run the same functions: ``init`` makes a 2-layer
MLP's weights, split tensor-parallel over ``model`` and FSDP over ``data`` on a
``{"data": 4, "model": 2}`` mesh; ``step`` is one SGD step on a global batch of
``ROWS`` rows split over ``data``.

* ``job_steps_per_s``: a jaxpod job (``steps_per_run=10``, its batches from a list of
  global batches through the hosts' infeeds), steps over the time between the client
  seeing its first loop done (compiled) and its last.
* ``plain_steps_per_s``, the lower bound: two ``jax.distributed`` processes on the
  same devices, the step under ``jax.jit`` with the state donated, called step by step,
  each step's global batch put on the devices from host memory
  (``make_array_from_callback``), waiting for the state every ``LOOP`` steps (as the
  job's loops do), timed after one warm-up step. ``plain_preplaced_steps_per_s``: the
  same on batches already on the devices (no input cost at all; shown, not a target).
* ``job_vs_plain`` = ``job_steps_per_s / plain_steps_per_s`` (target >= 0.95).
Both final states are checked against each other (allclose: the same steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import follow_job, free_port, parse_parts, report, run_processes, target
from jobs import rounded, running_service

ACCELERATOR = "v4-16"
HOSTS, CHIPS = 2, 4
MESH = {"data": 4, "model": 2}
ROWS, WIDTH = 256, 512
LOOP = 10
BATCHES = 4
TIMEOUT_S = 900.0


# ------------------------------------------------------------------ the model
def init() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    k1, k2 = jax.random.split(jax.random.key(0))
    scale = 1.0 / np.sqrt(WIDTH)
    return {
        "w1": jax.lax.with_sharding_constraint(
            jax.random.normal(k1, (WIDTH, WIDTH), jnp.float32) * scale, P("data", "model")),
        "w2": jax.lax.with_sharding_constraint(
            jax.random.normal(k2, (WIDTH, WIDTH), jnp.float32) * scale, P("model", "data")),
    }


def step(state: Any, batch: Any) -> Any:
    import jax
    import jax.numpy as jnp

    def loss_fn(params: Any) -> Any:
        hidden = jax.nn.relu(batch["x"] @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    return jax.tree.map(lambda p, g: p - 0.01 * g, state, grads), {"loss": loss}


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
             "y": rng.normal(size=(ROWS, WIDTH)).astype(np.float32)} for _ in range(BATCHES)]


# ------------------------------------------------------------------ plain JAX
def plain_process(process_id: int, port: int, steps: int, out: str) -> None:
    """One of the two plain processes: prints its steps/s; process 0 saves the state."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", CHIPS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=HOSTS,
                               process_id=process_id)
    from jax.experimental import mesh_utils, multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(mesh_utils.create_device_mesh(tuple(MESH.values())), tuple(MESH))
    sharding = NamedSharding(mesh, P("data"))
    host_batches = batches()

    def put(b: dict[str, np.ndarray]) -> dict[str, Any]:  # a global batch from numpy
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
                for k, v in b.items()}

    def timed(state: Any, first: int, feed: Any) -> tuple[Any, float]:
        multihost_utils.sync_global_devices(f"from {first}")
        start = time.perf_counter()
        for i in range(first, first + steps - 1):
            state, _ = jitted(state, feed(i))
            if i % LOOP == 0:  # as a loop reading its loss every LOOP steps (gloo on
                jax.block_until_ready(state)  # CPU hangs with unbounded dispatch)
        jax.block_until_ready(state)
        return state, (steps - 1) / (time.perf_counter() - start)

    with jax.set_mesh(mesh):
        state = jax.jit(init)()
        jitted = jax.jit(step, donate_argnums=0)
        state, _ = jitted(state, put(host_batches[0]))  # compiles
        # Fed as the job is (each step's batch from host memory), then from batches
        # already on the devices (no input cost: a bound no real loop reaches).
        state, rate = timed(state, 1, lambda i: put(host_batches[i % BATCHES]))
        final = {k: multihost_utils.process_allgather(v, tiled=True)
                 for k, v in state.items()}
        placed = [put(b) for b in host_batches]
        state, preplaced = timed(state, steps, lambda i: placed[i % BATCHES])

    if process_id == 0:
        np.savez(out, **{k: np.asarray(v) for k, v in final.items()})
    print(f"PLAIN {rate} {preplaced}", flush=True)


def measure_plain(steps: int, out: str) -> tuple[float, float]:
    port = free_port()
    outs = run_processes("sharded", "plain_process(*map(int, sys.argv[1:4]), sys.argv[4])",
                         [[str(i), str(port), str(steps), out] for i in range(HOSTS)],
                         TIMEOUT_S)
    rates = [tuple(map(float, line.split()[1:])) for o in outs for line in o.splitlines()
             if line.startswith("PLAIN ")]
    return min(r[0] for r in rates), min(r[1] for r in rates)


# ------------------------------------------------------------------ jaxpod
def measure_job(client: Any, steps: int) -> tuple[float, dict[str, np.ndarray]]:
    job = client.submit(step, steps=steps, accelerator_type=ACCELERATOR, init_fn=init,
                        dataset=batches(), steps_per_run=LOOP, outputs={"loss": "MEAN"},
                        mesh=MESH, name="bench-sharded")
    seen = follow_job(job, lambda status: None, TIMEOUT_S)
    # From the first loop done (compiled) to the last loop done: the final checkpoint,
    # which the plain side does not write, comes after (a status seen again for the
    # same step, e.g. while that checkpoint is written, is not a loop).
    first_seen: dict[int, float] = {}
    for t, s in seen:
        if s.state == "RUNNING" and s.step >= LOOP:
            first_seen.setdefault(s.step, t)
    loops = sorted((t, step) for step, t in first_seen.items())
    (t0, s0), (t1, s1) = loops[0], loops[-1]
    if s1 - s0 < steps // 2:
        raise RuntimeError(f"saw too few of the job's loops to time it: {loops}")
    state = job.result(timeout=TIMEOUT_S).state
    return (s1 - s0) / (t1 - t0), {k: np.asarray(v) for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_parts(parser, ("plain", "jobs"))
    steps = 60 if args.quick else 300
    repeats = 1 if args.quick else 3
    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "mesh": MESH, "rows": ROWS,
                               "width": WIDTH, "steps": steps, "repeats": repeats,
                               "cores": os.cpu_count()}
    targets: dict[str, Any] = {}
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jaxpod-sharded-{os.getpid()}.npz")
    plain_state: dict[str, np.ndarray] = {}
    if "plain" in args.parts:
        rates = [measure_plain(steps, out) for _ in range(repeats)]
        figures["plain_steps_per_s"] = statistics.median(r[0] for r in rates)
        figures["plain_preplaced_steps_per_s"] = statistics.median(r[1] for r in rates)
        with np.load(out) as saved:
            plain_state = dict(saved)
        os.unlink(out)
        print(f"plain: {rates} steps/s", flush=True)
    if "jobs" in args.parts:
        import jaxpod
        from jaxpod.service.local_cluster import LocalTPUCluster

        with LocalTPUCluster(ACCELERATOR) as cluster, \
                running_service(cluster.address, "sharded") as service, \
                jaxpod.connect(service.address, token=service.token) as client:
            runs = [measure_job(client, steps) for _ in range(repeats)]
        figures["job_steps_per_s"] = statistics.median(r for r, _ in runs)
        print(f"job: {[r for r, _ in runs]} steps/s", flush=True)
        for key, value in plain_state.items():
            if not np.allclose(runs[0][1][key], value, rtol=1e-4, atol=1e-5):
                raise RuntimeError(f"the job's {key} differs from the plain run's")
    if "plain_steps_per_s" in figures and "job_steps_per_s" in figures:
        figures["job_vs_plain"] = figures["job_steps_per_s"] / figures["plain_steps_per_s"]
        targets["job_vs_plain"] = target(figures["job_vs_plain"], ">=", 0.95)
    report("sharded", rounded(figures), targets)


if __name__ == "__main__":
    main()
