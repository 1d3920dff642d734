"""The functions a host worker runs, defined once by content id and reused.

The worker keeps them in a cache bounded by the size of their pickles,
``JAXPOD_FUNCTION_CACHE_BYTES`` (default 256 MiB), and evicts the least recently used
first: a caller that gets an :class:`UnknownFunctionError` defines the function again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from jaxpod import settings
from jaxpod.errors import UnknownFunctionError
from jaxpod.shipping import ShippedFunction, load

CACHE_BYTES_ENV = settings.FUNCTION_CACHE_BYTES.name
DEFAULT_CACHE_BYTES: int = settings.FUNCTION_CACHE_BYTES.default

#: Evicted ids remembered, so that an error can say a function was evicted (bounded
#: too: ids older than these read as never defined).
_EVICTED_KEPT = 4096


class FunctionRegistry:
    """function id -> callable, defined once and reused for every call, least recently
    used evicted first once the pickles' sizes add up to more than ``max_bytes``.

    Args:
      max_bytes: the bound; ``None`` reads ``JAXPOD_FUNCTION_CACHE_BYTES`` (default
        256 MiB).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = _cache_bytes(max_bytes)
        self._functions: OrderedDict[str, tuple[Callable[..., Any], int]] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many functions are kept."""
        return len(self._functions)

    @property
    def held_bytes(self) -> int:
        """The summed pickle sizes of the functions kept."""
        return self._bytes

    def define(self, shipped: ShippedFunction) -> str:
        """Loads ``shipped`` unless it is kept already; returns its id.

        Raises:
          ValueError: its pickle alone is larger than the cache.
        """
        fid, size = shipped.function_id, len(shipped.payload)
        if size > self.max_bytes:
            raise ValueError(
                f"Function {fid} pickles to {size} bytes, more than this worker's function "
                f"cache holds ({CACHE_BYTES_ENV}={self.max_bytes}). Raise "
                f"{CACHE_BYTES_ENV} on the workers, or make the function capture less "
                "(pass large arrays as arguments)."
            )
        with self._lock:
            if fid in self._functions:
                self._functions.move_to_end(fid)
                return fid
        fn = load(shipped)  # outside the lock: unpickling user code may be slow
        with self._lock:
            if fid not in self._functions:
                self._functions[fid] = (fn, size)
                self._bytes += size
                self._evicted.pop(fid, None)
                self._evict_beyond_limit()
        return fid

    def get(self, function_id: str) -> Callable[..., Any]:
        """The function defined as ``function_id``, now the most recently used."""
        with self._lock:
            kept = self._functions.get(function_id)
            if kept is not None:
                self._functions.move_to_end(function_id)
                return kept[0]
            if function_id in self._evicted:
                raise UnknownFunctionError(
                    f"Function {function_id} was evicted from this worker's function cache "
                    f"({CACHE_BYTES_ENV}={self.max_bytes} bytes, least recently used "
                    "first). Define it again before calling it, or raise "
                    f"{CACHE_BYTES_ENV} on the workers."
                )
        raise UnknownFunctionError(
            f"Function {function_id} is not defined on this worker (or was evicted from "
            f"its function cache, {CACHE_BYTES_ENV}={self.max_bytes} bytes); define it "
            "before calling it."
        )

    def forget(self, function_ids: tuple[str, ...]) -> None:
        """Drops these functions (their definition failed on another host, so that the
        caches of a group's hosts stay alike); unknown ids are ignored."""
        with self._lock:
            for fid in function_ids:
                kept = self._functions.pop(fid, None)
                if kept is not None:
                    self._bytes -= kept[1]

    def _evict_beyond_limit(self) -> None:
        while self._bytes > self.max_bytes:
            fid, (_, size) = self._functions.popitem(last=False)
            self._bytes -= size
            self._evicted[fid] = None
            if len(self._evicted) > _EVICTED_KEPT:
                self._evicted.popitem(last=False)


def _cache_bytes(explicit: int | None) -> int:
    return int(settings.FUNCTION_CACHE_BYTES.value(explicit))
