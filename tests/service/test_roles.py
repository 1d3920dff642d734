"""Named tokens and roles against a real ``jaxpod serve --local --tokens-file``.

The tokens file is written by ``jaxpod token new`` in fresh interpreters, as an admin
writes it. Then, table-driven over the whole service descriptor and the OpenAPI
document (so a method or route without a declared role fails here):

* every gRPC method and HTTP route, for each role, is refused (``PERMISSION_DENIED`` /
  403, naming the role it needs) exactly when DESIGN §9 says, and otherwise reaches
  its handler; an unknown token is ``UNAUTHENTICATED`` / 401;
* ownership (on one v4-16): a submitter cannot cancel, or read the result or logs of, another's job,
  nor use another's session; an admin can; jobs show their owner, and the page (in
  headless Chromium, signed in per token) offers the cancel button only to those the
  service would let cancel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from playwright.sync_api import expect, sync_playwright
from serve_process import PROCESSES, Service, chromium_path, running_service

import jaxpod
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.service.auth.roles import ROUTE_ROLES, RPC_ROLES
from jaxpod.service.auth.tokens import Role, TokenBook
from jaxpod.service.http.app import OPENAPI_PATH
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

METHODS = tuple(pb.DESCRIPTOR.services_by_name["Coordinator"].methods)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
#: name -> role; bob is a second submitter, to test ownership; quinn's quota is 1 slice.
HOLDERS = {"vera": "viewer", "alice": "submitter", "bob": "submitter", "root": "admin",
           "quinn": "submitter"}
QUOTAS = {"quinn": 1}
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def adding_step(state: Any, batch: Any) -> Any:
    """Adds the global batch's sum to the state (padding rows masked)."""
    ctx = jaxpod.get_replica_context()
    total = state["total"] + ctx.all_reduce(
        "SUM", (batch * ctx.valid_row_mask.astype(batch.dtype)[:, None]).sum())
    return {"total": total}, {"total": total}


def _new_token(tokens_file: Path, name: str, role: str) -> str:
    """``jaxpod token new`` in a fresh interpreter; the token is its stdout."""
    quota = ["--max-slices", str(QUOTAS[name])] if name in QUOTAS else []
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", "token", "new", name,
                           "--role", role, "--tokens-file", str(tokens_file), *quota],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert f"added {role} token {name!r}" in done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("roles")
    tokens_file = folder / "tokens.toml"
    issued = {name: _new_token(tokens_file, name, role) for name, role in HOLDERS.items()}
    text = tokens_file.read_text()
    assert not any(token in text for token in issued.values())  # only their hashes
    assert tokens_file.stat().st_mode & 0o077 == 0
    book = TokenBook.load(tokens_file)
    for name, token in issued.items():
        who = book.identify(token)
        assert who is not None and (who.name, str(who.role)) == (name, HOLDERS[name])
        assert who.max_slices == QUOTAS.get(name)
    return tokens_file, issued


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory,
            tokens: tuple[Path, dict[str, str]]) -> Iterator[Service]:
    folder = tmp_path_factory.mktemp("roles-service")
    with running_service(folder / "serve.log", "v4-16",
                         args=("--tokens-file", str(tokens[0]),
                               "--state-dir", str(folder / "state"), *PROCESSES)) as s:
        yield s


