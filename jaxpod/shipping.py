"""Functions and objects shipped by value as cloudpickle bytes, keyed by content hash.

The sender pickles a function by value together with the versions that decide whether
the bytes can be loaded (Python, jax, cloudpickle); the worker checks them before it
unpickles, so a mismatch is a clear error instead of a confusing failure deep inside
pickle or XLA. Pytree node types defined in the sender's own modules travel by value
too, where their registration decorators do not run: their registrations ride along
(:class:`~jaxpod.trees.Registration`) and the receiver registers them on load.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import io
import pickle
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import jax

from jaxpod.errors import VersionMismatchError


def runtime_versions() -> dict[str, str]:
    """The versions that must match between a function's sender and its runner."""
    return {
        "python": ".".join(platform.python_version_tuple()[:2]),
        "jax": jax.__version__,
        "cloudpickle": cloudpickle.__version__,
    }


@dataclass(frozen=True)
class ShippedFunction:
    """A function ready to travel: its pickle, content id and the sender's versions."""

    payload: bytes
    versions: dict[str, str]

    @property
    def function_id(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()[:32]


def ship(fn: Callable[..., Any]) -> ShippedFunction:
    """Pickles ``fn`` by value.

    Raises:
      TypeError: ``fn`` is not callable or cannot be pickled (e.g. it closes over a
        lock, a socket or an open file).
    """
    if not callable(fn):
        raise TypeError(f"Expected a callable step function. Got {type(fn).__name__}.")
    return ship_object(fn, repr(getattr(fn, "__qualname__", fn)),
                       "Step functions must not capture locks, sockets, open files or "
                       "similar objects; create those inside the function.")


def ship_object(obj: Any, name: str, fix: str) -> ShippedFunction:
    """Pickles any object (a function, a dataset) by value for the workers.

    Args:
      obj: what to send.
      name: how an error names it.
      fix: the advice an error gives when ``obj`` does not pickle.

    Raises:
      TypeError: ``obj`` cannot be pickled.
    """
    from jaxpod.trees import user_registrations

    _pickle_user_modules_by_value()
    try:
        payload, classes = _dumps(obj)
        registrations = user_registrations(classes)
        if registrations:  # rare: pytree classes of the sender's own modules
            payload = cloudpickle.dumps(_Registered(tuple(registrations), obj),
                                        protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"Cannot send {name} to the workers: it cannot be pickled "
            f"({type(e).__name__}: {e}). {fix}"
        ) from e
    return ShippedFunction(payload, runtime_versions())


class _ClassRecorder(cloudpickle.Pickler):
    """A cloudpickle pickler that notes every class it pickles."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.classes: set[type] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type):
            self.classes.add(obj)
        return super().reducer_override(obj)


def _dumps(obj: Any) -> tuple[bytes, set[type]]:
    """``obj`` pickled by cloudpickle, and the classes the pickle holds."""
    buffer = io.BytesIO()
    pickler = _ClassRecorder(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.classes


@dataclass(frozen=True)
class _Registered:
    """A shipped object with the pytree registrations it may need (see the module)."""

    registrations: tuple[Any, ...]
    value: Any


def is_shipped_by_value(kind: type) -> bool:
    """Whether cloudpickle sends class ``kind`` by value: defined in ``__main__``, in a
    function, or in a module the workers cannot import."""
    module = getattr(kind, "__module__", None) or ""
    return (module == "__main__" or "<locals>" in getattr(kind, "__qualname__", "")
            or _is_user_module(module))


@functools.cache
def _installed_top_level_names() -> frozenset[str]:
    return frozenset(importlib.metadata.packages_distributions())


def _is_user_module(name: str) -> bool:
    """A module the workers cannot import: not stdlib, not from an installed package."""
    top = name.partition(".")[0]
    return not (name == "__main__" or top in sys.stdlib_module_names
                or top in _installed_top_level_names() or top.startswith("_"))


#: Names in sys.modules already looked at: each ship only looks at those imported since.
_examined: set[str] = set()


def _pickle_user_modules_by_value() -> None:
    """Makes cloudpickle carry the code of the user's own modules.

    Step functions defined in scripts, notebooks or test modules live in modules the
    workers do not have; pickled by reference they would fail to load there. Code of
    installed packages (jax, numpy, jaxpod...) stays by reference. cloudpickle keeps the
    registration by name, so each name is registered once.
    """
    for name in sys.modules.keys() - _examined:  # one C-level pass; cheap when none are new
        module = sys.modules.get(name)
        if module is None:  # a failed import's placeholder: look again once it is real
            continue
        if getattr(module, "__file__", None) and "." not in name and _is_user_module(name):
            with contextlib.suppress(ValueError):  # not importable by that name any more
                cloudpickle.register_pickle_by_value(module)
        _examined.add(name)  # only now: a ship in another thread must not skip it early


def load(shipped: ShippedFunction) -> Any:
    """Unpickles ``shipped`` after checking the sender's versions; registers the pytree
    node types it brought."""
    check_versions(shipped.versions)
    obj = cloudpickle.loads(shipped.payload)
    if isinstance(obj, _Registered):
        from jaxpod.trees import register

        register(obj.registrations)
        obj = obj.value
    return obj


def check_versions(sender: dict[str, str]) -> None:
    """Raises ``VersionMismatchError`` naming every version that differs."""
    mine = runtime_versions()
    diff = {k: (sender.get(k), v) for k, v in mine.items() if sender.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: sender {a}, worker {b}" for k, (a, b) in diff.items())
        raise VersionMismatchError(
            f"The function was pickled by a different runtime than the worker's ({detail}). "
            "Install the worker's versions on the client (pip install "
            + " ".join(f"{k}=={b}" for k, (_, b) in diff.items() if k != "python")
            + ") or use the same Python version."
        )
