"""The dashboard's pieces that need no service: the shared recent answers, the
origin check of state-changing requests and the job store's readiness check."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from jaxpod.service.auth.tokens import LOCAL, Role, TokenBook
from jaxpod.service.http import auth, routes
from jaxpod.service.http.backend import Backend, store_writable
from jaxpod.service.http.routes import CACHE, Recent
from jaxpod.service.jobs.manager import JobManager
from jaxpod.service.jobs.store import JobStore


class Model:
    """What a route computes: something with ``model_dump_json``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def model_dump_json(self) -> str:
        return str(self.value)


def test_recent_answers_are_shared_and_refreshed_without_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    release = threading.Event()

    def compute() -> Model:
        calls.append(1)
        if len(calls) > 1:
            release.wait(10)  # the refresh is slow: polls must not wait for it
        return Model(len(calls))

    async def scenario() -> None:
        recent = Recent()
        first = await asyncio.gather(*(recent.get("k", compute) for _ in range(5)))
        assert first == [b"1"] * 5 and len(calls) == 1  # one read for all of them
        monkeypatch.setenv(CACHE.env_var, "1e-9")  # from now on every answer is old
        stale = await asyncio.gather(*(recent.get("k", compute) for _ in range(5)))
        assert stale == [b"1"] * 5  # the previous answer, at once
        release.set()
        # Too old to give at all: the next poll waits for the refresh in flight.
        monkeypatch.setattr(routes, "MAX_STALE_S", 0.0)
        refreshed = await asyncio.wait_for(recent.get("k", compute), 10)
        assert refreshed == b"2" and len(calls) == 2  # one refresh for all of them

    asyncio.run(scenario())


def test_recent_answers_reflect_every_acknowledged_change() -> None:
    revision = [0]
    reads: list[int] = []  # the revision each read started at

    def compute() -> Model:
        reads.append(revision[0])
        return Model(revision[0])

    async def scenario() -> None:
        recent = Recent()
        assert await recent.get("k", compute, lambda: revision[0]) == b"0"
        assert await recent.get("k", compute, lambda: revision[0]) == b"0"  # cached
        assert reads == [0]
        revision[0] = 1  # a change acknowledged: within CACHE, yet never the old answer
        answers = await asyncio.gather(*(recent.get("k", compute, lambda: revision[0])
                                         for _ in range(5)))
        assert answers == [b"1"] * 5 and reads == [0, 1]  # one read for all of them

    asyncio.run(scenario())


def test_a_failed_read_is_not_kept() -> None:
    outcomes: list[Exception | Model] = [RuntimeError("store gone"), Model(7)]

    def compute() -> Model:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def scenario() -> None:
        recent = Recent()
        with pytest.raises(RuntimeError, match="store gone"):
            await recent.get("k", compute)
        assert await recent.get("k", compute) == b"7"

    asyncio.run(scenario())


def _request(method: str, headers: dict[str, str]) -> Request:
    return Request({"type": "http", "method": method, "scheme": "http", "path": "/x",
                    "server": ("127.0.0.1", 8080), "query_string": b"",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


@pytest.mark.parametrize("method, headers, how, refused", [
    ("GET", {"Origin": "http://evil.example"}, "cookie", False),  # reads are not checked
    ("POST", {}, "bearer", False),  # a non-browser client
    ("POST", {}, "cookie", True),  # a browser always sends an origin
    ("POST", {"Origin": "http://127.0.0.1:8080"}, "cookie", False),
    ("POST", {"Referer": "http://127.0.0.1:8080/?job=1"}, "cookie", False),
    ("POST", {"Origin": "http://evil.example"}, "cookie", True),
    ("POST", {"Origin": "http://evil.example"}, "bearer", True),
    ("POST", {"Referer": "http://evil.example/"}, "cookie", True),
])
def test_state_changes_must_come_from_the_dashboard(method: str, headers: dict[str, str],
                                                     how: str, refused: bool) -> None:
    request = _request(method, {"Host": "127.0.0.1:8080", **headers})
    assert (auth.origin_problem(request, how) is not None) == refused


def test_the_cookie_names_the_token_and_proves_it_without_holding_it() -> None:
    checker = auth.Auth(TokenBook.single("s3cret"))
    admin = checker.login("s3cret")
    assert admin is not None and (admin.name, admin.role) == ("admin", Role.ADMIN)
    assert not any(checker.login(t) for t in ("", "s3cre", "s3cret!", "S3CRET"))
    cookie = checker.cookie_for(admin)
    assert cookie.startswith("admin.") and "s3cret" not in cookie
    assert auth.Auth(None).identify(_request("GET", {})) == ("open", LOCAL)
    assert checker.identify(_request("GET", {})) is None
    assert checker.identify(_request("GET", {"Authorization": "Bearer s3cret"})) == (
        "bearer", admin)
    assert checker.identify(_request("GET", {"Cookie": f"{auth.COOKIE}={cookie}"})) == (
        "cookie", admin)
    for forged in ("s3cret", "admin.", f"admin.{'0' * 64}", f"bob.{cookie[6:]}",
                   cookie[:-1] + ("0" if cookie[-1] != "0" else "1")):
        assert checker.identify(_request("GET", {"Cookie": f"{auth.COOKIE}={forged}"})) is None
    # The cookie dies with its token: another book (the token removed) refuses it.
    assert auth.Auth(TokenBook.single("other")).from_cookie(cookie) is None


def test_the_store_check_sees_a_held_write_lock_and_names_no_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = JobStore(tmp_path / "state")
    assert store_writable(store.path) is None
    monkeypatch.setattr("jaxpod.service.http.backend.STORE_CHECK_TIMEOUT_S", 0.05)
    writer = sqlite3.connect(store.path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        problem = store_writable(store.path)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert problem is not None and "locked" in problem
    assert str(tmp_path) not in problem  # /readyz answers anyone: no server paths
    assert store_writable(store.path) is None


@pytest.mark.parametrize("jobs", [3, 200, 205])
def test_the_page_lists_the_newest_jobs_in_creation_order(tmp_path: Path, jobs: int
                                                          ) -> None:
    with JobStore(tmp_path) as store:
        ids = [store.create_job(steps=1, payload=b"", job_id=f"job-{i:03d}").id
               for i in range(jobs)]
        manager = JobManager(store, slices=None)  # type: ignore[arg-type]  # not run
        backend = Backend(SimpleNamespace(jobs=manager), lambda: "ready",  # type: ignore[arg-type]
                          lambda: [], lambda: True)
        listed = backend.job_list(None, 200, None)
        assert [j.id for j in listed.jobs] == ids[-200:]
        assert (listed.total, listed.offset) == (jobs, max(0, jobs - 200))
