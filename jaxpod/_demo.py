"""``jaxpod demo``: a small data-parallel training loop through ``jaxpod.connect()``.

Fits a linear model to noisy synthetic data with SGD on a slice the jaxpod service
holds: by default the first free slice of the embedded local service, a simulated
v4-16 (2 hosts x 4 chips, one JAX process per host) unless ``$JAXPOD_LOCAL_SLICES``
says otherwise. The per-replica gradients are all-reduced across the slice's hosts,
and the loss is reduced over the true (unpadded) rows of every batch.
"""

from __future__ import annotations

import time
from typing import Any


def run_demo(steps: int = 20, accelerator_type: str | None = None,
             address: str | None = None) -> int:
    """Trains for ``steps`` steps; prints the loss per step.

    Args:
      steps: training steps.
      accelerator_type: the slice type to train on (``None``: the type of the
        service's first free slice).
      address: a running ``jaxpod serve`` (default ``$JAXPOD_ADDRESS``, else the
        embedded local service).

    Returns:
      0 when the loss fell, 1 otherwise (so scripts can check the demo worked).
    """
    if steps < 1:
        raise SystemExit(f"jaxpod demo: --steps must be >= 1. Got {steps}.")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxpod

    client = jaxpod.connect(address)
    with client, client.strategy(accelerator_type) as strategy:
        n = strategy.num_replicas_in_sync
        rng = np.random.default_rng(0)
        features, global_batch = 16, 8 * n + 3  # not a multiple of n: uneven rows
        true_w = rng.normal(size=(features, 1)).astype(np.float32)
        x = rng.normal(size=(global_batch * steps, features)).astype(np.float32)
        y = x @ true_w + 0.1 * rng.normal(size=(len(x), 1)).astype(np.float32)
        batches = [(x[i:i + global_batch], y[i:i + global_batch])
                   for i in range(0, len(x), global_batch)]
        dataset = strategy.experimental_distribute_dataset(batches)

        def train_step(w: jax.Array, batch: tuple[jax.Array, jax.Array]
                       ) -> tuple[jax.Array, dict[str, Any]]:
            ctx = jaxpod.get_replica_context()
            assert ctx is not None
            xb, yb = batch
            mask = ctx.valid_row_mask[:, None]

            def loss_fn(w: jax.Array) -> jax.Array:
                return jnp.sum(((xb @ w - yb) ** 2) * mask) / global_batch

            sq_err = ((xb @ w - yb) ** 2)[:, 0]
            grad = ctx.all_reduce("SUM", jax.grad(loss_fn)(w))
            return w - 0.1 * grad, {"sq_err": sq_err}

        print(f"jaxpod demo: {strategy}, global batch {global_batch}, {steps} steps, "
              f"service {client.address}")
        w: Any = np.zeros((features, 1), np.float32)
        losses = []
        start = time.perf_counter()
        for step, batch in enumerate(dataset, start=1):
            w, out = strategy.run(train_step, args=(w, batch))
            loss = float(strategy.reduce("MEAN", out["sq_err"], axis=0))
            losses.append(loss)
            print(f"step {step:3d}  loss {loss:.5f}", flush=True)
        elapsed = time.perf_counter() - start
    print(f"done: {len(losses)} steps in {elapsed:.2f}s, loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}")
    return 0 if losses[-1] < losses[0] else 1
