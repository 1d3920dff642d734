"""Checkpoints at model scale: the hosts write them, no state byte passes the coordinator.

A job whose state is 256 MiB runs with several checkpoints on a fresh
``jaxpod serve --local``: the coordinator's peak resident memory (``VmHWM``) grows by
less than 64 MiB over it, and over ``job.result()`` streaming that state back. Its last
checkpoint opens with plain orbax in a fresh interpreter that never imports jaxpod, and
equals numpy's computation of the state. A job whose state has hundreds of leaves (a
nested model and optax's named-tuple state) gives its tree back whole.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_process import PROCESSES, Service, start_service, stop_service

import jaxpod

pytestmark = pytest.mark.multiprocess

#: The state's leaf: float32, 256 MiB.
SIZE = 64 * 2**20
STEPS = 6
MIB = 2**20


def big_init() -> dict[str, Any]:
    import jax.numpy as jnp

    return {"w": (jnp.arange(SIZE, dtype=jnp.int32) % 1000).astype(jnp.float32) * 1e-3,
            "n": jnp.int32(0)}


def big_step(state: dict[str, Any], batch: Any) -> Any:
    ctx = jaxpod.get_replica_context()
    total = ctx.all_reduce("SUM", batch.sum())
    return {"w": state["w"] * 0.5 + total, "n": state["n"] + 1}, {"total": total}


def small_step(state: dict[str, Any], batch: Any) -> Any:
    return {"w": state["w"] + batch.sum()}, {}


#: numpy's final state of the big job, run in the fresh interpreter (``SIZE``, ``STEPS``
#: and the batch total, 4 rows of ones, filled in).
EXPECTED = """
w = (np.arange({size}, dtype=np.int32) % 1000).astype(np.float32) * np.float32(1e-3)
for _ in range({steps}):
    w = w * np.float32(0.5) + np.float32(4)
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    folder = tmp_path_factory.mktemp("job-checkpoints")
    running = start_service(folder / "serve.log", "v4-8",
                            args=(*PROCESSES, "--state-dir", str(folder / "state")))
    try:
        yield running
    finally:
        stop_service(running)


def peak_rss(pid: int, field: str = "VmHWM") -> int:
    """The process's peak resident memory in bytes (``VmHWM``; or another field of
    ``/proc/<pid>/status`` in kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def rss(pid: int) -> int:
    """The process's resident memory now in bytes (``VmRSS``)."""
    return peak_rss(pid, "VmRSS")


