"""A linear regression trained by SGD, as the job tests submit it, and numpy's run of
the same steps: ``y ~ x @ w`` over global batches of 16 rows, ``w`` from zeros."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

LR = np.float32(0.05)


def batches(seed: int) -> list[dict[str, np.ndarray]]:
    """Three global batches of 16 rows of ``x`` (3 features) and ``y = x @ w_true``."""
    rng = np.random.default_rng(seed)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    out = []
    for _ in range(3):
        x = rng.normal(size=(16, 3)).astype(np.float32)
        out.append({"x": x, "y": (x @ w).astype(np.float32)})
    return out


def numpy_run(data: list[dict[str, np.ndarray]], steps: int
              ) -> tuple[np.ndarray, list[float]]:
    """``w`` after ``steps`` SGD steps on the batches in turn, and each step's summed
    squared error (before its update)."""
    w, losses = np.zeros(3, np.float32), []
    for step in range(steps):
        b = data[step % len(data)]
        err = b["x"] @ w - b["y"]
        losses.append(float((err ** 2).sum()))
        w = w - LR * (b["x"].T @ err) / np.float32(len(err))
    return w, losses


def paced_step(state: Any, batch: Any) -> Any:
    """One SGD step of y ~ x @ w over the global batch (the job's form of
    :func:`numpy_run`'s), taking >= 30 ms on the host, so a job stays ``RUNNING`` long
    enough to be preempted, suspended or sampled."""
    import jax

    import jaxpod

    ctx = jaxpod.get_replica_context()
    x, y = batch["x"], batch["y"]
    mask = ctx.valid_row_mask.astype(x.dtype)
    err = (x @ state["w"] - y) * mask
    grad = ctx.all_reduce("SUM", x.T @ err) / ctx.all_reduce("SUM", mask.sum())

    def pause(v: Any) -> Any:
        time.sleep(0.03)
        return v

    wait = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
    return {"w": state["w"] - LR * grad + wait}, {"loss": err ** 2}
