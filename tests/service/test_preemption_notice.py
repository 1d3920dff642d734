"""Preemption notices on a real slice: SIGTERM to one host worker is reported for that
host, the slice keeps working until the grace ends, and its release stops the workers
instead of keeping them warm.

Real Ray actors on a simulated v4-16 (2 hosts x 4 chips), driven through
:class:`RaySlices` as the coordinator drives them. The cluster starts with a short
grace (``JAXPOD_PREEMPTION_GRACE_S``): its workers inherit the variable.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpod.errors import JaxpodError
from jaxpod.service.capacity.local_cluster import LocalTPUCluster, is_running
from jaxpod.service.capacity.pools import RaySlices
from jaxpod.service.capacity.requests import SliceRequest
from jaxpod.service.slices.group_engine import GroupEngine
from jaxpod.service.slices.held import HeldSlice
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

CLUSTER_SLICES = "v4-16"
# Long enough for the checks made within it on a busy machine, short enough to wait out.
GRACE_S = 12.0
NOTICE_TIMEOUT_S = 10.0
GONE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module", autouse=True)
def short_grace() -> Iterator[None]:
    """Set before the cluster starts (autouse fixtures of a scope come first): the
    launcher, its raylets and so the host workers inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXPOD_PREEMPTION_GRACE_S", str(GRACE_S))
        yield


@pytest.fixture(scope="module")
def slices(ray_cluster: LocalTPUCluster, short_grace: None) -> Iterator[RaySlices]:
    provider = RaySlices(start_timeout_s=120)
    try:
        yield provider
    finally:
        provider.close()


def _acquire(slices: RaySlices) -> HeldSlice:
    request = SliceRequest(accelerator_type="v4-16", steps_per_run=1,
                                     timeout_s=60)
    return slices.acquire(request, "slice-v4-16")


def _processes(held: HeldSlice) -> dict[int, str]:
    """The slice's worker pids with their start times (a reused pid is another process)."""
    return {pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
            for pid in held.engine.group.pids}


def _all_gone(processes: dict[int, str]) -> bool:
    return bool(wait_for(lambda: not any(is_running(p, s) for p, s in processes.items()),
                         GONE_TIMEOUT_S))


def _shifted(x: jax.Array) -> jax.Array:
    return x + 1.0


def _check_runs(engine: GroupEngine) -> None:
    x = np.arange(6, dtype=np.float32)
    parts = engine.local_results(engine.run(_shifted, args=(x,)))
    assert len(parts) == 8
    for part in parts:
        np.testing.assert_array_equal(part, x + 1.0)


def _terminate(engine: GroupEngine, host: int) -> float:
    """SIGTERMs ``host``'s worker, waits for its notice; returns when it was sent."""
    sent = time.time()
    os.kill(engine.group.pids[host], signal.SIGTERM)
    assert wait_for(lambda: engine.preemption_notices()[host], NOTICE_TIMEOUT_S), \
        "the SIGTERMed host reported no preemption notice"
    return sent


def test_the_notice_is_reported_for_that_host_and_the_slice_is_not_kept_warm(
        slices: RaySlices) -> None:
    held = _acquire(slices)
    processes = _processes(held)
    try:
        _check_runs(held.engine)  # compiled before the grace starts counting
        assert held.engine.preemption_notices() == [None, None]
        sent = _terminate(held.engine, host=1)
        first, second = held.engine.preemption_notices()
        assert first is None
        assert second is not None and second.reason == "SIGTERM"
        assert sent <= second.at <= time.time()
        _check_runs(held.engine)  # both hosts still work within the grace
        assert all(is_running(p, s) for p, s in processes.items())
    finally:
        held.release()
    assert slices.warm() == []
    assert _all_gone(processes), "the preempted slice's workers were not stopped"
    assert slices.allocator.live() == ()


def test_the_worker_exits_once_the_grace_is_over(slices: RaySlices) -> None:
    held = _acquire(slices)
    processes = _processes(held)
    victim = held.engine.group.pids[0]
    try:
        sent = _terminate(held.engine, host=0)
        _check_runs(held.engine)
        # It keeps running for the whole grace, and then no longer.
        gone = wait_for(lambda: not is_running(victim, processes[victim]),
                        GRACE_S + GONE_TIMEOUT_S)
        assert gone and time.time() - sent >= GRACE_S
        with pytest.raises(JaxpodError):
            held.engine.preemption_notices()
    finally:
        held.release()  # the failed ask stops the slice, as a failed reset would
    assert slices.warm() == []
    assert _all_gone(processes)
    assert slices.allocator.live() == ()
