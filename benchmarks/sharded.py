"""Global-view (``mesh=``) jobs' step rates against plain ``jax.distributed``.

One run on one simulated v4-16 (2 hosts x 4 chips, JAX on CPU, gloo across the hosts;
the job through a ``jaxpod serve --local`` whose hosts are plain processes, as the
embedded service runs them, or Ray actors with ``--provider ray``), two models; each
side runs the same functions:

* ``mlp``: ``init`` makes a 2-layer MLP's weights, split tensor-parallel over ``model``
  and FSDP over ``data`` on a ``{"data": 4, "model": 2}`` mesh; ``step`` is one SGD
  step on a global batch of ``ROWS`` rows split over ``data``.
* ``transformer``: a 2-layer flax nnx transformer with optax AdamW (92 state leaves;
  :mod:`transformer_model`, the shape of ``examples/transformer_lm.py``), FSDP over
  ``data`` on ``{"data": -1}``, the step written as for ``jax.jit``.

Figures (``transformer_`` in front for the transformer):

* ``job_steps_per_s``: a jaxpod job (``steps_per_run=10``, its batches from a list of
  global batches through the hosts' infeeds), steps over the time between the client
  seeing its first loop done (compiled) and its last: wall from the first loop.
  ``job_productive_steps_per_s``: the job's steps after its first loop over the
  productive seconds its goodput booked for them.
* ``plain_steps_per_s``, the lower bound: two ``jax.distributed`` processes on the
  same devices, as a careful user writes the loop: the step under ``jax.jit`` with the
  state donated, called step by step, each step's global batch put on the devices
  from host memory (``make_array_from_callback``), reading the loss every ``LOOP``
  steps (as the job's loops do), timed after one warm-up step.
  ``plain_preplaced_steps_per_s``: the same on batches already on the devices (no
  input cost at all; shown, not a target).
* ``job_vs_plain`` = ``job_steps_per_s / plain_steps_per_s`` and
  ``job_productive_vs_plain`` (targets >= 0.95).
Both final states are checked against each other (allclose: the same steps).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformer_model
from _common import (
    ServeProcess,
    follow_job,
    free_port,
    kept_log_on_failure,
    parse_parts,
    report,
    run_processes,
    target,
)
from jobs import rounded

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


@dataclass(frozen=True)
class Model:
    """What both sides run: the state's init, the step, the global batches, the mesh
    (``-1``: the rest of the slice's chips) and the figures' prefix."""

    init: Callable[[], Any]
    step: Callable[[Any, Any], Any]
    batches: Callable[[], list[dict[str, np.ndarray]]]
    mesh: dict[str, int]
    prefix: str


MODELS = {
    "mlp": Model(init, step, batches, MESH, ""),
    "transformer": Model(transformer_model.init, transformer_model.step,
                         lambda: transformer_model.batches(BATCHES), {"data": -1},
                         "transformer_"),
}


def concrete(mesh: dict[str, int]) -> dict[str, int]:
    """``mesh`` with its ``-1`` axis sized to the slice's chips."""
    known = math.prod(n for n in mesh.values() if n != -1)
    return {name: n if n != -1 else HOSTS * CHIPS // known for name, n in mesh.items()}


# ------------------------------------------------------------------ plain JAX
def plain_process(name: str, process_id: int, port: int, steps: int, out: str) -> None:
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

    model = MODELS[name]
    axes = concrete(model.mesh)
    mesh = Mesh(mesh_utils.create_device_mesh(tuple(axes.values())), tuple(axes))
    sharding = NamedSharding(mesh, P("data"))
    host_batches = model.batches()

    def put(b: dict[str, np.ndarray]) -> dict[str, Any]:  # a global batch from numpy
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
                for k, v in b.items()}

    def timed(state: Any, first: int, feed: Any) -> tuple[Any, float]:
        multihost_utils.sync_global_devices(f"from {first}")
        start = time.perf_counter()
        for i in range(first, first + steps - 1):
            state, outputs = jitted(state, feed(i))
            if i % LOOP == 0:  # the loss read every LOOP steps (gloo on CPU hangs
                float(outputs["loss"])  # with unbounded dispatch)
        jax.block_until_ready(state)
        return state, (steps - 1) / (time.perf_counter() - start)

    with jax.set_mesh(mesh):
        state = jax.jit(model.init)()
        jitted = jax.jit(model.step, donate_argnums=0)
        state, _ = jitted(state, put(host_batches[0]))  # compiles
        # Fed as the job is (each step's batch from host memory), then from batches
        # already on the devices (no input cost: a bound no real loop reaches).
        state, rate = timed(state, 1, lambda i: put(host_batches[i % BATCHES]))
        final = jax.tree.map(lambda v: multihost_utils.process_allgather(v, tiled=True),
                             state)
        placed = [put(b) for b in host_batches]
        state, preplaced = timed(state, steps, lambda i: placed[i % BATCHES])

    if process_id == 0:
        leaves = jax.tree_util.tree_flatten_with_path(final)[0]
        np.savez(out, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})
    print(f"PLAIN {rate} {preplaced}", flush=True)


