"""A byte-level transformer language model trained as a sharded jaxpod job.

A small decoder-only transformer in flax nnx, trained with optax AdamW on a grain
pipeline over text every Python installation ships (a few standard-library modules'
source), sharded FSDP x tensor-parallel on a simulated v4-16: ``mesh={"data": 4,
"model": 2}``. The step is written as for plain ``jax.jit`` (split, merge, update);
jaxpod runs it over the slice, checkpoints it with orbax on the hosts, and resumes it
when a host dies. Then this script restores the last checkpoint with plain orbax, with
no jaxpod involved, and evaluates it on held-out text.

    python examples/transformer_lm.py                 # the embedded local service
    python examples/transformer_lm.py --kill-host     # SIGKILL a host mid-run
    python examples/transformer_lm.py --one-device    # also train on one device, compare

It prints the loss as the job runs and writes the curve to ``--plot`` (a PNG).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import pathlib
import re
import signal
import sys
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

MESH = {"data": 4, "model": 2}
ACCELERATOR = "v4-16"


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256  # bytes
    seq: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 32  # global batch: 4 rows per chip
    learning_rate: float = 3e-3


CONFIG = Config()


# ---------------------------------------------------------------------- the corpus
def corpus() -> bytes:
    """Text every Python installation has: the source of a few standard modules."""
    modules = (argparse, dataclasses, pathlib, re)
    return b"\n".join(pathlib.Path(m.__file__ or "").read_bytes() for m in modules)


class Windows:
    """``seq + 1`` consecutive bytes per element (inputs and next-byte targets), from
    the first 90% of the corpus (``train``) or the rest; random access, so a resumed
    job seeks straight to its position. Reads the corpus on the host that uses it."""

    def __init__(self, train: bool, seq: int, stride: int = 7) -> None:
        self.train, self.seq, self.stride = train, seq, stride
        self._data: np.ndarray | None = None

    def _text(self) -> np.ndarray:
        if self._data is None:
            data = np.frombuffer(corpus(), np.uint8)
            cut = int(len(data) * 0.9)
            self._data = data[:cut] if self.train else data[cut:]
        return self._data

    def __len__(self) -> int:
        return (len(self._text()) - self.seq - 1) // self.stride

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = index * self.stride
        return {"tokens": self._text()[start:start + self.seq + 1].astype(np.int32)}

    def __getstate__(self) -> dict[str, Any]:  # ship the recipe, not the bytes
        return {**self.__dict__, "_data": None}


def batches(train: bool = True, cfg: Config = CONFIG) -> Any:
    """The grain pipeline: shuffled windows, in global batches of ``cfg.batch``."""
    return (grain.MapDataset.source(Windows(train, cfg.seq)).shuffle(seed=0)
            .batch(cfg.batch, drop_remainder=True))


# ----------------------------------------------------------------------- the model
def dense(inputs: int, outputs: int, spec: tuple[str | None, ...], rngs: nnx.Rngs
          ) -> nnx.Linear:
    return nnx.Linear(inputs, outputs, use_bias=False, rngs=rngs, kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), spec))


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP. Weights are FSDP-sharded over ``data``
    along one axis and tensor-parallel over ``model`` along heads and hidden units
    (Megatron's split)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        w = cfg.width
        self.heads = cfg.heads
        self.norm1 = nnx.LayerNorm(w, rngs=rngs)
        self.qkv = dense(w, 3 * w, ("data", "model"), rngs)
        self.out = dense(w, w, ("model", "data"), rngs)
        self.norm2 = nnx.LayerNorm(w, rngs=rngs)
        self.up = dense(w, 4 * w, ("data", "model"), rngs)
        self.down = dense(4 * w, w, ("model", "data"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, w = x.shape
        q, k, v = (y.reshape(b, t, self.heads, w // self.heads)
                   for y in jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(w // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + self.out(jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, w))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        embed_init = nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "model"))
        self.tokens = nnx.Embed(cfg.vocab, cfg.width, embedding_init=embed_init, rngs=rngs)
        self.positions = nnx.Embed(cfg.seq, cfg.width, embedding_init=embed_init, rngs=rngs)
        self.layers = cfg.layers
        for i in range(cfg.layers):  # attributes, so checkpoint keys are names
            setattr(self, f"block{i}", Block(cfg, rngs))
        self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.head = dense(cfg.width, cfg.vocab, ("data", "model"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        for i in range(self.layers):
            x = getattr(self, f"block{i}")(x)
        return self.head(self.norm(x))


def new_train_state(cfg: Config = CONFIG) -> tuple[TransformerLM, nnx.Optimizer]:
    """A fresh model and its AdamW optimizer."""
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(cfg.learning_rate, weight_decay=0.01),
                                wrt=nnx.Param)


def abstract_train_state() -> tuple[Any, Any]:
    """The model and optimizer's graph and shapes, with no arrays: what a pure-dict
    state merges into."""
    with nnx.use_eager_sharding(False):  # shapes only: no mesh needed
        return nnx.split(nnx.eval_shape(new_train_state))


def as_pure(model: TransformerLM, optimizer: nnx.Optimizer) -> dict[str, Any]:
    """Model and optimizer as a pure dict of arrays: the job's state and checkpoint."""
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def from_pure(state: dict[str, Any]) -> tuple[TransformerLM, nnx.Optimizer]:
    graphdef, params = abstract_train_state()
    nnx.replace_by_pure_dict(params, {"0": state["model"], "1": state["optimizer"]})
    return nnx.merge(graphdef, params)


