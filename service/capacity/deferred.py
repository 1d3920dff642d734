"""The slice provider of a service that listens before its cluster is up."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from jaxpod import settings
from jaxpod.errors import AllocationTimeoutError, JaxpodError, ServiceUnavailableError
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.capacity.resolvers.base import ALLOCATION_TIMEOUT
from jaxpod.timeouts import Cancel, Deadline

#: How long a cluster status call that arrives while the service is still connecting to
#: its cluster waits for it (under the client's ``JAXPOD_CONTROL_TIMEOUT_S``, 30 s, so
#: the client sees this error, which names the knob, rather than its own deadline).
#: Acquiring a slice waits within the allocation's own time-out instead.
CLUSTER_READY_TIMEOUT = settings.CLUSTER_READY_TIMEOUT


class _Provider(Protocol):
    def acquire(self, request: SliceRequest, slice_id: str,
                cancel: Cancel | None = None) -> Any: ...

    def cluster(self) -> list[ClusterSlice]: ...

    def snapshot(self) -> Sequence[Any]: ...

    def has_free(self, accelerator_type: str, num_slices: int) -> bool: ...

    def close(self) -> None: ...


class DeferredSlices:
    """The slice provider once the cluster is up.

    The service listens before its cluster is ready (a local one takes seconds to
    start). Calls that arrive in that window wait for it, each within its own time-out
    (an acquire within its allocation time-out, which then covers the wait plus the
    allocation), on an event set when the cluster is up or failed to come up; if it
    failed, they fail naming why.
    """

    def __init__(self) -> None:
        self._settled = threading.Event()
        self._target: _Provider | None = None
        self._failure: BaseException | None = None

    def state(self) -> str:
        """``"connecting"``, ``"ready"`` or ``"failed"``."""
        if not self._settled.is_set():
            return "connecting"
        return "ready" if self._target is not None else "failed"

    @property
    def target(self) -> _Provider | None:
        """The provider, once the cluster is up (``None`` until then)."""
        return self._target

    def ready(self, target: _Provider) -> None:
        """The cluster is up: calls waiting for it go on to ``target``."""
        if not self._settled.is_set():
            self._target = target
            self._settled.set()

    def failed(self, error: BaseException) -> None:
        """The cluster did not come up (or the service is stopping first): calls waiting
        for it, and later ones, fail naming ``error``. No effect once ready."""
        if not self._settled.is_set():
            self._failure = error
            self._settled.set()

    def _wait(self, deadline: Deadline, what: str, limit: str, knob: str,
              late: type[JaxpodError]) -> _Provider:
        """The provider, once ready; ``late`` when ``deadline`` passes first (``limit``
        says what set it, ``knob`` what to raise)."""
        if not self._settled.wait(deadline.remaining()):
            raise late(
                f"{what}: the jaxpod service was still connecting to its cluster after "
                f"{deadline.total_s:g}s ({limit}); expected it ready by then. See the "
                f"service's log for what it is waiting on, or raise {knob}.")
        if self._target is None:
            error = self._failure
            raise ServiceUnavailableError(
                f"{what}: the jaxpod service's cluster did not come up "
                f"({type(error).__name__}: {error}), so it cannot hand out slices. Fix the "
                f"cause named here (more in the service's log) and start `jaxpod serve` "
                f"again.")
        return self._target

    def acquire(self, request: SliceRequest, slice_id: str,
                cancel: Cancel | None = None) -> Any:
        if self._target is not None:
            return self._target.acquire(request, slice_id, cancel)
        deadline = Deadline(ALLOCATION_TIMEOUT.resolve(request.timeout_s or None))
        target = self._wait(
            deadline, f"acquiring a {request.accelerator_type or '?'} slice",
            f"the acquire's time-out: its timeout_s, else {ALLOCATION_TIMEOUT.env_var}, "
            f"default {ALLOCATION_TIMEOUT.default_s:g}s",
            f"{ALLOCATION_TIMEOUT.env_var} or pass timeout_s", AllocationTimeoutError)
        # The allocation gets what is left of the acquire's time-out.
        waited = request.waiting_at_most(max(deadline.remaining(), 1e-3))
        return target.acquire(waited, slice_id, cancel)

    def has_free(self, accelerator_type: str, num_slices: int) -> bool:
        """False until the cluster is up (a job then waits in its queue)."""
        return self._target is not None and self._target.has_free(accelerator_type,
                                                                   num_slices)

    def cluster(self) -> list[ClusterSlice]:
        if self._target is not None:
            return self._target.cluster()
        timeout = CLUSTER_READY_TIMEOUT
        return self._wait(
            Deadline(timeout.seconds()), "cluster status",
            f"{timeout.env_var}, default {timeout.default_s:g}s", timeout.env_var,
            ServiceUnavailableError).cluster()

    def snapshot(self) -> Sequence[Any]:
        """The cluster's slices with their hosts (for the page); only once ready."""
        if self._target is None:
            raise ServiceUnavailableError("the cluster is not up yet")
        return self._target.snapshot()

    def close(self) -> None:
        if self._target is not None:
            self._target.close()
