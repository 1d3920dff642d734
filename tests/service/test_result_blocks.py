"""Large results pass through the coordinator in blocks: gather, local results and
fetched values, cut into many blocks, equal numpy's.

The service runs with ``JAXPOD_RESULT_BLOCK_BYTES=16384``, so results of a few hundred
KiB (over what travels inline, ``INLINE_BYTES``) stream in many blocks, each fetched
from the hosts with one operation (the hosts' operation counts show it), and every
way a block can start or end (inside a replica's rows, at a short replica's last row,
across a shard's edge) is crossed. A simulated v4-16: 8 replicas on 2 hosts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_process import PROCESSES, Service, start_service, stop_service

import jaxpod

pytestmark = pytest.mark.multiprocess

REPLICAS = 8
COLS = 256  # 1 KiB a row: 16 rows a block, a replica's 40 rows in 3
FULL, SHORT = 8 * 40, 203  # a full global batch, then a short one
BLOCK = 16384


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    folder = tmp_path_factory.mktemp("result-blocks")
    running = start_service(folder / "serve.log", "v4-16", args=PROCESSES,
                            env={"JAXPOD_RESULT_BLOCK_BYTES": str(BLOCK)})
    try:
        yield running
    finally:
        stop_service(running)


def batches() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.normal(size=(n, COLS)).astype(np.float32) for n in (FULL, SHORT)]


def double(batch: Any) -> Any:
    return {"rows": batch * 2, "count": batch.shape[0] * 1.0}  # padded: static shapes


def rows_of_replicas(total: int) -> list[int]:
    """TF's split of a batch of ``total`` rows: each replica takes a full global
    batch's share in turn, so a short batch leaves the last ones few or none."""
    share = FULL // REPLICAS
    return [min(share, max(0, total - r * share)) for r in range(REPLICAS)]


def wide(ctx: Any) -> Any:
    r = ctx.replica_id_in_sync_group
    return np.arange(5 * 2000, dtype=np.float32).reshape(5, 2000) + 100_000 * r


def global_arrays() -> Any:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    x = jnp.arange(512 * 160, dtype=jnp.float32).reshape(512, 160)
    return {"rows": jax.lax.with_sharding_constraint(x, P("data")),  # 64-row shards
            "cols": jax.lax.with_sharding_constraint(x * 2, P(None, "data")),
            "whole": x[:3] - 1}


def operations(strategy: Any) -> int:
    """Operations host 0 ran so far (the stats call itself is not counted)."""
    return int(strategy.stats()[0]["operations"])


def test_results_cut_into_many_blocks_equal_numpy(service: Service) -> None:
    data = batches()
    with service.connect() as client, client.strategy(accelerator_type="v4-16") as strategy:
        assert strategy.num_replicas_in_sync == REPLICAS
        for batch, out in zip(data, (strategy.run(double, args=(b,)) for b in
                                     strategy.experimental_distribute_dataset(data)),
                              strict=True):
            rows = rows_of_replicas(batch.shape[0])
            expected = np.split(batch * 2, np.cumsum(rows)[:-1])
            # gather: every replica's real rows, in replica order, a block at a time
            before = operations(strategy)
            np.testing.assert_array_equal(strategy.gather(out["rows"], axis=0), batch * 2)
            assert operations(strategy) - before == sum(-(-n // 16) for n in rows)
            # local results: each replica's rows, a small leaf beside the large one
            local = strategy.experimental_local_results(out)
            assert len(local) == REPLICAS
            for r, part in enumerate(local):
                np.testing.assert_array_equal(part["rows"], expected[r])
                assert float(part["count"]) == FULL // REPLICAS  # fn sees padded rows
            # fetched: the padded components, padding rows zero
            padded = out["rows"].array
            per_replica = FULL // REPLICAS
            assert padded.shape == (REPLICAS, per_replica, COLS)
            for r in range(REPLICAS):
                np.testing.assert_array_equal(padded[r, :rows[r]], expected[r])
                assert not padded[r, rows[r]:].any()

        # gather along another axis: each row of the result spans every replica
        value = strategy.experimental_distribute_values_from_function(wide)
        expected_wide = np.concatenate([wide(jaxpod.ValueContext(r, REPLICAS))
                                        for r in range(REPLICAS)], axis=1)
        np.testing.assert_array_equal(strategy.gather(value, axis=1), expected_wide)
        np.testing.assert_array_equal(strategy.gather(value, axis=-1), expected_wide)

        # global arrays, assembled block by block from the hosts' shards
        made = strategy.spmd(global_arrays)()
        x = np.arange(512 * 160, dtype=np.float32).reshape(512, 160)
        before = operations(strategy)
        np.testing.assert_array_equal(made["rows"].numpy(), x)
        per_block = BLOCK // x[0].nbytes  # whole rows, at most BLOCK bytes
        assert operations(strategy) - before == -(-len(x) // per_block)
        # reduce gives a global value whole (one value, no replicas): in blocks too
        before = operations(strategy)
        np.testing.assert_array_equal(strategy.reduce("SUM", made["rows"], axis=None), x)
        assert operations(strategy) - before == -(-len(x) // per_block)
        np.testing.assert_array_equal(made["cols"].numpy(), x * 2)
        np.testing.assert_array_equal(np.asarray(made["whole"]), x[:3] - 1)
