"""Jobs the dashboard tests run; the step functions are shipped by value to the
workers, as a user's would be."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

import jaxpod

#: Where tests leave screenshots (git ignores it).
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def regression_step(state: Any, batch: Any) -> Any:
    """One SGD step of y ~ x @ w; its loss is the job's metric."""
    ctx = jaxpod.get_replica_context()
    x, y = batch["x"], batch["y"]
    mask = ctx.valid_row_mask.astype(x.dtype)
    err = (x @ state["w"] - y) * mask
    grad = ctx.all_reduce("SUM", x.T @ err) / ctx.all_reduce("SUM", mask.sum())
    return {"w": state["w"] - 0.05 * grad}, {"loss": err ** 2}


def paced_step(state: Any, batch: Any) -> Any:
    """``regression_step`` that takes at least ``PACE_S`` per step on the host, so a job
    stays RUNNING long enough to be watched."""
    import jax

    def pause(x: Any) -> Any:
        time.sleep(0.05)
        return x

    new, outputs = regression_step(state, batch)
    wait = jax.pure_callback(pause, jax.ShapeDtypeStruct((), np.float32), np.float32(0))
    return {"w": new["w"] + wait}, outputs


def batches(seed: int = 0, n: int = 4, rows: int = 16) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(rows, 3)).astype(np.float32)
        out.append({"x": x, "y": (x @ w).astype(np.float32)})
    return out


def submit(client: Any, steps: int, steps_per_run: int, paced: bool = False,
           name: str = "dash") -> Any:
    return client.submit(paced_step if paced else regression_step, steps=steps,
                         steps_per_run=steps_per_run, accelerator_type="v4-8",
                         initial_state={"w": np.zeros(3, np.float32)}, dataset=batches(),
                         outputs={"loss": "MEAN"}, name=name)
