"""The current strategy: ``strategy.scope()`` and ``jaxpod.get_strategy()``.

Shared by every part: the in-process engine enters a strategy's scope while step
functions run, and the remote client's ``RemoteStrategy.scope()`` does the same on the
client. A strategy object that a step function captured on the client travels as
:func:`current_strategy_stand_in`; on a host worker it stands for the strategy whose
scope is active when it is used (the worker's engine, inside ``run``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_current_strategy: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxpod_current_strategy", default=None)


def get_strategy() -> Any:
    """The strategy whose ``scope()`` is active in this thread, or ``None``."""
    return _current_strategy.get()


@contextlib.contextmanager
def strategy_scope(strategy: Any) -> Iterator[None]:
    """Makes ``strategy`` current and enters its cross-replica context."""
    token = _current_strategy.set(strategy)
    try:
        yield
    finally:
        _current_strategy.reset(token)


class _CurrentStrategy:
    """Forwards every attribute to the strategy in scope where it is used."""

    def __getattr__(self, name: str) -> Any:
        strategy = get_strategy()
        if strategy is None:
            raise RuntimeError(
                f"A strategy captured by a shipped function was used ({name!r}) outside "
                "any strategy's scope. Use it inside the step function that strategy.run "
                "calls.")
        return getattr(strategy, name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (current_strategy_stand_in, ())


def current_strategy_stand_in() -> Any:
    """What a client-side strategy object becomes when a step function ships."""
    return _CurrentStrategy()


_current_mesh: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxpod_current_mesh", default=None)


def mesh() -> Any:
    """The slice's ``jax.sharding.Mesh`` inside a global-view job's ``init_fn`` and
    ``step_fn`` (``client.submit(..., mesh={"data": -1, "model": 2})``).

    Raises:
      RuntimeError: called anywhere else.
    """
    current = _current_mesh.get()
    if current is None:
        raise RuntimeError(
            "jaxpod.mesh() was called outside a global-view job: it is the slice's mesh "
            "only while a job submitted with mesh={...} traces its init_fn or step_fn. "
            "Submit with mesh=, or build your own jax.sharding.Mesh elsewhere.")
    return current


@contextlib.contextmanager
def mesh_scope(current: Any) -> Iterator[None]:
    """Makes ``current`` what :func:`mesh` returns (and JAX's current mesh, so that bare
    ``PartitionSpec`` s name its axes)."""
    import jax

    token = _current_mesh.set(current)
    try:
        with jax.set_mesh(current):
            yield
    finally:
        _current_mesh.reset(token)