def test_a_large_state_never_passes_the_coordinator_and_opens_with_plain_orbax(
        service: Service) -> None:
    with service.connect() as client:
        # A small job with checkpoints first: what every job loads once (orbax, the
        # job machinery) is in the coordinator before its peak is read.
        warm = client.submit(small_step, steps=4, accelerator_type="v4-8",
                             initial_state={"w": np.zeros(3, np.float32)},
                             dataset=[np.ones((4,), np.float32)], checkpoint_every=2)
        assert warm.wait(timeout=300, progress=False).state == "SUCCEEDED"
        warm.result()
        before = peak_rss(service.process.pid)
        job = client.submit(big_step, steps=STEPS, accelerator_type="v4-8",
                            init_fn=big_init, dataset=[np.ones((4,), np.float32)],
                            outputs={"total": "SUM"}, checkpoint_every=2)
        result = job.result(timeout=600, state=False)
        grown = peak_rss(service.process.pid) - before
        assert result.state is None and result.steps == STEPS
        assert float(result.outputs["total"]) == 4.0 * 4  # 4 replicas' sums of 4 ones
        saved = job.checkpoints()
        assert [c.step for c in saved] == [4, 6]  # every 2 steps, the last 2 kept
        # how long each held the steps: a periodic one its setting apart, the final
        # one until committed
        assert all(c.stall_s is not None and c.stall_s > 0 for c in saved), saved
        # The state streams back through the coordinator in bounded blocks.
        Path(f"/proc/{service.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        before_result = rss(service.process.pid)
        state = job.result(timeout=600).state
        grown_by_result = peak_rss(service.process.pid) - before_result
    assert grown < 64 * MIB, f"the coordinator's peak RSS grew {grown / MIB:.0f} MiB"
    assert grown_by_result < 64 * MIB, (
        f"the coordinator's peak RSS grew {grown_by_result / MIB:.0f} MiB during result()")
    expected: dict[str, Any] = {"np": np}
    exec(EXPECTED.format(size=SIZE, steps=STEPS), expected)
    assert np.array_equal(state["w"], expected["w"]) and int(state["n"]) == STEPS
    del state
    reader = "\n".join([
        "import sys",
        "import numpy as np",
        "import orbax.checkpoint as ocp",
        "state = ocp.StandardCheckpointer().restore(sys.argv[1])",
        EXPECTED.format(size=SIZE, steps=STEPS),
        "assert np.asarray(state['w']).dtype == np.float32",
        "assert np.array_equal(np.asarray(state['w']), w), 'w differs from numpy'",
        f"assert int(state['n']) == {STEPS}, state['n']",
        "assert not [m for m in sys.modules if m.split('.')[0] == 'jaxpod']",
        "print('READ', np.asarray(state['w']).nbytes)"])
    read = subprocess.run([sys.executable, "-c", reader, saved[-1].path],
                          capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    assert f"READ {SIZE * 4}" in read.stdout


#: Layers of the many-leaf model: each a kernel and a bias, nested in blocks.
LAYERS = 60
LEARNING_RATE = 0.01


def layered_params() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    params: dict[str, Any] = {}
    for i in range(LAYERS):
        block = params.setdefault(f"block{i // 6}", {})
        block[f"dense{i}"] = {"kernel": rng.normal(size=(4, 3)).astype(np.float32),
                              "bias": rng.normal(size=(3,)).astype(np.float32)}
    return params


def adam_init() -> Any:
    import jax.numpy as jnp
    import optax

    params = __import__("jax").tree.map(jnp.asarray, layered_params())
    return {"params": params, "opt": optax.adam(LEARNING_RATE).init(params)}


def adam_step(state: Any, batch: Any) -> Any:
    import jax
    import optax

    grads = state["params"]  # the gradient of 0.5 * |params|^2
    updates, opt = optax.adam(LEARNING_RATE).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {
        "norm": sum(jax.numpy.sum(g * g) for g in jax.tree.leaves(grads))}


def test_a_state_of_hundreds_of_leaves_comes_back_as_the_jobs_tree(
        service: Service) -> None:
    import jax
    import optax

    with service.connect() as client:
        job = client.submit(adam_step, steps=1, init_fn=adam_init, accelerator_type="v4-8")
        state = job.result(timeout=600).state
    # optax's own types come back: the tree is the job's, leaf for leaf
    opt = state["opt"]
    assert isinstance(opt[0], optax.ScaleByAdamState) and isinstance(opt[1],
                                                                     optax.EmptyState)
    assert len(jax.tree.leaves(state)) == 3 * 2 * LAYERS + 1
    # numpy's one Adam step from the same parameters, whose gradient is themselves
    b1, b2, eps = 0.9, 0.999, 1e-8
    params = layered_params()
    for block, layers in params.items():
        for layer, leaves in layers.items():
            for name, g in leaves.items():
                mu, nu = (1 - b1) * g, (1 - b2) * g * g
                step = LEARNING_RATE * (mu / (1 - b1)) / (np.sqrt(nu / (1 - b2)) + eps)
                where = f"{block}/{layer}/{name}"
                np.testing.assert_allclose(state["params"][block][layer][name], g - step,
                                           rtol=1e-5, atol=1e-6, err_msg=where)
                np.testing.assert_allclose(opt[0].mu[block][layer][name], mu, rtol=1e-6,
                                           err_msg=where)
                np.testing.assert_allclose(opt[0].nu[block][layer][name], nu, rtol=1e-6,
                                           err_msg=where)
    assert int(opt[0].count) == 1
