"""What a TF1 ``run_steps_on_dataset`` step reports: :class:`MultiStepContext`.

The step function calls ``set_last_step_output`` (with a reduce op or TF1's
aggregation names, which :func:`aggregation_name` reads; the strategy's
``batch_reduce`` and TF1 ``reduce`` take the same names) and
``set_non_tensor_output``; :func:`next_loop_values` checks and carries the last-step
outputs as the loop values of the next step. The step wrapper that runs the user's
function and the strategy member that runs the loop are in :mod:`jaxpod.tf_compat`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpod.types import ReduceOp

#: What ``MultiStepContext.set_last_step_output`` accepts besides a ``ReduceOp``.
ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"
NO_REDUCTION = "NONE"
OP_ALIASES = {"NONE": NO_REDUCTION, "ONLY_FIRST_REPLICA": ONLY_FIRST_REPLICA,
              "ONLY_FIRST_TOWER": ONLY_FIRST_REPLICA}


def aggregation_name(reduce_op: Any, what: str) -> str:
    """A reduce op or TF aggregation as one of ``NONE``, ``ONLY_FIRST_REPLICA`` or a
    ``ReduceOp`` name."""
    if reduce_op is None:
        return NO_REDUCTION
    name = getattr(reduce_op, "name", reduce_op)  # tf-like enums carry .name
    if isinstance(name, str) and name.upper() in OP_ALIASES:
        return OP_ALIASES[name.upper()]
    try:
        return ReduceOp.from_value(reduce_op if isinstance(reduce_op, ReduceOp) else name).value
    except ValueError:
        raise ValueError(
            f"{what}: reduce_op must be None (no reduction), a jaxpod.ReduceOp, one of "
            "'SUM', 'MEAN', 'MIN', 'MAX', or 'ONLY_FIRST_REPLICA' (TF's ONLY_FIRST_TOWER). "
            f"Got {reduce_op!r}.") from None


class MultiStepContext:
    """What a ``run_steps_on_dataset`` step function reports (TF1's ``MultiStepContext``).

    The step function receives one as its first argument and calls
    :meth:`set_last_step_output` / :meth:`set_non_tensor_output`; the context that
    ``run_steps_on_dataset`` returns holds the outputs of the last step that ran.

    Attributes:
      run_op: always ``None``. In TF1 this was the op that ran the loop; here the loop
        has already run on the devices when ``run_steps_on_dataset`` returns.
    """

    def __init__(self) -> None:
        self._outputs: dict[str, tuple[Any, str]] = {}
        self._last_step_outputs: dict[str, Any] = {}
        self._non_tensor_outputs: dict[str, Any] = {}
        self.run_op: None = None

    def set_last_step_output(self, name: str, output: Any, reduce_op: Any = None) -> None:
        """Reports ``output`` (arrays, or a pytree of them) of this step as ``name``.

        Args:
          name: the key in ``last_step_outputs``.
          output: this replica's value.
          reduce_op: ``None`` keeps every replica's value (a ``PerReplica``);
            ``"SUM"``/``"MEAN"``/``"MIN"``/``"MAX"`` (or a ``ReduceOp``) combine them
            across replicas into one numpy value, as ``strategy.reduce(op, value)``;
            ``"ONLY_FIRST_REPLICA"`` keeps replica 0's value.
        """
        if not isinstance(name, str):
            raise TypeError(f"set_last_step_output: name must be a str. Got {name!r}.")
        op = aggregation_name(reduce_op, f"set_last_step_output({name!r})")
        self._outputs[name] = (output, op)

    def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Reports a Python object (a number, a string, ...) as ``name``.

        As in TF1, it is recorded while the step function is traced (once per
        compiled program), not on every step; it must be picklable.
        """
        if not isinstance(name, str):
            raise TypeError(f"set_non_tensor_output: name must be a str. Got {name!r}.")
        self._non_tensor_outputs[name] = output

    @property
    def last_step_outputs(self) -> dict[str, Any]:
        """The outputs set by :meth:`set_last_step_output` in the last step: numpy for
        reduced ones, ``PerReplica`` values for the others."""
        return self._last_step_outputs

    @property
    def non_tensor_outputs(self) -> dict[str, Any]:
        """The objects set by :meth:`set_non_tensor_output`."""
        return self._non_tensor_outputs

    def __repr__(self) -> str:
        return (f"MultiStepContext(last_step_outputs={sorted(self._last_step_outputs)}, "
                f"non_tensor_outputs={sorted(self._non_tensor_outputs)})")


def next_loop_values(state: Any, ctx: MultiStepContext) -> Any:
    """The loop values after a step: the last-step outputs (flattened in name order,
    as TF's ``nest.flatten`` orders a dict) in the structure of the initial ones."""
    flat_state, treedef = jax.tree.flatten(state)
    names = sorted(ctx._outputs)
    flat_out = jax.tree.leaves([ctx._outputs[n][0] for n in names])
    want = [(jnp.shape(s), jnp.result_type(s)) for s in flat_state]
    got = [(jnp.shape(o), jnp.result_type(o)) for o in flat_out]
    if want != got:
        raise TypeError(
            "run_steps_on_dataset: initial_loop_values must have the shapes and dtypes of "
            f"the last-step outputs (set_last_step_output) in name order {names}; they "
            f"have {want}, the outputs {got}. Pass matching initial_loop_values, or None.")
    return jax.tree.unflatten(treedef, [jnp.asarray(o) for o in flat_out])
