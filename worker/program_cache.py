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
        # One lookup hashes the key (a long tuple for a big state) and says whether
        # it can be kept at all.
        hashable = True
        with self._lock:
            try:
                kept: _T = self._programs[key]
            except KeyError:
                pass
            except TypeError:
                hashable = False
            else:
                self._programs.move_to_end(key)
                return kept
        program = build()
        if hashable:
            with self._lock:
                self._programs[key] = program
                while len(self._programs) > self.size:
                    self._programs.popitem(last=False)
        return program

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._programs
