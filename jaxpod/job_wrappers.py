"""The wrappers a job's user objects ship in, which the workers run.

The client wraps the user's objects before shipping them: the step function in a
:class:`JobStep`, which checks what it returns and keeps only the declared outputs; a
dataset in :class:`Epochs` (or a ``dataset_fn`` in :class:`EpochsFn`), which starts over
when the input runs out, so a job of ``steps`` steps never runs short, and whose
iterators say where they are, so a resumed attempt starts where a checkpoint left it
(:class:`Resumed`); an ``initial_state`` in :class:`InitialState`, so every job's state
starts as ``strategy.run(init_fn)``. The workers unpickle these by reference (this
module is part of the installed package) and the user's code inside them by value.
:mod:`jaxpod.jobs` re-exports the documented ones (``JobStep``, ``Epochs``, ``EpochsFn``,
``InitialState``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobStep:
    """The step the workers run: the user's ``step_fn(state, batch) -> (state, outputs)``,
    checked, with only the declared outputs kept.

    A job without state carries ``()`` on the devices and shows ``step_fn`` ``None``;
    a job without input shows it ``None`` as the batch.
    """

    step_fn: Callable[..., Any]
    outputs: tuple[str, ...]
    stateful: bool
    has_input: bool

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        result = self.step_fn(state if self.stateful else None,
                              batch if self.has_input else None)
        if not (isinstance(result, tuple) and len(result) == 2):
            got = (f"a tuple of {len(result)}" if isinstance(result, tuple)
                   else type(result).__name__)
            raise TypeError(f"step_fn must return a pair (state, outputs); got {got}. Return "
                            "(new_state, {'loss': loss, ...}), or (None, {...}) for a job "
                            "without state.")
        new_state, outputs = result
        if not self.stateful and new_state is not None:
            raise TypeError("step_fn returned a state, but the job has none: pass init_fn= "
                            "or initial_state= to submit, or return (None, outputs).")
        if not self.outputs:
            return (new_state if self.stateful else ()), {}
        if not isinstance(outputs, Mapping):
            raise TypeError(f"step_fn's outputs must be a dict holding the declared outputs "
                            f"{list(self.outputs)}; got {type(outputs).__name__}.")
        missing = [n for n in self.outputs if n not in outputs]
        if missing:
            raise ValueError(f"outputs names {missing}, which step_fn does not return (it "
                             f"returns {sorted(map(str, outputs))}). Return them, or "
                             "remove them from outputs=.")
        return (new_state if self.stateful else ()), {n: outputs[n] for n in self.outputs}


@dataclass(frozen=True)
class ForkedStep:
    """A fork's own step function in its source job's step: the source's declared
    outputs, state and input, the fork's function. Both travel pickled as their
    clients shipped them (the service, which never loads user code, puts them
    together); the workers load them at the first call.

    Attributes:
      step_fn: the fork's ``step_fn``, shipped (a :class:`~jaxpod.shipping.ShippedFunction`
        payload).
      source: the source's :class:`JobStep`, shipped.
      versions: the runtime versions both were shipped with.
    """

    step_fn: bytes
    source: bytes
    versions: Mapping[str, str]

    @functools.cached_property
    def _step(self) -> JobStep:
        from jaxpod.shipping import ShippedFunction, load

        source = load(ShippedFunction(self.source, dict(self.versions)))
        inner = source._step if isinstance(source, ForkedStep) else source
        fn = load(ShippedFunction(self.step_fn, dict(self.versions)))
        return JobStep(fn, inner.outputs, inner.stateful, inner.has_input)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        return self._step(state, batch)


@dataclass(frozen=True)
class InitialState:
    """``initial_state`` as an init function: every replica starts from the value (the
    user's, or a checkpoint's, whose pytrees the coordinator holds frozen)."""

    value: Any

    def __call__(self) -> Any:
        from jaxpod.trees import thaw

        return thaw(self.value)


@dataclass(frozen=True)
class Epochs:
    """A re-iterable dataset read over and over: a job's input never runs out.

    Its iterators say where they are (:meth:`_EpochIterator.position`), so a checkpoint
    can save a host's input position and a resumed attempt start there without reading
    what came before (``start``): a random-access dataset (``__len__`` and
    ``__getitem__``: a list or array of batches, a ``grain.MapDataset``, a grain data
    source) by element index; one whose iterators have ``get_state``/``set_state`` (a
    grain ``IterDataset``) by that state; any other by replaying what was read.

    Attributes:
      dataset: the user's dataset.
      start: where its first iterator starts (``None``: at the beginning):
        ``{"at": position, "batch": rows}``, a position an iterator gave (with
        ``"rows"``: rows of that element already taken) and the rows per step of the
        run that saved it (``"replica_batch"``: per replica, for a per-host pipeline).
    """

    dataset: Any
    start: Mapping[str, Any] | None = None

    def __iter__(self) -> _EpochIterator:
        at = dict((self.start or {}).get("at") or {})
        kind = (_IndexEpochs if _random_access(self.dataset) else
                _StateEpochs if _stateful(self.dataset) else _CountEpochs)
        iterator = kind(self.dataset, at)
        iterator.skip_rows = int(at.get("rows", 0))
        iterator.global_batch = (self.start or {}).get("batch")
        iterator.replica_batch = (self.start or {}).get("replica_batch")
        return iterator

    def resumed(self, start: Mapping[str, Any] | None) -> Epochs:
        return dataclasses.replace(self, start=start)


def _random_access(dataset: Any) -> bool:
    return (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
            and not isinstance(dataset, Mapping | str | bytes))


def _stateful(dataset: Any) -> bool:
    if not hasattr(dataset, "__iter__"):
        return False
    try:  # grain's IterDataset makes its iterator without reading anything
        probe = iter(dataset)
    except TypeError:
        return False
    return hasattr(probe, "get_state") and hasattr(probe, "set_state")


class _EpochIterator(Iterator[Any]):
    """An endless iterator over epochs of a dataset that says where it is.

    Attributes:
      skip_rows: rows of the first element (or, past its end, of the next ones)
        already taken (a rebatching reader drops them first).
      global_batch: the rows per step the original run took (a rebatching reader
        that starts within a batch must not take the rows left for that).
      replica_batch: the rows per replica of a per-host pipeline's original run.
    """

    skip_rows = 0
    global_batch: int | None = None
    replica_batch: int | None = None

    def __iter__(self) -> _EpochIterator:
        return self

    def position(self) -> dict[str, Any]:
        """Where the next element comes from (JSON-serializable)."""
        raise NotImplementedError

    @staticmethod
    def _empty(dataset: Any, again: bool) -> ValueError:
        return ValueError(
            f"The job's dataset ({type(dataset).__name__}) yielded no batches"
            + (" when read again: it is not re-iterable" if again else "")
            + ". Pass a list of batches, or an object whose __iter__ starts over.")


class _IndexEpochs(_EpochIterator):
    """A random-access dataset by element index (epochs counted in the index)."""

    def __init__(self, dataset: Any, at: Mapping[str, Any]) -> None:
        self._dataset = dataset
        self._size = len(dataset)
        if not self._size:
            raise self._empty(dataset, False)
        self._next = int(at.get("index", 0))

    def __next__(self) -> Any:
        element = self._dataset[self._next % self._size]
        self._next += 1
        return element

    def position(self) -> dict[str, Any]:
        return {"index": self._next}


class _StateEpochs(_EpochIterator):
    """A dataset whose iterators save and restore their state (grain's)."""

    def __init__(self, dataset: Any, at: Mapping[str, Any]) -> None:
        self._dataset = dataset
        self._epoch = int(at.get("epoch", 0))
        self._iterator = iter(dataset)
        if "state" in at:
            self._iterator.set_state(at["state"])

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            self._epoch += 1
            self._iterator = iter(self._dataset)
            try:
                return next(self._iterator)
            except StopIteration:
                raise self._empty(self._dataset, True) from None

    def position(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "state": self._iterator.get_state()}


class _CountEpochs(_EpochIterator):
    """Any other re-iterable dataset: a resumed one reads and drops what was read."""

    def __init__(self, dataset: Any, at: Mapping[str, Any]) -> None:
        self._dataset = dataset
        self._count = 0
        self._epoch_count = 0
        self._iterator = iter(dataset)
        skip = int(at.get("count", 0))
        for _ in range(skip):
            next(self)
        if skip:  # the job's log says so (the workers' output is the job's log)
            print(f"jaxpod: the job's input cannot seek ({type(dataset).__name__}: no "
                  f"__len__/__getitem__ or get_state/set_state); {skip} element(s) read "
                  "again and skipped to resume at its checkpoint.", flush=True)

    def __next__(self) -> Any:
        for _ in range(2):
            for element in self._iterator:
                self._count += 1
                self._epoch_count += 1
                return element
            if not self._epoch_count:
                raise self._empty(self._dataset, self._count > 0)
            self._iterator, self._epoch_count = iter(self._dataset), 0
        raise self._empty(self._dataset, True)

    def position(self) -> dict[str, Any]:
        return {"count": self._count}


@dataclass(frozen=True)
class NoInput:
    """The input of a job without one: one row per replica, which ``JobStep`` never
    shows the step function."""

    rows: int

    def __iter__(self) -> Iterator[Any]:
        import numpy as np

        batch = np.zeros((self.rows,), np.int8)
        while True:
            yield batch


@dataclass(frozen=True)
class EpochsFn:
    """A ``dataset_fn`` whose per-host datasets start over when they run out; a resumed
    attempt's host starts where ``starts`` (one per host, in host order) says."""

    dataset_fn: Callable[..., Any]
    starts: tuple[Any, ...] = ()

    def __call__(self, context: Any) -> Epochs:
        host = context.input_pipeline_id
        return Epochs(self.dataset_fn(context),
                      self.starts[host] if host < len(self.starts) else None)

    def resumed(self, starts: Sequence[Any]) -> EpochsFn:
        return dataclasses.replace(self, starts=tuple(starts))


@dataclass(frozen=True)
class Resumed:
    """A job's input as the client shipped it (its pickle of an :class:`Epochs` or an
    :class:`EpochsFn`, which only the workers load), started where a checkpoint left
    each host (``starts``, in host order; see :attr:`Epochs.start`)."""

    payload: bytes
    versions: Mapping[str, str]
    starts: tuple[Any, ...]

    def _loaded(self) -> Any:
        from jaxpod.shipping import ShippedFunction, load

        return load(ShippedFunction(self.payload, dict(self.versions)))

    def __iter__(self) -> Iterator[Any]:  # an Epochs: every host reads all of it
        import jax

        host = jax.process_index()
        return iter(self._loaded().resumed(self.starts[host] if host < len(self.starts)
                                           else None))

    def __call__(self, context: Any) -> Epochs:  # an EpochsFn: one pipeline per host
        return self._loaded().resumed(self.starts)(context)


def is_reiterable(dataset: Any) -> bool:
    """Whether iterating ``dataset`` again starts over (an iterator or a generator
    does not: its second pass is empty)."""
    try:
        return iter(dataset) is not dataset
    except TypeError:
        return False
