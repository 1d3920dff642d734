"""Any JAX pytree through ``run``, ``reduce`` and ``experimental_local_results``, on every
backend: a flax nnx model's state with an optax AdamW state, a ``flax.struct.dataclass``,
a ``NamedTuple``, a class registered with ``register_pytree_node_class`` (all defined
here, so the remote backends get them by value) and typed PRNG keys. Remote results
come back as the same types as in-process ones; values are checked against a
single-device ``jax.jit`` run of the same computation (and against numpy).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpod

ROWS = 16  # one global batch: every sstrategy size divides it
_GRAPHDEF, _PARAMS = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
_OPTIMIZER = optax.adamw(0.05, weight_decay=0.01)


class Moments(NamedTuple):
    mean: Any
    count: Any


@flax.struct.dataclass
class Scaled:
    value: Any
    scale: float = flax.struct.field(pytree_node=False, default=2.0)


@jax.tree_util.register_pytree_node_class
class Tagged:
    """A registered class with auxiliary data (its tag), whose pickle by value differs
    from process to process (a set's order follows each process's string hashing)."""

    TAGS = frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "zeta"})

    def __init__(self, x: Any, tag: str) -> None:
        self.x, self.tag = x, tag

    def tree_flatten(self) -> tuple[tuple[Any], str]:
        return (self.x,), self.tag

    @classmethod
    def tree_unflatten(cls, tag: str, children: Any) -> Tagged:
        return cls(children[0], tag)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0, -2.0], [0.5, 0.0], [2.0, 1.0]], np.float32)).astype(
        np.float32)


def _loss(params: Any, x: Any, y: Any) -> Any:
    model = nnx.merge(_GRAPHDEF, params)
    return jnp.mean((model(x) - y) ** 2)


def init_train_state() -> dict[str, Any]:
    return {"params": _PARAMS, "opt": _OPTIMIZER.init(_PARAMS)}


def train_step(state: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    """AdamW on this replica's rows; gradients averaged over replicas."""
    ctx = jaxpod.get_replica_context()
    rows = x.shape[0] // ctx.num_replicas_in_sync
    start = ctx.replica_id_in_sync_group * rows
    mine = (jax.lax.dynamic_slice_in_dim(x, start, rows),
            jax.lax.dynamic_slice_in_dim(y, start, rows))
    grads = ctx.all_reduce("MEAN", jax.grad(_loss)(state["params"], *mine))
    updates, opt = _OPTIMIZER.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


@jax.jit
def _reference_step(state: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    grads = jax.grad(_loss)(state["params"], x, y)
    updates, opt = _OPTIMIZER.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def test_an_nnx_model_and_its_optax_state_train_as_under_jit(sstrategy: Any) -> None:
    x, y = _batch()
    state = sstrategy.run(init_train_state)
    assert type(state["params"]) is nnx.State
    assert type(state["opt"][0]) is optax.ScaleByAdamState
    for _ in range(3):  # the state goes back as handles, in its own structure
        state = sstrategy.run(train_step, args=(state, x, y))
    want = init_train_state()
    for _ in range(3):
        want = _reference_step(want, x, y)
    per_replica = sstrategy.experimental_local_results(state)
    assert len(per_replica) == sstrategy.num_replicas_in_sync
    for got in per_replica:
        assert type(got["params"]) is nnx.State and type(got["opt"][0]) is optax.ScaleByAdamState
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


def make_nodes() -> dict[str, Any]:
    ctx = jaxpod.get_replica_context()
    r = jnp.asarray(ctx.replica_id_in_sync_group, jnp.float32)
    return {"moments": Moments(jnp.full(2, r), jnp.asarray(1.0)),
            "scaled": Scaled(jnp.arange(3.0) + r, scale=3.0),
            "tagged": Tagged(r * 10.0, "ten")}


def grow_nodes(nodes: dict[str, Any]) -> dict[str, Any]:
    m, s, t = nodes["moments"], nodes["scaled"], nodes["tagged"]
    return {"moments": Moments(m.mean * 2.0, m.count + 1.0),
            "scaled": s.replace(value=s.value * s.scale),
            "tagged": Tagged(t.x + 1.0, t.tag)}


def test_registered_nodes_keep_their_types_through_run_reduce_and_results(
        sstrategy: Any) -> None:
    n = sstrategy.num_replicas_in_sync
    nodes = sstrategy.run(grow_nodes, args=(sstrategy.run(make_nodes),))
    assert type(nodes["moments"]) is Moments and type(nodes["scaled"]) is Scaled
    assert type(nodes["tagged"]) is Tagged and nodes["tagged"].tag == "ten"
    total = sstrategy.reduce("SUM", nodes, axis=None)
    r = np.arange(n, dtype=np.float32)
    assert type(total["moments"]) is Moments and type(total["tagged"]) is Tagged
    assert total["scaled"].scale == 3.0 and total["tagged"].tag == "ten"
    np.testing.assert_allclose(total["moments"].mean, np.full(2, 2 * r.sum()))
    np.testing.assert_allclose(total["moments"].count, 2.0 * n)
    np.testing.assert_allclose(total["scaled"].value, 3 * (n * np.arange(3.0) + r.sum()))
    np.testing.assert_allclose(total["tagged"].x, 10 * r.sum() + n)
    per_replica = sstrategy.experimental_local_results(nodes["scaled"])
    assert [type(p) for p in per_replica] == [Scaled] * len(per_replica)
    np.testing.assert_allclose(per_replica[-1].value,
                               3 * (np.arange(3.0) + r[len(per_replica) - 1]))


def test_a_structure_each_host_pickles_differently_comes_back_whole(
        sstrategy: Any) -> None:
    # Hosts other than the first answer a run with a digest of its outputs; their
    # structures' recipes differ byte for byte, and the hosts are still in step.
    x = np.arange(4, dtype=np.float32)
    out = sstrategy.run(lambda v: Moments(Tagged(v, "x"), v * 2), args=(x,))
    assert type(out) is Moments and type(out.mean) is Tagged and out.mean.tag == "x"
    total = sstrategy.reduce("SUM", out, axis=None)
    n = sstrategy.num_replicas_in_sync
    np.testing.assert_allclose(total.mean.x, n * x)
    np.testing.assert_allclose(total.count, 2 * n * x)


def draw(key: Any) -> tuple[Any, Any]:
    """This replica's key and a draw from it."""
    mine = jax.random.fold_in(key, jaxpod.get_replica_context().replica_id_in_sync_group)
    return mine, jax.random.uniform(mine, (2,))


def test_typed_prng_keys_go_in_and_come_back_as_keys(sstrategy: Any) -> None:
    key = jax.random.key(42)
    keys, draws = sstrategy.run(draw, args=(key,))
    local_keys = sstrategy.experimental_local_results(keys)
    local_draws = sstrategy.experimental_local_results(draws)
    for r, (k, d) in enumerate(zip(local_keys, local_draws, strict=True)):
        want = jax.random.fold_in(key, r)
        assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(want))
        np.testing.assert_allclose(d, jax.random.uniform(want, (2,)))
    # Keys held as handles go back into the next run.
    _, again = sstrategy.run(lambda k: (k, jax.random.uniform(k, (2,))), args=(keys,))
    np.testing.assert_allclose(sstrategy.experimental_local_results(again)[0],
                               jax.random.uniform(jax.random.fold_in(key, 0), (2,)))


def test_a_leaf_that_is_not_an_array_is_named(sstrategy: Any) -> None:
    with pytest.raises(TypeError, match=r"args\[0\]\S*mean"):
        sstrategy.run(lambda m: m.count, args=(Moments({1, 2}, 1.0),))
