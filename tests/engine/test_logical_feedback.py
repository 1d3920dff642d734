"""A value made under a logical-device annotation feeds the next call (issue 30).

A step that splits (or replicates, or assigns) a value over its replica's logical
devices returns it with that sharding; the next ``run`` or ``run_steps`` takes it
as it is, on the devices, and the compiled program is reused from then on. Each
test runs two and three consecutive calls on 2 and 4 logical devices per replica, on
every backend that has such a slice, and compares with numpy.

Compilations are counted by the step itself: it bumps a counter in its process
(the test process, or each remote host's worker) while it is traced and returns the
count as an output, a constant of the compiled program. A call that reuses the
previous call's program returns the same count.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import ATOL, RTOL

#: (backend, logical devices per replica) -> the replica count of the backend's slice
#: with that many logical devices (``REMOTE_SLICES`` in conftest: the 2-host backend's
#: 2 replicas span 4 chips each; no remote slice has 2 per replica, which jobs on a
#: v4-16 cover in tests/service/test_jobs.py).
REMOTE_LOGICAL = {("remote-2hosts", 4): 2}
#: Each annotation, as a step applies it to a per-replica value of shape (8, 4).
ANNOTATIONS: dict[str, Callable[[Any, Any, int], Any]] = {
    "split": lambda s, v, n: s.experimental_split_to_logical_devices(v, [n, 1]),
    "split-both": lambda s, v, n: s.experimental_split_to_logical_devices(
        v, [n // 2, 2] if n > 2 else [1, n]),
    "replicate": lambda s, v, n: s.experimental_replicate_to_logical_devices(v),
    "assign": lambda s, v, n: s.experimental_assign_to_logical_device(v, n - 1),
}


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}logical")
def logical(request: pytest.FixtureRequest, backend: str) -> tuple[Any, int]:
    """A strategy of ``backend`` with 2 or 4 logical devices per replica, and that
    number (skipped where the backend has no such slice)."""
    n = request.param
    if backend == "local":
        name = "model_parallel_strategy" if n == 2 else "four_core_strategy"
        return request.getfixturevalue(name), n
    replicas = REMOTE_LOGICAL.get((backend, n))
    if replicas is None:
        pytest.skip(f"{backend} has no slice with {n} logical devices per replica.")
    return request.getfixturevalue("strategy_of")(replicas), n


def _counted(name: str) -> jax.Array:
    """Bumps this process's trace counter ``name`` (while tracing); its new value."""
    import builtins

    counters = builtins.__dict__.setdefault("_jaxpod_test_traces", {})
    counters[name] = counters.get(name, 0) + 1
    return jnp.int32(counters[name])


def _traces(strategy: Any, out: Any) -> set[int]:
    return {int(t) for t in np.asarray(strategy.gather(out, 0)).ravel()}


@pytest.mark.parametrize("annotation", sorted(ANNOTATIONS))
def test_an_annotated_value_feeds_the_next_run(logical: tuple[Any, int],
                                               annotation: str) -> None:
    strategy, n = logical
    r = strategy.num_replicas_in_sync
    annotate, name = ANNOTATIONS[annotation], uuid.uuid4().hex
    xs = np.random.default_rng(30).normal(size=(r, 8, 4)).astype(np.float32)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: xs[ctx.replica_id_in_sync_group])

    def fn(v: jax.Array) -> dict[str, jax.Array]:
        return {"v": annotate(strategy, v * 0.5 + 1.0, n), "traces": _counted(name)[None]}

    want, traces = xs.astype(np.float64), []
    for _ in range(3):
        out = strategy.run(fn, args=(value,))
        value, want = out["v"], want * 0.5 + 1.0
        np.testing.assert_allclose(np.stack(strategy.experimental_local_results(value)),
                                   want, rtol=RTOL, atol=ATOL)
        traces.append(_traces(strategy, out["traces"]))
    assert traces[2] == traces[1], f"the third call compiled again: traces {traces}"


@pytest.mark.parametrize("annotation", sorted(ANNOTATIONS))
def test_an_annotated_state_feeds_the_next_run_steps(logical: tuple[Any, int],
                                                     annotation: str) -> None:
    strategy, n = logical
    r = strategy.num_replicas_in_sync
    annotate, name = ANNOTATIONS[annotation], uuid.uuid4().hex
    rng = np.random.default_rng(31)
    batches = [rng.normal(size=(2 * r, 4)).astype(np.float32) for _ in range(9)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    state0 = rng.normal(size=(8, 4)).astype(np.float32)

    def step(state: jax.Array, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        state = annotate(strategy, state * 0.9 + jnp.sum(batch, axis=0), n)
        return state, {"traces": _counted(name)[None]}

    state: Any = state0
    want = np.broadcast_to(state0.astype(np.float64), (r, 8, 4))
    traces = []
    for loop in range(3):
        state, out = strategy.run_steps(step, iterator, 3, initial_state=state)
        for b in batches[3 * loop:3 * loop + 3]:
            rows = b.astype(np.float64).reshape(r, 2, 4).sum(axis=1)  # each replica's
            want = want * 0.9 + rows[:, None, :]
        np.testing.assert_allclose(np.stack(strategy.experimental_local_results(state)),
                                   want, rtol=RTOL, atol=ATOL)
        traces.append(_traces(strategy, out["traces"]))
    assert traces[2] == traces[1], f"the third loop compiled again: traces {traces}"