def init_fn() -> dict[str, Any]:
    """The job's state: model and optimizer, each array sharded as its
    ``nnx.with_partitioning`` metadata says (the job's mesh is current here)."""
    print(f"pid {os.getpid()}")  # traced once per attempt on each host: --kill-host reads it
    model, optimizer = new_train_state()
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer),
               jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return as_pure(model, optimizer)


def loss_of(model: TransformerLM, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def step_fn(state: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One AdamW step, written as for ``jax.jit``: merge, differentiate, update."""
    model, optimizer = from_pure(state)
    loss, grads = nnx.value_and_grad(loss_of)(model, batch["tokens"])
    optimizer.update(model, grads)
    return as_pure(model, optimizer), {"loss": loss}


# ----------------------------------------------------------------- after the job
def restored_model(path: str) -> Any:
    """The model of the checkpoint at ``path``, read with plain orbax (no jaxpod)."""
    import orbax.checkpoint as ocp
    return from_pure(ocp.StandardCheckpointer().restore(path))[0]


def evaluate(model: Any, count: int = 8) -> float:
    """Mean next-byte loss on the first ``count`` batches of held-out text."""
    held_out = batches(train=False)
    loss = jax.jit(loss_of)
    return float(np.mean([loss(model, held_out[i]["tokens"]) for i in range(count)]))


def one_device_run(steps: int) -> tuple[Any, list[float]]:
    """The same steps on one device of this process (a 1 x 1 mesh of the same axis
    names): the reference the sharded job must reach."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((1, 1), tuple(MESH), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:1])
    train = batches()
    losses = []
    with jax.set_mesh(mesh), contextlib.redirect_stdout(io.StringIO()):  # init_fn's pid
        state = jax.jit(init_fn)()
        step = jax.jit(step_fn, donate_argnums=0)
        for i in range(steps):
            state, out = step(state, train[i])
            losses.append(float(out["loss"]))
    return from_pure(jax.device_get(state))[0], losses


def kill_a_host(job: Any) -> int | None:
    """SIGKILLs host 1's worker (its pid as ``init_fn`` printed it) once the job has a
    committed checkpoint; the pid, or ``None`` if it is not time yet."""
    if not job.checkpoints():
        return None
    pids = re.findall(r"^\[host 1\] pid (\d+)$", job.logs(), re.MULTILINE)
    if not pids:
        return None
    os.kill(int(pids[-1]), signal.SIGKILL)
    return int(pids[-1])


def plot(curve: list[tuple[int, float]], path: str, reference: list[float] | None,
         killed_at: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*curve, strict=True), marker="o",
            label=f"jaxpod job, mesh {MESH} (mean per loop)")
    if reference:
        ax.plot(range(1, len(reference) + 1), reference, alpha=0.6, label="one device")
    if killed_at is not None:
        ax.axvline(killed_at, color="grey", linestyle=":", label="host SIGKILLed")
    ax.set(xlabel="step", ylabel="train loss (nats/byte)", title="Byte-level transformer LM")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--steps-per-run", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--kill-host", action="store_true",
                        help="SIGKILL host 1 after the first checkpoint (the job resumes)")
    parser.add_argument("--one-device", action="store_true",
                        help="also run the steps on one device here and compare")
    parser.add_argument("--plot", default="transformer_lm_loss.png", help="PNG of the loss")
    parser.add_argument("--address", default=None, help="jaxpod serve (default: embedded)")
    args = parser.parse_args(argv)

    import jaxpod

    with jaxpod.connect(args.address) as client:
        return train(client, args)


