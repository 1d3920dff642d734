"""The rest of TensorFlow's TPUStrategy surface, written once for both strategies.

TF1's ``tf.contrib.distribute.TPUStrategy`` (towers, ``run_steps_on_dataset`` with a
``MultiStepContext``, ``distribute_dataset``), TF 1.x's ``tf.distribute.Strategy``
(``experimental_run``, ``make_dataset_iterator``...) and TF2's ``strategy.extended``
(``tf.distribute.StrategyExtended``) name many members that are other names for, or
compositions of, the methods every jaxpod strategy has: ``run``, ``run_steps``,
``reduce``, ``experimental_local_results``, the dataset methods. :class:`TFCompatMixin`
implements them in terms of those methods only, so ``jaxpod.TPUStrategy`` (in-process)
and ``RemoteStrategy`` (a slice of the service) share one implementation and behave
alike. These modules are part of the shared core: they import no part of jaxpod.

Here: the mixin (towers, TF 1.x inputs, ``run_steps_on_dataset``, cross-replica
values, graph-only members) and the step that runs a TF1 step function. Beside it:
:mod:`jaxpod.tf_multistep` (``MultiStepContext``, TF1's aggregation names),
:mod:`jaxpod.tf_inputs` (``InputReplicationMode``, ``InputIterator``, TF1's datasets),
:mod:`jaxpod.tf_devices` (TF's device names for the replicas, a mixin this one builds
on) and :mod:`jaxpod.tf_extended` (``StrategyExtended``).

Graph-mode members (``configure``, ``update_config_proto``, ``initialize`` and
``finalize``, variable colocation) exist so TF code runs, and each docstring says what
they do here, which is never more than they claim.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import pickle
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.scope import get_strategy, strategy_scope
from jaxpod.tf_devices import TFDevicesMixin
from jaxpod.tf_extended import StrategyExtended
from jaxpod.tf_inputs import InputIterator, InputReplicationMode, NoArgDatasetFn, TF1Dataset
from jaxpod.tf_multistep import (
    NO_REDUCTION,
    ONLY_FIRST_REPLICA,
    OP_ALIASES,
    MultiStepContext,
    aggregation_name,
    next_loop_values,
)
from jaxpod.types import InputContext, ValueContext
from jaxpod.values import PerReplica, is_per_replica

#: Compiled wrappers a strategy keeps (see ``_canonical``): enough for any program's
#: distinct step functions, bounded like the engine's compile cache.
_WRAPPER_CACHE_SIZE = 256

#: True while a ``run_steps_on_dataset`` step function runs: it already runs once per
#: replica, so ``call_for_each_tower`` inside it calls its function directly, as TF's
#: TPUStrategy did inside ``tpu.replicate``.
_in_step: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpod_in_step",
                                                                default=False)


class _StepsOnDataset:
    """The ``run_steps`` step that runs a TF1 ``fn(context, *inputs)``.

    Equal (and hashing alike) for the same ``fn``, so the engine's compile cache and
    the remote strategy's function cache find the program of an earlier call. Its
    outputs keep the reduce op of every name in their structure (``{op: {name:
    value}}``), so the caller learns them without another round trip; non-tensor
    outputs travel pickled, as a constant byte array.
    """

    def __init__(self, fn: Callable[..., Any], has_state: bool) -> None:
        self.fn = fn
        self.has_state = has_state

    def _key(self) -> tuple[Any, ...]:
        return (self.fn, self.has_state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StepsOnDataset) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __call__(self, *args: Any) -> Any:
        state, inputs = args if self.has_state else (None, args[0])
        ctx = MultiStepContext()
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        outer = get_strategy()  # the strategy running this step (a worker's engine)
        inner = outer if isinstance(outer, TFCompatMixin) else _InStepStrategy(outer)
        token = _in_step.set(True)
        try:
            with strategy_scope(inner):
                self.fn(ctx, *inputs)
        finally:
            _in_step.reset(token)
        grouped: dict[str, dict[str, Any]] = {}
        for name, (value, op) in ctx._outputs.items():
            grouped.setdefault(op, {})[name] = value
        outputs: dict[str, Any] = {"outputs": grouped}
        if ctx._non_tensor_outputs:
            try:
                data = pickle.dumps(ctx._non_tensor_outputs)
            except Exception as e:
                raise TypeError(
                    "run_steps_on_dataset: the non-tensor outputs "
                    f"{sorted(ctx._non_tensor_outputs)} cannot be pickled ({e}); set only "
                    "plain Python objects (numbers, strings, lists, dicts).") from e
            outputs["non_tensor"] = np.frombuffer(data, np.uint8)
        if not self.has_state:
            return outputs
        return next_loop_values(state, ctx), outputs


# ------------------------------------------------------------- step helpers
# Module-level, so they compile once per strategy and ship by reference.
def _identity(x: Any) -> Any:
    return x


def _first_elements(value: Any) -> jax.Array:
    """One element of each leaf, so a program that returns them waits for them all."""
    return jnp.concatenate([jnp.ravel(jnp.real(x))[:1].astype(jnp.float32)
                            for x in jax.tree.leaves(value)])


# --------------------------------------------------------------------- mixin
class TFCompatMixin(TFDevicesMixin):
    """TF1/TF 1.x/TF2-``extended`` members composed from a strategy's own methods.

    The strategy provides ``run``, ``run_steps``, ``reduce``,
    ``experimental_local_results``, ``experimental_distribute_dataset``,
    ``distribute_datasets_from_function``,
    ``experimental_distribute_values_from_function``, ``num_replicas_in_sync``,
    ``num_hosts`` and ``steps_per_run``. TF's device names (``worker_devices``...) come
    from :class:`~jaxpod.tf_devices.TFDevicesMixin`.
    """

    if TYPE_CHECKING:
        # The strategy's own members (run, reduce, num_hosts...), as the type checker
        # sees them from here.
        def __getattr__(self, name: str) -> Any: ...

    # ------------------------------------------------------------- towers (TF1)
    @property
    def num_towers(self) -> int:
        """TF1's name for ``num_replicas_in_sync``: a tower is a replica."""
        return self.num_replicas_in_sync

    @property
    def num_towers_per_host(self) -> int:
        """Replicas on each host of the strategy."""
        return self.num_replicas_in_sync // self.num_hosts

    @property
    def is_single_tower(self) -> bool:
        """Whether there is one replica (``call_for_each_tower`` then calls ``fn`` once)."""
        return self.num_replicas_in_sync == 1

    @property
    def between_graph(self) -> bool:
        """``False``: one controller drives every replica (as TF's TPUStrategy)."""
        return False

    @property
    def should_init(self) -> bool:
        """``True``: the one controller initializes the state."""
        return True

    @property
    def should_checkpoint(self) -> bool:
        """``True``: the one controller saves checkpoints."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """``True``: the one controller writes summaries."""
        return True

    def call_for_each_tower(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """TF1's ``run``: ``fn(*args, **kwargs)`` once per replica.

        ``run_concurrently`` (TF's eager threading switch) is accepted and ignored:
        replicas always run together in one program. Inside a ``run_steps_on_dataset``
        step, which already runs per replica, ``fn`` is called directly.
        """
        kwargs.pop("run_concurrently", None)
        if _in_step.get():
            return fn(*args, **kwargs)
        return self.run(fn, args=args, kwargs=kwargs)

    # -------------------------------------------------- TF 1.x Strategy inputs
    def experimental_run(self, fn: Callable[..., Any], input_iterator: Any = None) -> Any:
        """``run(fn, args=(next(input_iterator),))``; ``run(fn)`` without an iterator."""
        if input_iterator is None:
            return self.call_for_each_tower(fn)
        return self.call_for_each_tower(fn, next(input_iterator))

    def make_dataset_iterator(self, dataset: Iterable[Any]) -> InputIterator:
        """An iterator over ``experimental_distribute_dataset(dataset)``: globally
        batched input split over the replicas by TF's rules."""
        return InputIterator(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(self, input_fn: Callable[[InputContext], Iterable[Any]],
                               replication_mode: Any = InputReplicationMode.PER_WORKER
                               ) -> InputIterator:
        """An iterator over ``distribute_datasets_from_function(input_fn)``: ``input_fn``
        runs once per host with a ``jaxpod.InputContext``; every replica takes one
        element per step."""
        mode = getattr(replication_mode, "name", replication_mode)
        if mode != InputReplicationMode.PER_WORKER.name:
            raise ValueError(
                "make_input_fn_iterator: replication_mode must be "
                f"InputReplicationMode.PER_WORKER (the only mode, as in TF). Got "
                f"{replication_mode!r}.")
        return InputIterator(self.distribute_datasets_from_function(input_fn))

    def distribute_dataset(self, dataset_fn: Callable[[], Iterable[Any]]) -> TF1Dataset:
        """TF1's ``distribute_dataset``: ``dataset_fn()`` yields per-replica batches and
        every replica takes the next element each step (replica ``r`` gets element
        ``step * num_towers + r``), on one host or several (each host reads the
        stream and keeps its replicas' elements)."""
        if not callable(dataset_fn):
            raise TypeError(
                "distribute_dataset: dataset_fn must be a callable taking no arguments and "
                f"returning an iterable of per-replica batches. Got {dataset_fn!r}.")
        return TF1Dataset(self.distribute_datasets_from_function(NoArgDatasetFn(dataset_fn)))

    # ------------------------------------------------------ run_steps_on_dataset
    def run_steps_on_dataset(self, fn: Callable[..., Any], iterator: Iterator[Any],
                             iterations: int = 1, initial_loop_values: Any = None
                             ) -> MultiStepContext:
        """Runs ``fn(context, *inputs)`` ``iterations`` times in one on-device loop.

        Each iteration takes the next element of ``iterator`` (a tuple is unpacked into
        ``inputs``) and runs once per replica, like ``run_steps``; ``context`` is a
        :class:`MultiStepContext` the step reports outputs to. At the end of the input
        the steps that remain run; a call with no input left raises
        ``jaxpod.EndOfDataError``.

        Args:
          initial_loop_values: ``None``, or values shaped like the last-step outputs
            (in name order) that the loop carries from step to step, as TF's did.

        Returns:
          A :class:`MultiStepContext` whose ``last_step_outputs`` hold the last step's
          outputs (numpy where a ``reduce_op`` was given, else ``PerReplica``).
        """
        if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
            raise ValueError(
                f"run_steps_on_dataset: iterations must be a positive int. Got {iterations!r}.")
        if isinstance(iterator, InputIterator):
            iterator = iterator.iterator  # the strategy's own: its infeed runs ahead
        has_state = initial_loop_values is not None
        step = self._canonical(_StepsOnDataset(fn, has_state))
        result = self.run_steps(step, iterator, iterations, initial_state=initial_loop_values)
        outputs = result[1] if has_state else result
        ctx = MultiStepContext()
        last: dict[str, Any] = {}
        for op, values in outputs["outputs"].items():
            if op == NO_REDUCTION:
                last.update(values)
            elif op == ONLY_FIRST_REPLICA:
                last.update(self.experimental_local_results(values)[0])
            else:
                last.update(self.reduce(op, values))  # one call for every name of the op
        ctx._last_step_outputs = last
        if "non_tensor" in outputs:
            data = self.experimental_local_results(outputs["non_tensor"])[0]
            ctx._non_tensor_outputs = pickle.loads(np.asarray(data, np.uint8).tobytes())
        return ctx

    def _canonical(self, wrapper: Hashable) -> Any:
        """The equal wrapper used before, if any: compiled programs and shipped
        functions are found again by it."""
        cache: collections.OrderedDict[Any, Any] = self.__dict__.setdefault(
            "_tf_wrappers", collections.OrderedDict())
        try:
            found = cache.setdefault(wrapper, wrapper)
        except TypeError:  # an unhashable fn: nothing to find again
            return wrapper
        cache.move_to_end(wrapper)
        if len(cache) > _WRAPPER_CACHE_SIZE:
            cache.popitem(last=False)
        return found

    # ------------------------------------------------------ cross-replica values
    def _reduce_tf1(self, reduce: Callable[..., Any], reduce_op: Any, value: Any, axis: Any,
                    destinations: Any) -> Any:
        """``reduce`` with TF1's forms too: ``reduce(aggregation, value, destinations)``
        (a device name, names or a value where TF2 has ``axis``: the reduction is over
        replicas only and the destinations are checked) and the
        ``ONLY_FIRST_TOWER`` aggregation (replica 0's value)."""
        if destinations is not None:
            self._check_destinations("reduce", destinations)
        elif _is_destinations(axis):
            try:
                self._check_destinations("reduce", axis)
            except ValueError:
                raise ValueError(
                    f"reduce: axis must be an int or None. Got {axis!r}, which is not TF1's "
                    "destinations either (device names of this strategy, e.g. "
                    f"{self.worker_devices[0]!r}).") from None
            axis = None
        name = getattr(reduce_op, "name", reduce_op)
        if isinstance(name, str) and OP_ALIASES.get(name.upper()) == ONLY_FIRST_REPLICA:
            return self.experimental_local_results(value)[0]
        return reduce(reduce_op, value, axis)

    def batch_reduce(self, aggregation: Any, value_destination_pairs: Sequence[Any]) -> list[Any]:
        """Reduces several values in one call: ``[reduce(aggregation, v) for v, _ in
        pairs]``. Destinations name where TF put the result; here results are numpy on
        the caller (they are checked to be this strategy's devices)."""
        pairs = list(value_destination_pairs)
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise TypeError(
                    "batch_reduce: value_destination_pairs must be (value, destinations) "
                    f"pairs. Got {pair!r}.")
            self._check_destinations("batch_reduce", pair[1])
        op = aggregation_name(aggregation, "batch_reduce")
        values = [v for v, _ in pairs]
        if op == NO_REDUCTION:
            raise ValueError(
                f"batch_reduce: aggregation must name a reduction (e.g. 'SUM'). Got "
                f"{aggregation!r}.")
        if op == ONLY_FIRST_REPLICA:
            return list(self.experimental_local_results(values)[0])
        return list(self.reduce(op, values))

    def broadcast(self, tensor: Any, destinations: Any = None) -> Any:
        """Mirrors ``tensor`` (an array, or a pytree of arrays) to every replica.

        Returns:
          ``PerReplica`` values whose every replica holds ``tensor``. jaxpod values
          always live on every replica, so ``destinations`` (default: all of them) is
          only checked to name this strategy's devices.
        """
        if any(isinstance(x, PerReplica)
               for x in jax.tree.leaves(tensor, is_leaf=is_per_replica)):
            raise TypeError(
                "broadcast: tensor must be an array on the caller (numpy, jax or a number), "
                "not a PerReplica value, which is already on every replica. To give every "
                "replica replica 0's component, broadcast(unwrap(value)[0]).")
        self._check_destinations("broadcast", destinations)
        return self.run(_identity, args=(tensor,))

    def unwrap(self, value: Any) -> list[Any]:
        """Every replica's value as a list (``experimental_local_results``); a value
        that is not per-replica gives ``[value]``."""
        return list(self.experimental_local_results(value))

    def value_container(self, value: Any) -> Any:
        """``value`` itself: jaxpod has no variables, so a per-replica value is its own
        container (and ``unwrap(value_container(v))`` holds ``v``'s components)."""
        return value

    def read_var(self, var: Any) -> Any:
        """The value of a mirrored ``var``: replica 0's copy, as numpy (TF's TPUStrategy
        read the primary copy). That the replicas agree is not checked."""
        return self.experimental_local_results(var)[0]

    def update(self, var: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(var, *args, **kwargs)`` on every replica with its copy of ``var``.

        Returns:
          The updated values, mirrored (``PerReplica``); jaxpod values are immutable,
          so keep the result as the new ``var``. ``grouped=False`` returns instead, for
          each leaf, the list of every replica's value.
        """
        grouped = kwargs.pop("grouped", True)
        result = self.run(fn, args=(var, *args), kwargs=kwargs)
        return result if grouped else self._ungrouped(result)

    def non_slot_devices(self, var_list: Any = None) -> tuple[str, ...]:
        """Where values that are not optimizer slots live: every replica's device, as
        every jaxpod value (there is no single-device placement)."""
        return self.worker_devices

    def update_non_slot(self, colocate_with: Any, fn: Callable[..., Any], *args: Any,
                        **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)`` on every replica, returns the results mirrored
        (``PerReplica``). TF's TPUStrategy ran it once on the host; jaxpod keeps such
        values on every replica instead. ``grouped=False``: per-leaf lists."""
        grouped = kwargs.pop("grouped", True)
        self._check_destinations("update_non_slot", colocate_with)
        result = self.run(fn, args=args, kwargs=kwargs)
        return result if grouped else self._ungrouped(result)

    def _ungrouped(self, result: Any) -> Any:
        return jax.tree.map(lambda v: list(self.experimental_local_results(v)), result,
                            is_leaf=is_per_replica)

    def group(self, value: Any, name: str | None = None) -> None:
        """Waits until every value in ``value`` is computed, then returns ``None``
        (TF's ``tf.group`` in eager mode also returns ``None``)."""
        self._wait_for(value)

    def _wait_for(self, value: Any) -> None:
        """Blocks until ``value``'s per-replica leaves are computed: a program reading
        one element of each is run and its (tiny) result fetched."""
        # One run per partial batch: ``run`` refuses values of different ones together.
        groups: dict[Any, list[PerReplica]] = {}
        for v in jax.tree.leaves(value, is_leaf=is_per_replica):
            if isinstance(v, PerReplica) and all(v.shape):
                rows = None if v.valid_rows is None else (v.shape[0], tuple(v.valid_rows))
                groups.setdefault(rows, []).append(v)
        for leaves in groups.values():
            # axis=0 holds whether or not the output counts as rows of the batch.
            self.reduce("MAX", self.run(_first_elements, args=(leaves,)), axis=0)

    def map(self, map_over: Sequence[Any], fn: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
        """``fn(map_over[r], *args, **kwargs)`` on replica ``r``: ``map_over`` holds one
        value per replica. Returns ``PerReplica`` values."""
        items = list(map_over)
        if len(items) != self.num_replicas_in_sync:
            raise ValueError(
                f"map: map_over must hold one value per replica ({self.num_replicas_in_sync}); "
                f"got {len(items)}. Split the work into rounds of that many values.")
        per_replica = self.experimental_distribute_values_from_function(_Pick(items))
        return self.run(fn, args=(per_replica, *args), kwargs=kwargs)

    # ------------------------------------------------------------ graph-only
    def configure(self, session_config: Any = None, cluster_spec: Any = None,
                  task_type: Any = None, task_id: Any = None) -> None:
        """Does nothing and returns ``None``: there is no TF session to configure, and
        the cluster comes from the strategy's resolver or slice (TF's TPUStrategy also
        ignored ``cluster_spec``, ``task_type`` and ``task_id``)."""

    def update_config_proto(self, config_proto: Any) -> Any:
        """A copy of ``config_proto``, unchanged: jaxpod's programs need no TF session
        options."""
        return copy.deepcopy(config_proto)

    def initialize(self) -> list[Any]:
        """Returns ``[]`` (TF: "empty list if nothing to be done"): the devices are
        ready once the strategy exists (in-process) or its slice is allocated."""
        return []

    def finalize(self) -> list[Any]:
        """Returns ``[]``: nothing to shut down here. A remote strategy's slice is
        released by ``close()`` (or leaving its ``with`` block)."""
        return []

    def experimental_initialize(self) -> list[Any]:
        """TF 1.x's name for :meth:`initialize` (returns ``[]``)."""
        return self.initialize()

    def experimental_finalize(self) -> list[Any]:
        """TF 1.x's name for :meth:`finalize` (returns ``[]``)."""
        return self.finalize()

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """A context that places nothing: every jaxpod value already lives on every
        replica, so values made inside sit with ``colocate_with_variable`` anyway."""
        yield

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """The strategy itself: it stands for devices (or a slice) that a copy could
        not duplicate, so objects holding it deep-copy with it shared."""
        return self

    # ------------------------------------------------------------------ TF2
    @property
    def extended(self) -> StrategyExtended:
        """TF2's ``tf.distribute.StrategyExtended`` members for this strategy."""
        return StrategyExtended(self)


class _Pick:
    """``value_fn`` giving replica ``r`` the ``r``-th item (``map``)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __call__(self, ctx: ValueContext) -> Any:
        return self.items[ctx.replica_id_in_sync_group]


def _is_destinations(axis: Any) -> bool:
    """Whether a reduce ``axis`` argument is TF1's ``destinations`` instead."""
    if isinstance(axis, str | PerReplica):
        return True
    return isinstance(axis, list | tuple) and bool(axis) and all(isinstance(a, str)
                                                                  for a in axis)


class _InStepStrategy(TFCompatMixin):
    """Inside a ``run_steps_on_dataset`` step on a worker, the strategy a shipped step
    function finds: the worker's engine plus the members above."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_engine"], name)