def measure_plain(name: str, steps: int, out: str) -> tuple[float, float]:
    port = free_port()
    outs = run_processes("sharded",
                         "plain_process(sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5])",
                         [[name, str(i), str(port), str(steps), out] for i in range(HOSTS)],
                         TIMEOUT_S)
    rates = [tuple(map(float, line.split()[1:])) for o in outs for line in o.splitlines()
             if line.startswith("PLAIN ")]
    return min(r[0] for r in rates), min(r[1] for r in rates)


# ------------------------------------------------------------------ jaxpod
def measure_job(client: Any, model: Model, steps: int
                ) -> tuple[float, float, dict[str, np.ndarray]]:
    """The job's steps/s by wall time from its first loop and by productive time, and
    its final state (flattened by key path)."""
    import jax

    job = client.submit(model.step, steps=steps, accelerator_type=ACCELERATOR,
                        init_fn=model.init, dataset=model.batches(), steps_per_run=LOOP,
                        outputs={"loss": "MEAN"}, mesh=model.mesh,
                        name=f"bench-sharded-{model.prefix or 'mlp_'}".rstrip("_"))
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
    goodput = seen[-1][1].goodput or {}
    productive = goodput.get("productive", 0.0)
    # the first loop's steps ran compiled once their program was (their compile time
    # went to its own category): productive time covers every step
    productive_rate = steps / productive if productive > 0 else float("nan")
    state = job.result(timeout=TIMEOUT_S).state
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return ((s1 - s0) / (t1 - t0), productive_rate,
            {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default 300; 30 with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each side (default 3; 1 with --quick)")
    parser.add_argument("--provider", default="processes", choices=("processes", "ray"),
                        help="how the service's simulated hosts run (default: as the "
                             "embedded service runs them, plain processes)")
    args = parse_parts(parser, ("plain", "jobs", "mlp", "transformer"))
    steps = args.steps or (30 if args.quick else 300)
    repeats = args.repeats or (1 if args.quick else 3)
    chosen = [m for m in MODELS if m in args.parts] or list(MODELS)
    sides = {p for p in ("plain", "jobs") if p in args.parts} or {"plain", "jobs"}
    figures: dict[str, Any] = {"accelerator_type": ACCELERATOR, "mesh": MESH, "rows": ROWS,
                               "width": WIDTH, "steps": steps, "repeats": repeats,
                               "provider": args.provider, "cores": os.cpu_count()}
    targets: dict[str, Any] = {}
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jaxpod-sharded-{os.getpid()}.npz")
    plain_states: dict[str, dict[str, np.ndarray]] = {}
    if "plain" in sides:
        for name in chosen:
            p = MODELS[name].prefix
            rates = [measure_plain(name, steps, out) for _ in range(repeats)]
            figures[f"{p}plain_steps_per_s"] = statistics.median(r[0] for r in rates)
            figures[f"{p}plain_preplaced_steps_per_s"] = statistics.median(r[1] for r in rates)
            with np.load(out) as saved:
                plain_states[name] = dict(saved)
            os.unlink(out)
            print(f"{name} plain: {rates} steps/s", flush=True)
    if "jobs" in sides:
        import jaxpod

        log_path = os.path.join(tempfile.gettempdir(),
                                f"jaxpod-bench-sharded-{os.getpid()}.log")
        with kept_log_on_failure(ServeProcess(log_path, ACCELERATOR, provider=args.provider),
                                 log_path) as service, \
                jaxpod.connect(service.address, token=service.token) as client:
            for name in chosen:
                model = MODELS[name]
                runs = [measure_job(client, model, steps) for _ in range(repeats)]
                figures[f"{model.prefix}job_steps_per_s"] = statistics.median(
                    r for r, _, _ in runs)
                figures[f"{model.prefix}job_productive_steps_per_s"] = statistics.median(
                    r for _, r, _ in runs)
                print(f"{name} job: {[r[:2] for r in runs]} steps/s", flush=True)
                for key, value in plain_states.get(name, {}).items():
                    if not np.allclose(runs[0][2][key], value, rtol=1e-4, atol=1e-5):
                        raise RuntimeError(f"the {name} job's {key} differs from the "
                                           "plain run's")
    for name in chosen:
        p = MODELS[name].prefix
        if f"{p}plain_steps_per_s" in figures and f"{p}job_steps_per_s" in figures:
            plain = figures[f"{p}plain_steps_per_s"]
            figures[f"{p}job_vs_plain"] = figures[f"{p}job_steps_per_s"] / plain
            figures[f"{p}job_productive_vs_plain"] = \
                figures[f"{p}job_productive_steps_per_s"] / plain
            targets[f"{p}job_vs_plain"] = target(figures[f"{p}job_vs_plain"], ">=", 0.95)
            targets[f"{p}job_productive_vs_plain"] = target(
                figures[f"{p}job_productive_vs_plain"], ">=", 0.95)
    report("sharded", rounded(figures), targets)


if __name__ == "__main__":
    main()
