"""The benchmarks' real model: a 2-layer decoder-only transformer in flax nnx with
optax AdamW, its weights FSDP-sharded over the mesh's ``data`` axis, the step written
as a user writes it for ``jax.jit`` (split the pure state, merge, differentiate,
update). The shape of ``examples/transformer_lm.py`` (92 state leaves: kernels and
biases, AdamW moments, counters), without its tensor-parallel axis, on a
``{"data": -1}`` mesh.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 256, 64, 64, 4, 2
BATCH = 32  # global rows: 4 per chip of a v4-16
LEARNING_RATE = 3e-3
DATA = ("data", None)  # FSDP: each weight's first axis over the data axis


def _modules() -> Any:
    """The nnx classes, defined on first use (the benchmark scripts import this module
    before JAX is configured)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    def dense(inputs: int, outputs: int, rngs: nnx.Rngs) -> nnx.Linear:
        return nnx.Linear(inputs, outputs, rngs=rngs,
                          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                            DATA))

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.qkv = dense(WIDTH, 3 * WIDTH, rngs)
            self.out = dense(WIDTH, WIDTH, rngs)
            self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = dense(WIDTH, 4 * WIDTH, rngs)
            self.down = dense(4 * WIDTH, WIDTH, rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, w = x.shape
            q, k, v = (y.reshape(b, t, HEADS, w // HEADS)
                       for y in jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
            scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(w // HEADS)
            causal = jnp.tril(jnp.ones((t, t), bool))
            weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
            x = x + self.out(jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, w))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class TransformerLM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            init = nnx.with_partitioning(nnx.initializers.normal(0.02), DATA)
            self.tokens = nnx.Embed(VOCAB, WIDTH, embedding_init=init, rngs=rngs)
            self.positions = nnx.Embed(SEQ, WIDTH, embedding_init=init, rngs=rngs)
            for i in range(LAYERS):
                setattr(self, f"block{i}", Block(rngs))
            self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.head = dense(WIDTH, VOCAB, rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
            for i in range(LAYERS):
                x = getattr(self, f"block{i}")(x)
            return self.head(self.norm(x))

    def new_state() -> tuple[Any, Any]:
        model = TransformerLM(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(LEARNING_RATE, weight_decay=0.01),
                                    wrt=nnx.Param)

    return nnx, optax, new_state


def _pure(model: Any, optimizer: Any) -> dict[str, Any]:
    from flax import nnx

    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def init() -> dict[str, Any]:
    """The state: model and optimizer, each array sharded as its partitioning says
    (under the job's mesh, or the plain program's ``jax.set_mesh``)."""
    import jax

    nnx, _, new_state = _modules()
    model, optimizer = new_state()
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer),
               jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return _pure(model, optimizer)


def step(state: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One AdamW step on a global batch of token windows."""
    nnx, optax, new_state = _modules()
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(nnx.eval_shape(new_state))
    nnx.replace_by_pure_dict(params, {"0": state["model"], "1": state["optimizer"]})
    model, optimizer = nnx.merge(graphdef, params)

    def loss_of(model: Any, tokens: Any) -> Any:
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_of)(model, batch["tokens"])
    optimizer.update(model, grads)
    return _pure(model, optimizer), {"loss": loss}


def batches(count: int) -> list[dict[str, np.ndarray]]:
    """``count`` global batches of random token windows."""
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)}
            for _ in range(count)]
