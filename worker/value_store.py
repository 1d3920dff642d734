"""Per-worker store of device-resident values, addressed by handle ids.

The coordinator refers to a worker's ``PerReplica`` values only by id; the arrays stay
on the devices until freed. Every host of a replica group stores the same ids (they
run the same operations in the same order), each holding its addressable shards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from jaxpod.errors import UnknownHandleError
from jaxpod.values import PerReplica
from jaxpod.worker.global_view import GlobalValue

#: What a handle names: a per-replica value, or a global-view job's global array.
StoredValue = PerReplica | GlobalValue


@dataclass(frozen=True)
class StoreStats:
    """What the coordinator shows of a worker's device memory held by handles."""

    num_values: int
    device_bytes: int


class ValueStore:
    """Handle id -> ``PerReplica`` (or ``GlobalValue``); thread-safe."""

    def __init__(self) -> None:
        self._values: dict[int, StoredValue] = {}
        self._lock = threading.Lock()

    def put(self, value: StoredValue, handle: int) -> int:
        """Keeps ``value`` as ``handle`` (an id the coordinator assigned)."""
        with self._lock:
            if handle in self._values:
                raise ValueError(f"Handle {handle} is in use on this worker already; the "
                                 "coordinator assigns each id once.")
            self._values[handle] = value
            return handle

    def get(self, handle: int) -> StoredValue:
        with self._lock:
            try:
                return self._values[handle]
            except KeyError:
                raise UnknownHandleError(
                    f"Handle {handle} does not exist on this worker: it was never created "
                    "here, or was freed (or lost when its slice was reset). Use a value "
                    "returned by this session's strategy, and not after freeing it."
                ) from None

    def per_replica(self, handle: int) -> PerReplica:
        """``handle``'s value, which must be a per-replica one."""
        value = self.get(handle)
        if not isinstance(value, PerReplica):
            raise TypeError(f"Handle {handle} is a global-view job's global array, not a "
                            "per-replica value: it has no replicas to gather or fetch.")
        return value

    def free(self, handles: list[int]) -> int:
        """Drops ``handles`` (unknown ones are ignored: free is idempotent)."""
        with self._lock:
            return sum(self._values.pop(h, None) is not None for h in handles)

    def clear(self) -> int:
        """Drops every value (the slice goes to its next holder); returns how many."""
        with self._lock:
            count = len(self._values)
            self._values.clear()
            return count

    def stats(self) -> StoreStats:
        with self._lock:
            values = list(self._values.values())
        nbytes = sum(s.data.nbytes for v in values for s in v.array.addressable_shards)
        return StoreStats(len(values), int(nbytes))
