"""Global-view (SPMD) jobs on one host (DESIGN §8): the user's ``init_fn`` and
``step_fn`` as ``jax.jit`` programs over the whole slice, with global arrays.

A job submitted with ``mesh={"data": -1, "model": 2}`` runs on the same engine as a
per-replica job: its input still comes through the engine's infeeds (one replica per
device, so positions, prefetch and resume are the same), and :class:`GlobalView` turns
each loop's per-replica batches into global batches, split by the job's
``batch_sharding`` over the job's mesh. The state is whatever ``init_fn`` made, each
leaf with the sharding ``init_fn`` gave it (``with_sharding_constraint``, flax nnx
partitioning): every loop takes it donated and gives it back with the same shardings,
so FSDP and tensor parallelism are the user's choice and no loop moves it.

Tracing happens with :func:`jaxpod.mesh` returning the mesh and the mesh set as JAX's
current one, so bare ``PartitionSpec`` s name its axes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.scope import mesh_scope
from jaxpod.values import PerReplica, component_dtype
from jaxpod.worker.engine import Engine
from jaxpod.worker.meshes import slice_major_mesh
from jaxpod.worker.program_cache import ProgramCache
from jaxpod.worker.replica_context import REPLICA_AXIS

#: Compiled programs kept per job (init, abstract init, one loop per length).
_PROGRAMS = 16


class GlobalValue:
    """A global ``jax.Array`` of a global-view job (a state leaf or an output), as the
    host's value store keeps it. Unlike a ``PerReplica`` it has no replica axis."""

    __slots__ = ("array",)
    valid_rows = None

    def __init__(self, array: jax.Array) -> None:
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> Any:
        return component_dtype(self.array.dtype)


def is_global(x: Any) -> bool:
    return isinstance(x, GlobalValue)


