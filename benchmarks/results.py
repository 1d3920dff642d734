"""Reading results back: ``job.result()`` against plain orbax, and the coordinator's
memory while a large result, gather, local results or fetch passes through it.

One real ``jaxpod serve --local --provider processes --slices v4-16`` (2 hosts x 4
chips, JAX on CPU, the hosts plain processes); this process is the client.

* ``leaves``: jobs whose state has N leaves (16x16 kernels and 16-element biases in
  nested dicts, as a model's layers), one step each. ``result_s_<N>`` is
  ``job.result()`` (the state streamed from the job's last checkpoint through the
  coordinator), ``orbax_s_<N>`` the lower bound: plain
  ``orbax.checkpoint.StandardCheckpointer().restore(path)`` of the same checkpoint in
  this process (what a user with access to the files does), measured in alternation,
  medians of 3 (1 with ``--quick``). Both results are checked against each other.
  N = 10, 100, 1000 (10, 100, 300 with ``--quick``). Target at the largest N
  (``result_s_largest``, ``orbax_s_largest``): ``result_over_bound_largest`` =
  ``result_s / (2 * orbax_s + 0.1 s)`` <= 1.
* ``bytes``: jobs whose state is 16 MiB and 256 MiB (4 leaves of float32 rows);
  ``result_s`` and ``orbax_s`` as above, and ``result_peak_growth_mib_256``: how far the
  coordinator's peak resident memory (``VmHWM``, reset through ``clear_refs`` before
  the call) rose above its resident memory during the 256 MiB ``result()`` (target
  < 64). The 16 MiB result runs first, so one-time costs (libraries loaded, thread
  pools started) are behind; ``first_result_peak_growth_mib`` is that first one's.
* ``gather``: a strategy on the same slice holds a 256 MiB per-replica value (and a
  256 MiB global array from ``strategy.spmd``); the coordinator's peak growth during
  ``strategy.gather`` (target < 64), ``experimental_local_results``, the per-replica
  value's ``.array`` and the global value's ``.numpy()``, each checked.

Usage: ``python benchmarks/results.py [--quick] [--parts leaves,bytes,gather]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    ServeProcess,
    kept_log_on_failure,
    parse_parts,
    peak_rss_growth_mib,
    report,
    target,
)

ACCELERATOR = "v4-16"
PARTS = ("leaves", "bytes", "gather")
MIB = 1024 * 1024
GROWTH_TARGET_MIB = 64.0
JOB_TIMEOUT_S = 900.0


def layers_state(leaves: int) -> Any:
    """An ``init_fn``: ``leaves // 2`` layers of a 16x16 kernel and a 16-vector bias,
    nested two deep (``{"block3": {"layer7": {"kernel", "bias"}}}``)."""
    def init() -> Any:
        import jax.numpy as jnp

        state: dict[str, Any] = {}
        for i in range(leaves // 2):
            block = state.setdefault(f"block{i // 8}", {})
            block[f"layer{i}"] = {"kernel": jnp.full((16, 16), i, jnp.float32),
                                  "bias": jnp.arange(16, dtype=jnp.float32) + i}
        return state

    return init


def rows_state(mib: int, count: int = 4) -> Any:
    """An ``init_fn``: ``count`` float32 leaves of 1024 columns, ``mib`` MiB in all."""
    rows = mib * MIB // 4 // 1024 // count

    def init() -> Any:
        import jax.numpy as jnp

        return {f"w{i}": jnp.full((rows, 1024), i, jnp.float32) for i in range(count)}

    return init


def add_one(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    import jax

    return jax.tree.map(lambda x: x + 1, state), {}


def finished_job(client: Any, init: Any) -> Any:
    job = client.submit(add_one, steps=1, init_fn=init, accelerator_type=ACCELERATOR)
    status = job.wait(JOB_TIMEOUT_S)
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"job {job.id} ended {status.state}: {status.error}")
    return job


def same_tree(a: Any, b: Any, what: str) -> None:
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb) or jax.tree.structure(a) != jax.tree.structure(b):
        raise RuntimeError(f"{what}: result() gave another tree than orbax's restore")
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def timed_against_orbax(job: Any, repeats: int) -> tuple[float, float]:
    """Medians of ``job.result()`` and plain orbax restoring its last checkpoint, in
    alternation; the two states checked equal."""
    import orbax.checkpoint as ocp

    path = job.checkpoints()[-1].path
    ours: list[float] = []
    plain: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = job.result().state
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        restored = ocp.StandardCheckpointer().restore(path)
        plain.append(time.perf_counter() - start)
        same_tree(state, restored, f"job {job.id}")
        del state, restored
    return statistics.median(ours), statistics.median(plain)


def measure_leaves(client: Any, counts: tuple[int, ...], repeats: int
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    figures: dict[str, Any] = {}
    for n in counts:
        start = time.perf_counter()
        job = finished_job(client, layers_state(n))
        figures[f"job_s_{n}"] = round(time.perf_counter() - start, 3)
        ours, plain = timed_against_orbax(job, repeats)
        figures[f"result_s_{n}"], figures[f"orbax_s_{n}"] = round(ours, 4), round(plain, 4)
        print(f"{n} leaves: result() {ours:.3f} s, orbax {plain:.3f} s", flush=True)
    n = counts[-1]
    figures["largest_leaves"] = n
    figures["result_s_largest"], figures["orbax_s_largest"] = (figures[f"result_s_{n}"],
                                                               figures[f"orbax_s_{n}"])
    bound = 2 * figures["orbax_s_largest"] + 0.1
    return figures, {"result_over_bound_largest": target(
        figures["result_s_largest"] / bound, "<=", 1.0)}


def measure_bytes(client: Any, pid: int, repeats: int
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    figures: dict[str, Any] = {}
    for mib in (16, 256):
        job = finished_job(client, rows_state(mib))
        growth, result = peak_rss_growth_mib(pid, job.result)
        leaves = [result.state[f"w{i}"] for i in range(len(result.state))]
        if sum(x.nbytes for x in leaves) != mib * MIB or not all(
                np.all(x == i + 1) for i, x in enumerate(leaves)):  # leaf i, one step on
            raise RuntimeError(f"result() of the {mib} MiB job is wrong")
        del result
        key = "first_result_peak_growth_mib" if mib == 16 else "result_peak_growth_mib_256"
        figures[key] = round(growth, 1)
        ours, plain = timed_against_orbax(job, repeats)
        figures[f"result_s_{mib}mib"], figures[f"orbax_s_{mib}mib"] = round(ours, 4), round(
            plain, 4)
        print(f"{mib} MiB: result() {ours:.3f} s, orbax {plain:.3f} s, coordinator peak "
              f"growth {growth:.0f} MiB", flush=True)
    return figures, {"result_peak_growth_mib_256": target(
        figures["result_peak_growth_mib_256"], "<", GROWTH_TARGET_MIB)}


def component(rows: int) -> Any:
    def make() -> Any:
        import jax.numpy as jnp

        import jaxpod

        replica = jaxpod.get_replica_context().replica_id_in_sync_group
        return jnp.full((rows, 1024), 1.0, jnp.float32) * replica

    return make


def global_rows(rows: int) -> Any:
    def make() -> Any:
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        x = jnp.ones((rows, 1024), jnp.float32) * jnp.arange(rows, dtype=jnp.float32)[:, None]
        return jax.lax.with_sharding_constraint(x, P("data"))

    return make


def measure_gather(client: Any, pid: int) -> tuple[dict[str, Any], dict[str, Any]]:
    figures: dict[str, Any] = {}
    with client.strategy(accelerator_type=ACCELERATOR) as strategy:
        n = strategy.num_replicas_in_sync
        rows = 256 * MIB // 4 // 1024 // n
        value = strategy.run(component(rows))
        glob = strategy.spmd(global_rows(rows * n))()
        replica_of_row = np.repeat(np.arange(n, dtype=np.float32), rows)
        checks = {
            "gather": (lambda: strategy.gather(value, axis=0),
                       lambda g: np.array_equal(g[:, 0], replica_of_row)),
            "local_results": (lambda: strategy.experimental_local_results(value),
                              lambda r: all(np.all(c == i) for i, c in enumerate(r))),
            "fetch": (lambda: value.array,
                      lambda a: a.shape == (n, rows, 1024) and np.array_equal(
                          a[:, 0, 0], np.arange(n))),
            "fetch_global": (lambda: glob.numpy(),
                             lambda a: np.array_equal(a[:, 3], np.arange(rows * n))),
        }
        for name, (call, check) in checks.items():
            start = time.perf_counter()
            growth, out = peak_rss_growth_mib(pid, call)
            elapsed = time.perf_counter() - start
            if not check(out):
                raise RuntimeError(f"{name} of the 256 MiB value is wrong")
            del out
            figures[f"{name}_peak_growth_mib_256"] = round(growth, 1)
            figures[f"{name}_s_256"] = round(elapsed, 3)
            print(f"{name} 256 MiB: {elapsed:.3f} s, coordinator peak growth "
                  f"{growth:.0f} MiB", flush=True)
    return figures, {"gather_peak_growth_mib_256": target(
        figures["gather_peak_growth_mib_256"], "<", GROWTH_TARGET_MIB)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = parse_parts(parser, PARTS)
    import jaxpod

    log_path = os.path.join(tempfile.gettempdir(), f"jaxpod-bench-results-{os.getpid()}.log")
    figures: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    repeats = 1 if args.quick else 3
    with kept_log_on_failure(ServeProcess(log_path, ACCELERATOR, provider="processes"),
                             log_path) as service:
        client = jaxpod.connect(service.address, token=service.token)
        pid = service.process.pid
        try:
            if "bytes" in args.parts:
                f, t = measure_bytes(client, pid, repeats)
                figures.update(f)
                targets.update(t)
            if "gather" in args.parts:
                f, t = measure_gather(client, pid)
                figures.update(f)
                targets.update(t)
            if "leaves" in args.parts:
                counts = (10, 100, 300) if args.quick else (10, 100, 1000)
                f, t = measure_leaves(client, counts, repeats)
                figures.update(f)
                targets.update(t)
        finally:
            client.close()
    report("results", figures, targets)


if __name__ == "__main__":
    main()
