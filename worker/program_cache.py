"""Compiled programs by key, the most recently used kept: the engine's, a global-view
job's and the checkpoint layouts' caches."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

_T = TypeVar("_T")


class ProgramCache:
    """Up to ``size`` programs, each built on its key's first use; past ``size`` the
    least recently used one is dropped (a long-lived worker meets ever new shapes and
    functions). A key that cannot be hashed (an unhashable callable in it) is built
    each time and not kept. Threads may share it: a program is built outside the lock,
    so two threads may build one key's at once (either is kept)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"A program cache must hold at least 1 program; got {size}.")
        self.size = size
        self._programs: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], _T]) -> _T:
        try:
            hash(key)
        except TypeError:
            return build()
        with self._lock:
            if key in self._programs:
                self._programs.move_to_end(key)
                kept: _T = self._programs[key]
                return kept
        program = build()
        with self._lock:
            self._programs[key] = program
            while len(self._programs) > self.size:
                self._programs.popitem(last=False)
        return program

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._programs