class GlobalView:
    """A global-view job's mesh and programs on this host.

    Args:
      engine: the host's engine (one device per replica): its devices form the mesh
        and its infeeds the input.
      axes: the job's mesh, axis names to sizes in order (one may be -1).
      batch_sharding: how each global batch is split: a ``PartitionSpec`` for every
        leaf, a pytree of them matching the batch, or ``None`` (rows over the mesh's
        first axis).

    Raises:
      ValueError: the engine has logical devices, or the mesh does not fit the slice.
    """

    def __init__(self, engine: Engine, axes: Mapping[str, int], batch_sharding: Any) -> None:
        if engine.device_assignment.num_cores_per_replica != 1:
            raise ValueError(
                "A global-view job (mesh=...) shards by its mesh, not by logical devices: "
                f"submit it without computation_shape (got "
                f"{engine.device_assignment.num_cores_per_replica} devices per replica).")
        self.engine = engine
        self.mesh: Mesh = slice_major_mesh(axes, list(engine.mesh.devices.flat))
        self.batch_sharding = batch_sharding
        self.replicated = NamedSharding(self.mesh, P())
        self._same_order = list(self.mesh.devices.flat) == list(engine.mesh.devices.flat)
        self._programs = ProgramCache(_PROGRAMS)

    # ------------------------------------------------------------------ programs
    def _cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        return self._programs.get(key, build)

    def init(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under ``jax.jit`` over the mesh: the state, as :class:`GlobalValue`
        leaves with the shardings ``fn`` gave them."""
        program = self._cached(("init", fn), lambda: jax.jit(fn))
        with mesh_scope(self.mesh):
            out = program()
        return jax.tree.map(GlobalValue, out)

    def abstract_init(self, fn: Callable[[], Any]) -> list[jax.ShapeDtypeStruct]:
        """What :meth:`init` would make, without running it: each leaf's shape, dtype and
        sharding (a resumed attempt restores its checkpoint onto these)."""
        def build() -> list[jax.ShapeDtypeStruct]:
            program = self._cached(("init", fn), lambda: jax.jit(fn))
            with mesh_scope(self.mesh):
                lowered = program.lower()
                shardings = jax.tree.leaves(lowered.compile().output_shardings)
            shapes = jax.tree.leaves(lowered.out_info)
            return [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
                    for s, sh in zip(shapes, shardings, strict=True)]
        return list(self._cached(("abstract", fn), build))

    def call(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under ``jax.jit`` over the mesh (``strategy.spmd``):
        :class:`GlobalValue` arguments keep their shardings, host arrays and scalars are
        split by ``batch_sharding``; the results as :class:`GlobalValue` leaves."""
        args, kwargs = jax.tree.map(self._argument, (args, kwargs), is_leaf=_is_argument)
        program = self._cached(("call", fn), lambda: jax.jit(fn))
        with mesh_scope(self.mesh):
            out = program(*args, **kwargs)
        return jax.tree.map(GlobalValue, out)

    def _argument(self, x: Any) -> Any:
        if isinstance(x, GlobalValue):
            x = x.array
        if isinstance(x, jax.Array):
            mesh = getattr(x.sharding, "mesh", self.mesh)
            if isinstance(x.sharding, NamedSharding) and mesh != self.mesh:
                raise ValueError(
                    f"An argument lives on a mesh of {dict(mesh.shape)}, not on this "
                    f"function's {dict(self.mesh.shape)}: global values stay on the mesh "
                    "that made them. Use the same mesh= for every spmd function of a "
                    "computation.")
            return x
        if isinstance(x, PerReplica):
            raise TypeError(
                "A PerReplica value (from strategy.run) cannot be an argument of an spmd "
                "function, which takes global arrays: pass the values an spmd function "
                "returned, or host arrays (strategy.gather(value, 0) makes one).")
        if isinstance(x, np.ndarray | np.generic | int | float | complex | bool):
            host = np.asarray(x)
            sharding = NamedSharding(self.mesh, self._argument_spec(host))
            return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        return x

    def _argument_spec(self, host: np.ndarray) -> P:
        if isinstance(self.batch_sharding, P):
            return self.batch_sharding
        first = self.mesh.axis_names[0]
        if host.ndim and host.shape[0] % self.mesh.shape[first] == 0:
            return P(first)
        return P()

    def run_steps(self, fn: Callable[..., Any], iterator: Any, steps: int, state: Any
                  ) -> tuple[Any, Any]:
        """``steps`` steps of ``fn(state, batch) -> (state, outputs)`` in one on-device
        loop; the state (:class:`GlobalValue` leaves) is donated and comes back with the
        same shardings, the outputs stacked over the steps (scalars: ``(steps,)``)."""
        batch = self.engine.extended.next_steps(iterator, steps)
        if batch.valid_rows is not None and batch.rows is not None and (
                batch.valid_rows != batch.rows).any():
            raise ValueError(
                "A global-view job's batches must split evenly over the slice's "
                f"{self.engine.num_replicas_in_sync} devices: a step got "
                f"{int(batch.valid_rows[:, 0].sum())} rows, shared unevenly. Make the "
                f"global batch a multiple of {self.engine.num_replicas_in_sync} rows.")
        specs = tuple(self._batch_specs(batch.treedef, len(batch.arrays)))
        # Where the mesh keeps the engine's device order (CPUs, one slice of a line),
        # each device's rows are taken as they are and the loop lays them out; else
        # they move to the mesh first.
        batches = [self._on_mesh(a) for a in batch.arrays] if self._same_order else [
            self._to_global(a, spec) for a, spec in zip(batch.arrays, specs, strict=True)]
        leaves, treedef = jax.tree.flatten(state, is_leaf=is_global)
        arrays = [v.array for v in leaves]
        shardings = tuple(a.sharding for a in arrays)
        key = ("steps", fn, treedef, batch.treedef, batch.num_steps,
               tuple((a.shape, str(a.dtype)) for a in arrays + batches), shardings,
               tuple(b.sharding for b in batches), specs)
        program = self._cached(key, lambda: self._loop(fn, treedef, batch.treedef, shardings,
                                                       specs))
        with mesh_scope(self.mesh):
            new_state, outputs = program(arrays, batches)
        wrap = jax.tree.map(GlobalValue, outputs)
        return jax.tree.unflatten(treedef, [GlobalValue(a) for a in new_state]), wrap

    def _loop(self, fn: Callable[..., Any], state_treedef: Any, batch_treedef: Any,
              shardings: tuple[Any, ...], specs: tuple[P, ...]) -> Any:
        def step(carry: list[jax.Array], xs: list[jax.Array]) -> tuple[list[jax.Array], Any]:
            state = jax.tree.unflatten(state_treedef, carry)
            new_state, outputs = fn(state, jax.tree.unflatten(batch_treedef, xs))
            new_leaves, new_treedef = jax.tree.flatten(new_state)
            if new_treedef != state_treedef:
                raise TypeError(
                    "step_fn must return the state with the structure init_fn gave it. "
                    f"Got {new_treedef} for {state_treedef}.")
            for name, value in (outputs.items() if isinstance(outputs, Mapping) else ()):
                if jnp.ndim(value) != 0:
                    raise TypeError(
                        f"A global-view job's outputs are recorded as metrics: output "
                        f"{name!r} must be a scalar. Got shape {jnp.shape(value)}; "
                        "reduce it in step_fn (e.g. jnp.mean).")
            # Each leaf keeps its sharding inside the loop too (the carry is never
            # gathered onto every device).
            return [lax.with_sharding_constraint(x, s)
                    for x, s in zip(new_leaves, shardings, strict=True)], outputs

        def loop(state: list[jax.Array], batches: list[jax.Array]) -> Any:
            if self._same_order:
                batches = [lax.with_sharding_constraint(
                    _rows_first(b), NamedSharding(self.mesh, P(None, *spec)))
                    for b, spec in zip(batches, specs, strict=True)]
            return lax.scan(step, state, batches)

        return jax.jit(loop, donate_argnums=0,
                       out_shardings=(list(shardings), self.replicated))

    # --------------------------------------------------------------------- input
    def _batch_specs(self, treedef: Any, count: int) -> list[P]:
        spec = self.batch_sharding
        if spec is None:
            return [P(self.mesh.axis_names[0])] * count
        if isinstance(spec, P):
            return [spec] * count
        try:
            specs = treedef.flatten_up_to(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "batch_sharding must be one PartitionSpec for every batch leaf, or a "
                f"pytree of them shaped like the batch ({treedef}). Got {spec!r}: {e}"
            ) from None
        for s in specs:
            if not isinstance(s, P):
                raise TypeError(f"batch_sharding's leaves must be PartitionSpecs. Got {s!r}.")
        return list(specs)

    def _on_mesh(self, array: jax.Array) -> jax.Array:
        """A per-replica array as the same buffers on the job's mesh (replicas over all
        its axes, in the engine's order: no copy)."""
        sharding = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
        return jax.make_array_from_single_device_arrays(
            array.shape, sharding, [s.data for s in array.addressable_shards])

    def _to_global(self, array: jax.Array, spec: P) -> jax.Array:
        """A loop's per-replica batch leaf ``(replicas, steps, rows, ...)`` as the global
        batches ``(steps, replicas * rows, ...)`` split by ``spec``: the rows are laid
        end to end in replica order on the devices (no transfer), then resharded."""
        def build() -> Any:
            return jax.jit(_rows_first,
                           out_shardings=NamedSharding(self.engine.mesh, P(None, REPLICA_AXIS)))
        rows_first = self._cached(("rows", array.shape), build)
        return jax.device_put(rows_first(array), NamedSharding(self.mesh, P(None, *spec)))



def _is_argument(x: Any) -> bool:
    return isinstance(x, GlobalValue | PerReplica)


def _rows_first(x: jax.Array) -> jax.Array:
    """``(replicas, steps, rows, ...)`` -> ``(steps, replicas * rows, ...)``."""
    r, k, rows, *rest = x.shape
    return jnp.swapaxes(x, 0, 1).reshape(k, r * rows, *rest)
