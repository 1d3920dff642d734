"""The remote path (client -> jaxpod service -> host worker) against local baselines.

All three are measured in one run, on the embedded local service simulating one
v6e-8 host (8 CPU devices):

1. Round-trip latency of a trivial ``strategy.run(identity, args=(v,))`` (the function
   defined once, ``v`` a small ``PerReplica``) and a ``reduce`` of its result: ``run``
   returns at once (asynchronous dispatch), so the ``reduce`` is what waits for the
   hosts. p50 and p99 over N calls after a warm-up. Target: p50 <= 3 ms. For
   context, the ``run`` call alone (``run_dispatch_p50_ms``: the time the caller's loop
   pays per call), the same run and reduce on an in-process ``TPUStrategy``, and a bare
   gRPC unary round trip on loopback.
2. ``run_steps`` throughput: 100 steps per call of a small MLP training step fed from
   ``experimental_distribute_dataset``, state carried between calls, loss fetched to
   the client after each call. Timed on the client, end to end, against the same
   calls measured inside the workers (the time the host workers spent running their
   operations, from ``strategy.stats()``: what remains is the cost of reaching them).
   Target: end-to-end time per step / inside-the-workers time per step <= 1.05.
   For context, the lower bound: the identical program on an in-process
   ``jaxpod.TPUStrategy`` with 8 CPU devices in a child process (how a single-host
   worker runs it), its calls alternating with the remote ones, never concurrent.

3. ``gather`` of a 256 MiB float32 result (64 MiB with ``--quick``) to the client, in
   GB/s (1e9 bytes/s), against a raw gRPC byte stream of the same size on loopback
   (a minimal ``grpc.aio`` server in a separate process streaming chunks of
   ``CHUNK_BYTES`` with jaxpod's channel options; the client copies each message into
   one preallocated numpy buffer, the least work that ends with an array, as jaxpod's
   client does). Target: jaxpod GB/s / raw GB/s >= 0.7. Also reported, for context:
   the same stream joined into one ``bytes`` object (``b"".join``), the obvious client,
   which spends much of its time faulting in the fresh 256 MiB; and the CPU time the
   whole machine spent per call of each (``/proc/stat``). jaxpod's path has a hop
   the raw stream does not (host worker to service; here, on one machine, the service
   copies the rows out of the worker's memory, ``jaxpod.worker.process_memory``), so
   ``gather_vs_raw_ratio_cpu_ceiling`` (raw time / (jaxpod CPU / cores)) is the best
   ratio that perfect overlap could reach on this machine.

The last line of output is the JSON report.

Usage: python benchmarks/service.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    CommandChild,
    call_times,
    interleaved_medians,
    median_time,
    report,
    target,
    use_cpu_devices,
    with_machine_cpu,
)

FEATURES, HIDDEN, GLOBAL_BATCH, NUM_BATCHES = 128, 256, 256, 8
GATHER_COLUMNS = 1024
RAW_SERVICE = "jaxpod.bench.Raw"


# --------------------------------------------------- the program both sides run
class RepeatingDataset:
    """Global batches cycled forever (like tf.data's ``.repeat()``); ships by value."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return itertools.cycle(self.batches)


def make_inputs(seed: int = 0) -> tuple[list[Any], dict[str, Any]]:
    """The dataset's distinct global batches and the initial parameters (numpy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32),
                rng.normal(size=(GLOBAL_BATCH, 1)).astype(np.float32))
               for _ in range(NUM_BATCHES)]
    params = {"w1": rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32) * 0.05,
              "w2": rng.normal(size=(HIDDEN, 1)).astype(np.float32) * 0.05}
    return batches, params


def train_step(params: dict[str, Any], batch: tuple[Any, Any]) -> tuple[Any, Any]:
    """One SGD step of a one-hidden-layer MLP, gradients averaged over replicas."""
    import jax
    import jax.numpy as jnp

    import jaxpod

    def loss_fn(p: dict[str, Any], x: Any, y: Any) -> Any:
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    grads = jaxpod.get_replica_context().all_reduce("MEAN", grads)
    return jax.tree.map(lambda a, g: a - 0.01 * g, params, grads), {"loss": loss}


def identity(x: Any) -> Any:
    return x


def replica_vector(ctx: Any) -> Any:
    import numpy as np

    return np.full((4,), ctx.replica_id_in_sync_group, np.float32)


def percentiles_ms(times: list[float]) -> tuple[float, float]:
    import numpy as np

    return (float(np.percentile(times, 50)) * 1e3, float(np.percentile(times, 99)) * 1e3)


# ------------------------------------------------------ in-process child process
def inprocess_child(devices: int, steps: int) -> None:
    """The in-process baseline, driven line by line over stdin/stdout.

    Commands: ``steps`` (one run_steps call; answers ``T <seconds>``), ``run N W``
    (N trivial runs after W warm-up; answers ``T <p50 s> <p99 s>``), ``quit``.
    """
    use_cpu_devices(devices)
    import numpy as np

    import jaxpod

    strategy = jaxpod.TPUStrategy(steps_per_run=steps)
    batches, params = make_inputs()
    iterator = iter(strategy.experimental_distribute_dataset(RepeatingDataset(batches)))
    carried = {"state": params}
    print("READY", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        if command[0] == "steps":
            start = time.perf_counter()
            state, out = strategy.run_steps(train_step, iterator, steps=steps,
                                            initial_state=carried["state"])
            carried["state"] = state
            np.asarray(out["loss"].array)
            print(f"T {time.perf_counter() - start}", flush=True)
        elif command[0] == "run":
            p50, p99 = percentiles_ms(measure_latency(strategy, int(command[1]),
                                                      int(command[2])))
            print(f"T {p50 / 1e3} {p99 / 1e3}", flush=True)


class Child(CommandChild):
    """A running :func:`inprocess_child`."""

    def __init__(self, devices: int, steps: int) -> None:
        super().__init__(__file__, ["--devices", str(devices), "--steps", str(steps)])


# ------------------------------------------------------------- raw gRPC server
def raw_server(total_bytes: int, conn: Any) -> None:
    """A minimal gRPC server (run in a spawned process): ``Stream`` sends
    ``total_bytes`` in ``CHUNK_BYTES`` chunks, ``Ping`` echoes its request."""
    import asyncio

    import grpc

    from jaxpod.proto.tensors import CHUNK_BYTES, channel_options

    payload = bytes(bytearray(os.urandom(1 << 20)) * (total_bytes >> 20))
    chunks = [payload[i:i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)]
    del payload

    async def stream(request: bytes, context: Any) -> Any:
        for chunk in chunks:
            yield chunk

    async def ping(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Ping": grpc.unary_unary_rpc_method_handler(ping)})

    async def serve() -> None:
        server = grpc.aio.server(options=channel_options())
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told
        await server.stop(0)

    asyncio.run(serve())


# ------------------------------------------------------------------ measurements
def measure_latency(strategy: Any, calls: int, warmup: int, reduce: bool = True
                    ) -> list[float]:
    """Seconds per trivial ``run`` and, with ``reduce``, a ``reduce`` of its result
    (without: the ``run`` call alone, which asynchronous dispatch returns at once)."""
    value = strategy.experimental_distribute_values_from_function(replica_vector)

    def trivial() -> None:
        out = strategy.run(identity, args=(value,))
        if reduce:
            strategy.reduce("SUM", out, axis=None)

    return call_times(trivial, calls, warmup)


def child_steps(child: Child) -> float:
    return child.ask("steps")[0]


def workers_busy_s(strategy: Any) -> list[float]:
    """Each host worker's time spent running operations so far."""
    return [host["busy_s"] for host in strategy.stats()]


def measure_steps(strategy: Any, child: Child, steps: int, repeats: int
                  ) -> dict[str, float]:
    """Median seconds per run_steps call: remote (timed here), the same remote calls
    inside the workers (``workers``: the busiest host's time running them), and the
    in-process child (``plain``: timed inside the child, without the pipe),
    alternating call by call."""
    batches, params = make_inputs()
    iterator = iter(strategy.experimental_distribute_dataset(RepeatingDataset(batches)))
    carried = {"state": params}
    inside: list[float] = []

    def remote() -> float:
        busy = workers_busy_s(strategy)
        start = time.perf_counter()
        state, out = strategy.run_steps(train_step, iterator, steps=steps,
                                        initial_state=carried["state"])
        carried["state"] = state
        out["loss"].array  # noqa: B018 (fetches the loss to the client: waits for the steps)
        elapsed = time.perf_counter() - start
        inside.append(max(b - a for a, b in zip(busy, workers_busy_s(strategy), strict=True)))
        return elapsed

    candidates: dict[str, Callable[[], float]] = {
        "remote": remote, "plain": functools.partial(child_steps, child)}
    for call in candidates.values():  # warm-up: compiles, starts the infeeds
        for _ in range(2):
            call()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    inside.clear()
    for _ in range(repeats):
        for name, call in candidates.items():
            times[name].append(call())
    times["workers"] = inside
    return {name: statistics.median(t) for name, t in times.items()}


def measure_gather(strategy: Any, total_bytes: int, repeats: int
                   ) -> tuple[dict[str, float], dict[str, float], float]:
    """Median seconds for jaxpod's gather and the raw streams; the median CPU seconds
    the whole machine spent per call of each; raw ping p50 (s)."""
    import grpc
    import numpy as np

    from jaxpod.proto.tensors import channel_options

    replicas = strategy.num_replicas_in_sync
    rows = total_bytes // (replicas * GATHER_COLUMNS * 4)

    def fill(x: Any) -> Any:
        import jax.numpy as jnp

        return jnp.zeros((rows, GATHER_COLUMNS), jnp.float32) + x[0]

    value = strategy.experimental_distribute_values_from_function(replica_vector)
    big = strategy.run(fill, args=(value,))
    expected = (rows * replicas, GATHER_COLUMNS)

    ctx = multiprocessing.get_context("spawn")
    parent, child_end = ctx.Pipe()
    server = ctx.Process(target=raw_server, args=(total_bytes, child_end), daemon=True)
    server.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the raw gRPC server did not start")
        port = parent.recv()
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
            stream = channel.unary_stream(f"/{RAW_SERVICE}/Stream")
            ping = channel.unary_unary(f"/{RAW_SERVICE}/Ping")

            def raw() -> None:
                out = np.empty(total_bytes, np.uint8)
                got = 0
                for message in stream(b""):
                    out[got:got + len(message)] = np.frombuffer(message, np.uint8)
                    got += len(message)
                assert got == total_bytes, got

            def raw_joined() -> None:  # the obvious client; for context only
                data = b"".join(stream(b""))
                assert len(data) == total_bytes, len(data)

            def jaxpod_gather() -> None:
                out = strategy.gather(big, 0)
                assert out.shape == expected and out.dtype == np.float32, out.shape

            ping_s = median_time(lambda: ping(b"x"), 200, 50)
            candidates = {"jaxpod": jaxpod_gather, "raw": raw, "raw_joined": raw_joined}
            spent: dict[str, list[float]] = {name: [] for name in candidates}
            # Steady state: the first transfers of this size also pay for the
            # processes' allocators growing, on both sides; two warm-ups each.
            warmup = 2
            medians = interleaved_medians(
                {name: with_machine_cpu(fn, spent[name]) for name, fn in candidates.items()},
                repeats, warmup=warmup)
        parent.send("stop")
        server.join(30)
    finally:
        if server.is_alive():
            server.kill()
            server.join()
    cpu = {name: statistics.median(used[warmup:]) for name, used in spent.items()}
    return medians, cpu, ping_s


# -------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--devices", type=int, default=8, help="simulated chips (v6e-N)")
    parser.add_argument("--steps", type=int, default=100, help="steps per run_steps call")
    parser.add_argument("--_inprocess", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._inprocess:
        inprocess_child(args.devices, args.steps)
        return

    calls = 60 if args.quick else 300
    step_repeats = 5 if args.quick else 15
    gather_mib = 64 if args.quick else 256
    gather_repeats = 3 if args.quick else 11
    accelerator = f"v6e-{args.devices}"
    os.environ["JAXPOD_LOCAL_SLICES"] = accelerator

    import jaxpod

    start = time.perf_counter()
    client = jaxpod.connect()
    strategy = client.strategy(accelerator, steps_per_run=args.steps)
    startup_s = time.perf_counter() - start
    print(f"service + slice ready in {startup_s:.1f} s: {strategy!r}", flush=True)
    child: Child | None = None
    try:
        # 1. trivial run + reduce round trips, and the run call alone
        warmup = max(20, calls // 5)
        p50, p99 = percentiles_ms(measure_latency(strategy, calls, warmup))
        dispatch_p50, _ = percentiles_ms(measure_latency(strategy, calls, warmup,
                                                         reduce=False))
        print(f"remote run + reduce round trip: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
              f"({calls} calls); the run call alone p50 {dispatch_p50:.3f} ms", flush=True)

        # 2. run_steps against the in-process baseline (the child started now, so its
        # start-up does not disturb the latency figures)
        child = Child(args.devices, args.steps)
        child.wait_ready()
        local_p50, local_p99 = (1e3 * t for t in child.ask(f"run {calls} 20"))
        print(f"in-process run + reduce: p50 {local_p50:.3f} ms, "
              f"p99 {local_p99:.3f} ms", flush=True)
        steps = measure_steps(strategy, child, args.steps, step_repeats)
        child.close()
        per_step = {name: 1e3 * t / args.steps for name, t in steps.items()}
        print("run_steps ms/step: " + ", ".join(f"{n} {v:.3f}" for n, v in per_step.items())
              + f" ({args.steps} steps/call, median of {step_repeats})", flush=True)

        # 3. gather against a raw gRPC stream
        total = gather_mib << 20
        gather, gather_cpu, ping_s = measure_gather(strategy, total, gather_repeats)
        gbps = {name: total / t / 1e9 for name, t in gather.items()}
        print(f"gather {gather_mib} MiB: jaxpod {gbps['jaxpod']:.3f} GB/s, raw gRPC "
              f"{gbps['raw']:.3f} GB/s (joined into bytes: {gbps['raw_joined']:.3f}); raw "
              f"gRPC unary p50 {1e3 * ping_s:.3f} ms", flush=True)
        cores = os.cpu_count() or 1
        # However well the processes overlap, a call takes at least its CPU time
        # spread over every core: the best ratio this machine allows.
        ceiling = gather["raw"] / (gather_cpu["jaxpod"] / cores)
        print("gather CPU per call, whole machine: " + ", ".join(
            f"{n} {1e3 * c:.0f} ms" for n, c in gather_cpu.items())
            + f"; ratio ceiling on {cores} cores {ceiling:.2f}", flush=True)
    finally:
        if child is not None:
            child.close()
        strategy.close()
        client.close()

    steps_ratio = steps["remote"] / steps["workers"]
    lower_bound_ratio = steps["remote"] / steps["plain"]
    gather_ratio = gbps["jaxpod"] / gbps["raw"]
    figures = {
        "devices": args.devices, "startup_s": round(startup_s, 2),
        "run_reduce_p50_ms": round(p50, 3), "run_reduce_p99_ms": round(p99, 3),
        "run_dispatch_p50_ms": round(dispatch_p50, 4), "run_calls": calls,
        "inprocess_run_reduce_p50_ms": round(local_p50, 3),
        "raw_grpc_unary_p50_ms": round(1e3 * ping_s, 3),
        "steps_per_call": args.steps, "global_batch": GLOBAL_BATCH,
        "remote_ms_per_step": round(per_step["remote"], 4),
        "inside_workers_ms_per_step": round(per_step["workers"], 4),
        "inprocess_ms_per_step": round(per_step["plain"], 4),
        "remote_overhead_ms_per_call": round(1e3 * (steps["remote"] - steps["workers"]), 2),
        "remote_vs_workers_step_ratio": round(steps_ratio, 4),
        "remote_vs_inprocess_step_ratio": round(lower_bound_ratio, 4),
        "step_repeats": step_repeats,
        "gather_mib": gather_mib,
        "gather_gbps": round(gbps["jaxpod"], 4), "raw_grpc_gbps": round(gbps["raw"], 4),
        "raw_grpc_joined_gbps": round(gbps["raw_joined"], 4),
        "gather_vs_raw_ratio": round(gather_ratio, 4),
        "gather_vs_raw_joined_ratio": round(gbps["jaxpod"] / gbps["raw_joined"], 4),
        "gather_machine_cpu_ms": round(1e3 * gather_cpu["jaxpod"], 1),
        "raw_grpc_machine_cpu_ms": round(1e3 * gather_cpu["raw"], 1),
        "cores": cores,
        "gather_vs_raw_ratio_cpu_ceiling": round(ceiling, 4),
        "gather_repeats": gather_repeats,
    }
    report("service", figures, {
        "run_reduce_p50_ms": target(p50, "<=", 3),
        "remote_vs_workers_step_ratio": target(steps_ratio, "<=", 1.05),
        "gather_vs_raw_ratio": target(gather_ratio, ">=", 0.7),
    })


if __name__ == "__main__":
    main()
