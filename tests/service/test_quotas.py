"""Slice quotas counted against real session tables and a job count (no cluster)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from jaxpod.errors import QuotaExceededError
from jaxpod.service.auth.quotas import SliceQuotas
from jaxpod.service.auth.tokens import Principal, Role, TokenBook
from jaxpod.service.sessions import SessionManager
from jaxpod.service.slices.held import HeldSlice
from jaxpod.timeouts import wait_for


def _held(name: str, slices: int) -> HeldSlice:
    engine: Any = None  # never used: the quota reads the description only
    return HeldSlice(name, engine, lambda: None, {"num_slices": slices})


@pytest.fixture
def quotas() -> tuple[SliceQuotas, SessionManager, dict[str, int]]:
    book = TokenBook([(Principal("quinn", Role.SUBMITTER, 3), b"q" * 32),
                      (Principal("free", Role.SUBMITTER), b"f" * 32)])
    sessions = SessionManager(30.0)
    jobs: dict[str, int] = {}
    q = SliceQuotas(book, sessions)
    q.count_jobs_with(lambda owner: jobs.get(owner, 0))
    return q, sessions, jobs


def test_sessions_jobs_and_acquisitions_all_count(
        quotas: tuple[SliceQuotas, SessionManager, dict[str, int]]) -> None:
    q, sessions, jobs = quotas
    mine, other = sessions.open(owner="quinn"), sessions.open(owner="free")
    mine.add_slice(_held("a", 1))
    other.add_slice(_held("b", 2))  # another owner's: not counted for quinn
    jobs["quinn"] = 1
    assert q.held("quinn") == 2 and q.over("quinn", 1) is None
    with q.reserve("quinn", 1, "AcquireSlice"):  # 3 of 3 while it acquires
        assert q.held("quinn") == 3
        with (pytest.raises(QuotaExceededError, match="holds 3 slice\\(s\\) of its max_slices 3"),
              q.reserve("quinn", 1, "AcquireSlice")):
            pass
        assert "holds 3" in (q.over("quinn", 1) or "")
        started: list[bool] = []
        assert q.admit("quinn", 1, lambda: started.append(True)) is not None
        assert not started
    assert q.held("quinn") == 2  # the failed acquisition gave its room back
    assert q.admit("quinn", 1, lambda: jobs.__setitem__("quinn", 2)) is None
    assert q.held("quinn") == 3
    # No max_slices: never held back, however much it holds.
    jobs["free"] = 100
    assert q.over("free", 50) is None
    q.check_fits("free", 10**6, "SubmitJob")
    with pytest.raises(QuotaExceededError, match="needs 4 slice\\(s\\), over the max_slices 3"):
        q.check_fits("quinn", 4, "SubmitJob")


def test_concurrent_reservations_never_exceed_the_quota(
        quotas: tuple[SliceQuotas, SessionManager, dict[str, int]]) -> None:
    q, _, _ = quotas
    granted, refused = [], []
    gate = threading.Barrier(8)
    release = threading.Event()

    def acquire() -> None:
        gate.wait()
        try:
            with q.reserve("quinn", 1, "AcquireSlice"):
                granted.append(1)
                release.wait(30)
        except QuotaExceededError:
            refused.append(1)

    threads = [threading.Thread(target=acquire) for _ in range(8)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(granted) + len(refused) == 8, 30)
    release.set()
    for t in threads:
        t.join(30)
    assert (len(granted), len(refused)) == (3, 5)
    assert q.held("quinn") == 0
