"""The functions a host worker runs, defined once by content id and reused."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from jaxpod.errors import JaxpodError
from jaxpod.shipping import ShippedFunction, load


class UnknownFunctionError(JaxpodError, KeyError):
    """A function id that was never defined on this worker."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown function"


class FunctionRegistry:
    """function id -> callable, defined once and reused for every call."""

    def __init__(self) -> None:
        self._functions: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def define(self, shipped: ShippedFunction) -> str:
        fid = shipped.function_id
        with self._lock:
            if fid not in self._functions:
                self._functions[fid] = load(shipped)
        return fid

    def get(self, function_id: str) -> Callable[..., Any]:
        with self._lock:
            try:
                return self._functions[function_id]
            except KeyError:
                raise UnknownFunctionError(
                    f"Function {function_id} is not defined on this worker; define it "
                    "before calling it."
                ) from None