@pytest.fixture(scope="module")
def channel(service: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(service.address) as ch:
        yield ch


def _call(channel: grpc.Channel, method: Any, token: str | None) -> grpc.StatusCode:
    """Calls ``method`` with an empty request and returns the status it ended with."""
    path = f"/{SERVICE_NAME}/{method.name}"
    request = getattr(pb, method.input_type.name)()
    response = getattr(pb, method.output_type.name)
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    call = kind(path, request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response.FromString)
    arg = iter([request]) if method.client_streaming else request
    try:
        answer = call(arg, metadata=metadata, timeout=60)
        if method.server_streaming:
            list(answer)
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()
        if code is grpc.StatusCode.PERMISSION_DENIED:
            assert "role" in (e.details() or ""), e.details()
        return code
    return grpc.StatusCode.OK


def test_every_rpc_has_a_role_and_is_refused_exactly_below_it(
        channel: grpc.Channel, tokens: tuple[Path, dict[str, str]]) -> None:
    names = {m.name for m in METHODS}
    assert set(RPC_ROLES) == names, "every Coordinator method needs a role in RPC_ROLES"
    issued = tokens[1]
    refused: dict[str, list[str]] = {}
    for method in METHODS:
        assert _call(channel, method, None) is grpc.StatusCode.UNAUTHENTICATED
        assert _call(channel, method, "not-a-token") is grpc.StatusCode.UNAUTHENTICATED
        for name in ("vera", "alice", "root"):
            code = _call(channel, method, issued[name])
            allowed = Role.parse(HOLDERS[name]) >= RPC_ROLES[method.name]
            if allowed:
                assert code not in REFUSED, (method.name, name, code)
            else:
                assert code is grpc.StatusCode.PERMISSION_DENIED, (method.name, name, code)
                refused.setdefault(name, []).append(method.name)
    # What §9 says a viewer may not do, by name; a submitter only the audit log; an
    # admin nothing (ownership is the next test's).
    assert {"AcquireSlice", "Stream", "SubmitJob", "CancelJob", "GetJobResult",
            "GetJobLogs", "Put", "ListAudit"} <= set(refused["vera"])
    assert not {"ClusterStatus", "ListJobs", "GetJob", "WatchJob", "GetJobMetrics"} & set(
        refused["vera"])
    assert refused["alice"] == ["ListAudit"] and "root" not in refused


def _openapi_routes() -> set[tuple[str, str]]:
    document = json.loads(OPENAPI_PATH.read_text())
    return {(verb.upper(), path) for path, verbs in document["paths"].items()
            for verb in verbs}


def test_every_route_has_a_role_and_is_refused_exactly_below_it(
        service: Service, tokens: tuple[Path, dict[str, str]]) -> None:
    missing = _openapi_routes() - set(ROUTE_ROLES)
    assert not missing, f"routes without a role in ROUTE_ROLES: {sorted(missing)}"
    issued = tokens[1]
    # As the dashboard's page sends them: a state change carries its own Origin.
    with httpx.Client(base_url=service.http_url, timeout=60,
                      headers={"Origin": service.http_url}) as http:
        for (verb, template), needed in ROUTE_ROLES.items():
            if template.endswith("/events"):
                continue  # an event stream: its role is checked below, without reading it
            path = template.replace("{job_id}", "nojob").replace("{name}", "dashboard.js")
            anonymous = http.request(verb, path, follow_redirects=False)
            if needed is None:
                assert anonymous.status_code not in (401, 403), (verb, path)
                continue
            assert anonymous.status_code in (401, 303), (verb, path, anonymous.status_code)
            for name in ("vera", "alice", "root"):
                answer = http.request(verb, path, follow_redirects=False, headers={
                    "Authorization": f"Bearer {issued[name]}"})
                if Role.parse(HOLDERS[name]) >= needed:
                    assert answer.status_code not in (401, 403), (verb, path, name)
                else:
                    assert answer.status_code == 403, (verb, path, name, answer.text)
                    assert f"needs the {needed} role" in answer.json()["message"]
        events = http.get("/api/v1/jobs/nojob/events",
                          headers={"Authorization": f"Bearer {issued['vera']}"})
        assert events.status_code == 404  # reached the handler: an unknown job
        me = http.get("/api/v1/whoami", headers={"Authorization": f"Bearer {issued['bob']}"})
        assert me.json() == {"name": "bob", "role": "submitter", "max_slices": None}


def _cancel_on_the_page(service: Service, issued: dict[str, str], job_id: str) -> None:
    """Each holder signs in to the page showing ``job_id`` (alice's, not over): who may
    cancel, profile or read its stacks sees the buttons, the others do not; alice takes
    a profile and reads the stacks with hers and root cancels the job."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            for name in ("vera", "bob", "alice", "root"):
                page = browser.new_context().new_page()
                page.goto(f"{service.http_url}/login")
                page.fill("input[name=token]", issued[name])
                page.click("button[type=submit]")
                page.wait_for_url(f"{service.http_url}/")
                page.goto(f"{service.http_url}/?job={job_id}")
                expect(page.locator("#caller")).to_have_text(f"{name} ({HOLDERS[name]})")
                row = page.locator(f'#jobs tr[data-job-id="{job_id}"]')
                expect(row.locator("td.owner")).to_have_text("alice")
                expect(row.locator("td.priority")).to_have_text("0")
                button = page.locator("#cancel-job")
                if name in ("vera", "bob"):
                    expect(button).to_have_count(0)
                    expect(page.locator("#profile-job")).to_have_count(0)
                    expect(page.locator("#stacks-job")).to_have_count(0)
                else:
                    expect(button).to_be_visible()
                if name == "alice":  # her job's profile: a trace file per host, listed
                    expect(page.locator("#detail-state")).to_have_text("RUNNING",
                                                                       timeout=60_000)
                    page.locator("#profile-job").click()
                    expect(page.locator("#profiles tbody tr td").nth(2)).to_have_text(
                        "2", timeout=120_000)
                    # and every host's stacks, read now (its two hosts, their threads)
                    page.locator("#stacks-job").click()
                    stacks = page.locator("#detail-stacks")
                    expect(stacks).to_contain_text("== host 1", timeout=60_000)
                    shown = stacks.inner_text()
                    assert shown.count("== host ") == 2 and "most recent call last" in shown
                if name == "root":
                    button.click()
                    expect(page.locator("#detail-state")).to_have_text("CANCELLED",
                                                                       timeout=60_000)
                    expect(button).to_be_hidden()
                page.context.close()
        finally:
            browser.close()


def test_jobs_and_sessions_belong_to_their_owner(
        service: Service, tokens: tuple[Path, dict[str, str]]) -> None:
    issued = tokens[1]
    batches = [np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + i for i in range(3)]
    expected = float(sum(b.sum() for b in batches))
    with (jaxpod.connect(service.address, token=issued["alice"]) as alice,
          jaxpod.connect(service.address, token=issued["bob"]) as bob,
          jaxpod.connect(service.address, token=issued["root"]) as root,
          jaxpod.connect(service.address, token=issued["vera"]) as vera):
        job = alice.submit(adding_step, steps=3, accelerator_type="v4-16", dataset=batches,
                           initial_state={"total": np.float32(0)}, outputs={"total": "SUM"})
        final = job.wait(timeout=300, progress=False)
        assert final.state == "SUCCEEDED", final.error
        assert final.owner == "alice"
        assert [s.owner for s in vera.jobs() if s.id == job.id] == ["alice"]
        assert float(job.result().state["total"]) == pytest.approx(expected)

        theirs = bob.job(job.id)
        for what, act in (("cancel", theirs.cancel), ("GetJobResult", theirs.result),
                          ("GetJobLogs", theirs.logs),
                          ("profile", lambda: theirs.profile(1))):
            with pytest.raises(jaxpod.PermissionDeniedError,
                               match=f"{what}: job {job.id} belongs to 'alice'"):
                act()
        with pytest.raises(jaxpod.PermissionDeniedError, match="submitter role"):
            vera.job(job.id).cancel()
        assert float(root.job(job.id).result().state["total"]) == pytest.approx(expected)

        # An admin cancels anyone's job, here with the page's button, which the page
        # offers only to those the service would let cancel it; the reason names who.
        long_job = alice.submit(adding_step, steps=10**6, accelerator_type="v4-16",
                                dataset=batches, initial_state={"total": np.float32(0)})
        with pytest.raises(jaxpod.PermissionDeniedError):
            bob.job(long_job.id).cancel()
        _cancel_on_the_page(service, issued, long_job.id)
        cancelled = long_job.wait(timeout=300, progress=False)
        assert cancelled.state == "CANCELLED" and "root" in (cancelled.error or "")
        assert root.job(long_job.id).status().state == "CANCELLED"

        # A session's handles are its owner's: bob cannot name alice's session.
        session = alice.session_id
        with grpc.insecure_channel(service.address) as ch:
            heartbeat = ch.unary_unary(f"/{SERVICE_NAME}/Heartbeat",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=pb.HeartbeatResponse.FromString)
            with pytest.raises(grpc.RpcError) as refused:
                heartbeat(pb.SessionRequest(session_id=session),
                          metadata=(("authorization", f"Bearer {issued['bob']}"),))
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "opened by another token" in (refused.value.details() or "")
            reply = heartbeat(pb.SessionRequest(session_id=session),
                              metadata=(("authorization", f"Bearer {issued['alice']}"),))
            assert reply.lease_s > 0


def test_the_audit_log_records_submissions_cancels_and_refusals(
        service: Service, tokens: tuple[Path, dict[str, str]]) -> None:
    issued = tokens[1]
    started = time.time()
    batches = [np.ones((8, 3), np.float32)]
    with (jaxpod.connect(service.address, token=issued["alice"]) as alice,
          jaxpod.connect(service.address, token=issued["bob"]) as bob,
          jaxpod.connect(service.address, token=issued["vera"]) as vera,
          jaxpod.connect(service.address, token=issued["root"]) as root):
        job = alice.submit(adding_step, steps=1, accelerator_type="v4-16", dataset=batches,
                           initial_state={"total": np.float32(0)}, name="audited")
        assert job.wait(timeout=300, progress=False).state == "SUCCEEDED"
        with pytest.raises(jaxpod.PermissionDeniedError):
            bob.job(job.id).cancel()
        with pytest.raises(jaxpod.PermissionDeniedError, match="ListAudit needs the admin"):
            vera.audit()
        root.job(job.id).cancel()  # over already: recorded all the same
        records = root.audit(limit=1000)
    mine = [r for r in records if r.at >= started - 1]
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    assert all(started - 1 <= r.at <= time.time() for r in mine)
    actions = {(r.who, r.action, r.target) for r in mine}
    assert ("alice", "submit", job.id) in actions
    assert any((r.who, r.action, r.target) == ("bob", "refused", "CancelJob")
               and f"job {job.id} belongs to 'alice'" in r.detail for r in mine)
    assert ("vera", "refused", "ListAudit") in actions
    assert ("root", "cancel", job.id) in actions

    # The same log through the CLI (a fresh interpreter) and the HTTP API.
    env = {**os.environ, "JAXPOD_TOKEN": issued["root"], "JAXPOD_ADDRESS": service.address}
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", "audit", "--json",
                           "--limit", "1000"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert [r["seq"] for r in json.loads(done.stdout)] == [r.seq for r in records]
    with httpx.Client(base_url=service.http_url, timeout=60) as http:
        answer = http.get("/api/v1/audit", params={"limit": 1000},
                          headers={"Authorization": f"Bearer {issued['root']}"})
        assert answer.status_code == 200, answer.text
        assert [r["seq"] for r in answer.json()["records"]] == [r.seq for r in records]
        refused = http.get("/api/v1/audit",
                           headers={"Authorization": f"Bearer {issued['alice']}"})
        assert refused.status_code == 403 and "admin role" in refused.json()["message"]


def test_a_quota_refuses_a_strategy_and_holds_a_job_back_with_the_reason(
        service: Service, tokens: tuple[Path, dict[str, str]]) -> None:
    batches = [np.full((8, 3), 2.0, np.float32)]
    with jaxpod.connect(service.address, token=tokens[1]["quinn"]) as quinn:
        strategy = quinn.strategy("v4-16")  # quinn's one slice
        with pytest.raises(jaxpod.QuotaExceededError,
                           match="'quinn' holds 1 slice\\(s\\) of its max_slices 1"):
            quinn.strategy("v4-16")
        with pytest.raises(jaxpod.QuotaExceededError, match="could never run"):
            quinn.submit(adding_step, steps=2, accelerator_type="v4-16", num_slices=2,
                         dataset=batches, initial_state={"total": np.float32(0)})
        job = quinn.submit(adding_step, steps=2, accelerator_type="v4-16", dataset=batches,
                           initial_state={"total": np.float32(0)})
        assert wait_for(lambda: "over quota" in (job.status().wait_reason or ""), 60), (
            job.status())
        waiting = job.status()
        assert waiting.state == "PENDING" and "max_slices 1" in (waiting.wait_reason or "")
        # The strategy still computes; closing it makes room and the job runs.
        assert float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)) == (
            strategy.num_replicas_in_sync)
        strategy.close()
        final = job.wait(timeout=300, progress=False)
        assert final.state == "SUCCEEDED" and final.wait_reason is None
        assert float(job.result().state["total"]) == pytest.approx(2 * batches[0].sum())
