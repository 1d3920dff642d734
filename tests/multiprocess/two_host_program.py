"""One process of a 2-process jax.distributed group; run by test_two_processes.py.

Usage: python two_host_program.py COORDINATOR_ADDRESS PROCESS_ID OUT_JSON
Each process has 2 simulated CPU devices; collectives go over gloo on loopback.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(coordinator: str, process_id: int, out_path: str) -> None:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    import numpy as np

    import jaxpod

    strategy = jaxpod.TPUStrategy()

    def step(x: jax.Array, scale: jax.Array) -> dict:
        ctx = jaxpod.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        return {"x": x * scale + rid, "total": ctx.all_reduce("SUM", jax.numpy.sum(x))}

    # The global dataset: 3 batches of 6 rows (the last one of 4), each split over
    # the 4 replicas of both hosts.
    data = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    batches = [data[0:6], data[6:12], data[12:16]]
    results: dict = {"process_index": jax.process_index(),
                     "num_replicas": strategy.num_replicas_in_sync,
                     "hosts": strategy.num_hosts, "steps": []}
    for batch in strategy.experimental_distribute_dataset(batches):
        out = strategy.run(step, args=(batch, np.float32(2.0)))
        results["steps"].append({
            "local_rows": [r.tolist() for r in strategy.experimental_local_results(batch)],
            "gather": strategy.gather(out["x"], axis=0).tolist(),
            "sum0": strategy.reduce("SUM", out["x"], axis=0).tolist(),
            "mean0": strategy.reduce("MEAN", out["x"], axis=0).tolist(),
            "max0": strategy.reduce("MAX", out["x"], axis=0).tolist(),
            "total": strategy.reduce("MEAN", out["total"]).tolist(),
        })
    results["exchanges"], results["keys_left"] = _exchange_positions(process_id)
    with open(out_path, "w") as f:
        json.dump(results, f)
    jax.distributed.shutdown()


def _exchange_positions(process_id: int) -> tuple[list, list]:
    """Three checkpoints' input-position exchanges, then the keys they left in the
    coordination service's store once both hosts are past them."""
    from jax._src.distributed import global_state

    from jaxpod.worker.checkpoints import _exchanged

    prefix = "jaxpod/checkpoint-input"
    got = [_exchanged({"host": process_id, "save": seq}, f"{prefix}/{seq}")
           for seq in range(3)]
    client = global_state.client
    client.wait_at_barrier("exchanges-done", 60_000)
    return got, [key for key, _ in client.key_value_dir_get(prefix)]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
