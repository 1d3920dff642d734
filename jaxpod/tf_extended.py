"""TF2's ``strategy.extended``: :class:`StrategyExtended` over a jaxpod strategy.

Every member calls one of the strategy's own (those of
:class:`jaxpod.tf_compat.TFCompatMixin` included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxpod.tf_multistep import MultiStepContext

if TYPE_CHECKING:
    from jaxpod.tf_compat import TFCompatMixin


class StrategyExtended:
    """TF2's ``tf.distribute.StrategyExtended`` over a jaxpod strategy.

    Every member calls the strategy's own: ``call_for_each_replica`` is ``run``,
    ``reduce_to`` is ``reduce`` and so on.
    """

    def __init__(self, strategy: TFCompatMixin) -> None:
        self._strategy = strategy

    @property
    def experimental_between_graph(self) -> bool:
        """``False``: one controller drives every replica."""
        return self._strategy.between_graph

    @property
    def experimental_require_static_shapes(self) -> bool:
        """``True``: XLA programs have static shapes (short batches are padded)."""
        return True

    @property
    def experimental_should_init(self) -> bool:
        return self._strategy.should_init

    @property
    def should_checkpoint(self) -> bool:
        return self._strategy.should_checkpoint

    @property
    def should_save_summary(self) -> bool:
        return self._strategy.should_save_summary

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return self._strategy.parameter_devices

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return self._strategy.worker_devices

    @property
    def steps_per_run(self) -> int:
        """The strategy's default steps per ``run_steps`` call."""
        return self._strategy.steps_per_run

    def call_for_each_replica(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                              kwargs: dict[str, Any] | None = None) -> Any:
        """``strategy.run(fn, args, kwargs)``."""
        return self._strategy.call_for_each_tower(fn, *args, **(kwargs or {}))

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any,
                  options: Any = None) -> Any:
        """``strategy.reduce(reduce_op, value)`` (numpy on the caller); ``destinations``
        are checked to be this strategy's devices."""
        return self._strategy.batch_reduce(reduce_op, [(value, destinations)])[0]

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Sequence[Any],
                        options: Any = None) -> list[Any]:
        return self._strategy.batch_reduce(reduce_op, value_destination_pairs)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        return self._strategy.broadcast(tensor, destinations)

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None, group: bool = True) -> Any:
        """``fn(var, *args, **kwargs)`` on every replica; mirrored results (per-leaf
        lists of every replica's value with ``group=False``)."""
        return self._strategy.update(var, fn, *args, grouped=group, **(kwargs or {}))

    def update_non_slot(self, colocate_with: Any, fn: Callable[..., Any],
                        args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                        group: bool = True) -> Any:
        return self._strategy.update_non_slot(colocate_with, fn, *args, grouped=group,
                                              **(kwargs or {}))

    def non_slot_devices(self, var_list: Any) -> tuple[str, ...]:
        return self._strategy.non_slot_devices(var_list)

    def value_container(self, value: Any) -> Any:
        return self._strategy.value_container(value)

    def read_var(self, v: Any) -> Any:
        return self._strategy.read_var(v)

    def colocate_vars_with(self, colocate_with_variable: Any
                           ) -> contextlib.AbstractContextManager[None]:
        return self._strategy.colocate_vars_with(colocate_with_variable)

    def experimental_run_steps_on_iterator(self, fn: Callable[..., Any], iterator: Any,
                                           iterations: int = 1,
                                           initial_loop_values: Any = None
                                           ) -> MultiStepContext:
        """``strategy.run_steps_on_dataset`` (TF 1.x's name on ``extended``)."""
        return self._strategy.run_steps_on_dataset(fn, iterator, iterations,
                                                   initial_loop_values)

    def __repr__(self) -> str:
        return f"StrategyExtended({self._strategy!r})"