def train(client: Any, args: argparse.Namespace) -> int:
    """Submits the job, follows it, then restores and evaluates its last checkpoint."""
    job = client.submit(step_fn, steps=args.steps, accelerator_type=ACCELERATOR,
                        init_fn=init_fn, dataset=batches(), mesh=MESH,
                        steps_per_run=args.steps_per_run,
                        checkpoint_every=args.checkpoint_every, outputs={"loss": "MEAN"},
                        name="transformer-lm")
    print(f"submitted job {job.id}: {args.steps} steps on a {ACCELERATOR}, mesh {MESH}",
          flush=True)
    curve: list[tuple[int, float]] = []
    killed: int | None = None
    killed_at: int | None = None
    started = time.monotonic()
    for status in job.watch():
        # A resumed attempt restarts from its checkpoint: the lost steps' points go.
        curve = [(step, loss) for step, loss in curve if step <= status.step]
        if "loss" in status.metrics and status.step > (curve[-1][0] if curve else 0):
            curve.append((status.step, status.metrics["loss"]))
            print(f"  step {status.step:5d}/{status.steps}  loss {curve[-1][1]:.4f}  "
                  f"attempt {status.attempts}  {time.monotonic() - started:6.1f} s", flush=True)
        if args.kill_host and killed is None and status.state == "RUNNING":
            killed = kill_a_host(job)
            if killed is not None:
                killed_at = status.step
                print(f"  SIGKILLed host 1's worker (pid {killed}) at step {killed_at}",
                      flush=True)
    final = job.status()
    if final.state != "SUCCEEDED":
        print(f"job {job.id} ended {final.state}: {final.error}", file=sys.stderr)
        return 1
    share = (final.goodput or {}).get("productive_share")
    print(f"job {job.id} {final.state} after {final.attempts} attempt(s)"
          + ("" if share is None else f"; goodput {share:.0%} productive"))
    if killed is not None:
        for attempt in job.attempts()[:-1]:
            print(f"  attempt {attempt.number}: {attempt.cause}")

    # The last checkpoint, with plain orbax, in this process (one CPU device).
    checkpoint = job.checkpoints()[-1]
    model = restored_model(checkpoint.path)
    held_out = evaluate(model)
    print(f"checkpoint at step {checkpoint.step} ({checkpoint.path}): held-out loss "
          f"{held_out:.4f} nats/byte ({held_out / math.log(2):.3f} bits)")
    reference = None
    if args.one_device:
        reference_model, reference = one_device_run(args.steps)
        expected = evaluate(reference_model)
        print(f"one-device run of the same {args.steps} steps: held-out loss {expected:.4f}")
        if not math.isclose(held_out, expected, rel_tol=1e-3):
            print("the sharded job and the one-device run disagree", file=sys.stderr)
            return 1
    plot(curve, args.plot, reference, killed_at)
    print(f"loss curve: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
