"""The HTTP API of a real ``jaxpod serve --local``: every route, the token and the
cookie, cancel through HTTP seen by the SDK, the event stream, ``/metrics`` against
``/api/v1/jobs``, ``jaxpod status``, and the committed OpenAPI document."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from dashboard_jobs import submit
from prometheus_client.parser import text_string_to_metric_families
from serve_process import Service

from jaxpod.cli import main
from jaxpod.proto.tensors import holder_label
from jaxpod.service.http.app import OPENAPI_PATH, openapi_document
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

PROTECTED_GETS = ("/api/v1/cluster", "/api/v1/sessions", "/api/v1/jobs",
                  "/api/v1/jobs/x", "/api/v1/jobs/x/events", "/metrics", "/",
                  "/static/dashboard.js", "/api/v1/openapi.json")


@pytest.fixture(scope="module")
def api(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.http_url, timeout=60,
                      headers={"Authorization": f"Bearer {service.token}"}) as client:
        yield client


@pytest.fixture(scope="module")
def anonymous(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.http_url, timeout=60) as client:
        yield client


def test_probes_are_open_and_ready(anonymous: httpx.Client) -> None:
    assert anonymous.get("/healthz").json() == {"status": "ok"}
    ready = anonymous.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"ready": True, "checks": {"ray": True, "grpc": True,
                                                      "store": True}, "reasons": {}}


def test_every_other_route_needs_the_token(service: Service, anonymous: httpx.Client
                                           ) -> None:
    for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": service.token},
                {"Cookie": "jaxpod_session=" + service.token}):
        for path in PROTECTED_GETS:
            reply = anonymous.get(path, headers={**bad, "Accept": "application/json"})
            assert reply.status_code == 401, (path, bad, reply.text)
            assert reply.json()["error"] == "unauthorized"
            assert reply.headers["www-authenticate"] == "Bearer"
        reply = anonymous.post("/api/v1/jobs/x/cancel", headers=bad)
        assert reply.status_code == 401, reply.text
    # A browser asking for the page is sent to the sign-in form instead.
    page = anonymous.get("/", headers={"Accept": "text/html"})
    assert page.status_code == 303 and page.headers["location"] == "/login"


def test_unknown_job_is_a_404_with_a_json_error(api: httpx.Client) -> None:
    for reply in (api.get("/api/v1/jobs/no-such-job"),
                  api.get("/api/v1/jobs/no-such-job/events"),
                  api.post("/api/v1/jobs/no-such-job/cancel")):
        assert reply.status_code == 404, reply.text
        body = reply.json()
        assert body["error"] == "not_found"
        assert "no-such-job" in body["message"]
        assert ".sqlite" not in body["message"]  # the server's paths stay there


def test_cluster_and_sessions_show_who_holds_a_slice(client: Any, api: httpx.Client
                                                     ) -> None:
    cluster = api.get("/api/v1/cluster").json()
    assert cluster["state"] == "ready"
    (only,) = cluster["slices"]
    assert only["accelerator_type"] == "v4-8" and only["state"] == "free"
    assert [h["chips"] for h in only["hosts"]] == [4] and only["chips"] == 4
    def slice_state(wanted: str) -> Any:
        # Cluster answers may be up to JAXPOD_HTTP_CACHE_S old.
        answer = api.get("/api/v1/cluster").json()
        return answer if answer["slices"][0]["state"] == wanted else None

    with client.strategy("v4-8"):
        held = wait_for(lambda: slice_state("busy"), 10)
        assert held, api.get("/api/v1/cluster").json()
        label = holder_label(client.session_id)
        assert held["slices"][0]["state"] == "busy"
        assert held["slices"][0]["holder"] == label
        assert held["busy_slices"] == 1 and held["num_sessions"] >= 1
        sessions = api.get("/api/v1/sessions").json()["sessions"]
        mine = [s for s in sessions if s["label"] == label]
        assert mine and mine[0]["slices"][0]["slice_names"] == [only["name"]]
        assert client.session_id not in json.dumps(sessions)  # the id authorizes calls
    assert wait_for(lambda: slice_state("free"), 10), api.get("/api/v1/cluster").json()


def test_a_job_through_the_api_and_its_event_stream(client: Any, api: httpx.Client
                                                    ) -> None:
    job = submit(client, steps=20, steps_per_run=5, name="api-job")
    states, points, ended = [], [], False
    with api.stream("GET", f"/api/v1/jobs/{job.id}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                if event == "status":
                    states.append(data["state"])
                elif event == "metrics":
                    points += data["series"]["loss"]
                elif event == "end":
                    ended = True
                    break
    assert ended and states[-1] == "SUCCEEDED", states
    assert [step for step, _ in points] == [5, 10, 15, 20]  # each point once, in order

    detail = api.get(f"/api/v1/jobs/{job.id}").json()
    assert detail["state"] == "SUCCEEDED" and detail["step"] == 20
    assert [t["to_state"] for t in detail["history"]] == [
        "PENDING", "ALLOCATING", "RUNNING", "SUCCEEDED"]
    assert detail["attempt_records"][0]["cause"] == "succeeded"
    assert detail["series"]["loss"] == points
    thinned = api.get(f"/api/v1/jobs/{job.id}", params={"points": 2}).json()["series"]
    assert thinned["loss"] == [points[0], points[-1]]  # the first and the last kept
    assert api.get(f"/api/v1/jobs/{job.id}", params={"points": -1}).status_code == 422
    assert detail["metrics"]["loss"] == pytest.approx(points[-1][1])
    assert detail["goodput"]["wall_s"] == pytest.approx(
        detail["finished_at"] - detail["created_at"], abs=0.05)
    assert detail["steps_per_s"] > 0 and 0 < detail["productive_share"] <= 1
    sdk = job.status()
    assert (sdk.state, sdk.step, sdk.metrics) == ("SUCCEEDED", 20, detail["metrics"])

    listed = api.get("/api/v1/jobs", params={"state": "SUCCEEDED"}).json()
    assert job.id in [j["id"] for j in listed["jobs"]]
    assert {j["state"] for j in listed["jobs"]} == {"SUCCEEDED"}
    everything = api.get("/api/v1/jobs", params={"limit": 1000}).json()
    pages = [api.get("/api/v1/jobs", params={"limit": 1, "offset": i}).json()
             for i in range(everything["total"])]
    assert [p["jobs"][0]["id"] for p in pages] == [j["id"] for j in everything["jobs"]]
    assert all(p["total"] == everything["total"] for p in pages)
    assert api.get("/api/v1/jobs", params={"state": "bogus"}).status_code == 422


def test_cancel_through_http_is_seen_by_the_sdk(service: Service, client: Any,
                                                api: httpx.Client) -> None:
    job = submit(client, steps=100_000, steps_per_run=1, paced=True, name="to-cancel")
    assert wait_for(lambda: job.status().step >= 2, 120), job.status()
    # A cross-origin request is refused, even with the token.
    evil = api.post(f"/api/v1/jobs/{job.id}/cancel",
                    headers={"Origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"] == "forbidden"
    assert job.status().state == "RUNNING"

    reply = api.post(f"/api/v1/jobs/{job.id}/cancel")
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "CANCELLED"
    status = job.status()
    assert status.state == "CANCELLED" and "cancelled" in (status.error or "")
    assert 0 < status.step < 100_000


def test_the_job_list_reflects_a_submit_and_a_cancel_at_once(client: Any,
                                                              api: httpx.Client) -> None:
    def listed(job_id: str) -> dict[str, Any] | None:
        reply = api.get("/api/v1/jobs", params={"limit": 1000})
        assert reply.status_code == 200, reply.text
        return next((j for j in reply.json()["jobs"] if j["id"] == job_id), None)

    listed("none")  # the list is cached now
    for round_ in range(20):  # in a row: a cache that lags shows within a few rounds
        job = submit(client, steps=100_000, steps_per_run=1, paced=True,
                     name=f"read-your-writes-{round_}")
        seen = listed(job.id)
        assert seen is not None and seen["state"] in ("PENDING", "ALLOCATING", "RUNNING")
        reply = api.post(f"/api/v1/jobs/{job.id}/cancel")
        assert reply.status_code == 200 and reply.json()["state"] == "CANCELLED", reply.text
        seen = listed(job.id)
        assert seen is not None and seen["state"] == "CANCELLED", (round_, seen)


def test_sign_in_sets_a_strict_http_only_cookie(service: Service,
                                                anonymous: httpx.Client) -> None:
    same_origin = {"Origin": service.http_url}
    wrong = anonymous.post("/login", data={"token": "nope"}, headers=same_origin)
    assert wrong.status_code == 303 and wrong.headers["location"] == "/login?failed=1"
    assert "set-cookie" not in wrong.headers
    right = anonymous.post("/login", data={"token": service.token}, headers=same_origin)
    assert right.status_code == 303 and right.headers["location"] == "/"
    cookie = right.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert service.token not in cookie  # it holds a digest of the token
    value = right.cookies["jaxpod_session"]
    with httpx.Client(base_url=service.http_url, timeout=60,
                      cookies={"jaxpod_session": value}) as browser:
        assert browser.get("/api/v1/jobs").status_code == 200
        page = browser.get("/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and "<table id=jobs>" in page.text
        # State changes signed in by cookie need the dashboard's own origin.
        assert browser.post("/api/v1/jobs/x/cancel").status_code == 403
        assert browser.post("/api/v1/jobs/x/cancel",
                            headers={"Origin": "http://evil.example"}).status_code == 403
        assert browser.post("/api/v1/jobs/x/cancel", headers=same_origin).status_code == 404
    assert anonymous.post("/login", data={"token": service.token},
                          headers={"Origin": "http://evil.example"}).status_code == 403


def _first_event(api: httpx.Client, job_id: str, kind: str) -> Any:
    """The data of the first ``kind`` event of the job's event stream."""
    with api.stream("GET", f"/api/v1/jobs/{job_id}/events") as stream:
        event = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: ") and event == kind:
                return json.loads(line[len("data: "):])
    raise AssertionError(f"the event stream of job {job_id} ended without a {kind} event")


def test_metrics_parse_and_match_the_job_list(client: Any, api: httpx.Client) -> None:
    running = submit(client, steps=100_000, steps_per_run=1, paced=True, name="metered")
    try:
        assert wait_for(lambda: running.status().step >= 3, 120), running.status()

        def scraped() -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
            reply = api.get("/metrics")
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/plain")
            families = {f.name: f for f in text_string_to_metric_families(reply.text)}
            counted = {s.labels["state"]: int(s.value) for s in families["jaxpod_jobs"].samples}
            expected: dict[str, int] = {}
            for j in api.get("/api/v1/jobs", params={"limit": 1000}).json()["jobs"]:
                expected[j["state"]] = expected.get(j["state"], 0) + 1
            return families, {k: v for k, v in counted.items() if v}, expected

        def listed(families: dict[str, Any]) -> float:
            """Requests of /api/v1/jobs the HTTP histogram counted (each scrape makes
            one after reading /metrics)."""
            return sum(s.value for s in families["jaxpod_http_request_duration_seconds"].samples
                       if s.name.endswith("_count") and s.labels["route"] == "/api/v1/jobs")

        # The job list may be up to JAXPOD_HTTP_CACHE_S (plus a read) old: the two agree
        # once it caught up; and the histogram has counted a listing by a later scrape.
        agreed = wait_for(lambda: (got := scraped())[1] == got[2] and listed(got[0]) >= 1
                          and got, 10)
        assert agreed, scraped()[1:]
        families, _, expected = agreed
        hosts_event = _first_event(api, running.id, "hosts")
    finally:
        running.cancel()
    assert expected.get("RUNNING") == 1
    # The event stream tells the running job's one host's input feed.
    assert [h["host"] for h in hosts_event["hosts"]] == [0]
    assert hosts_event["hosts"][0]["input_wait_s"] >= 0

    def per_job(name: str) -> dict[str, float]:
        return {s.labels["job_id"]: s.value for s in families[name].samples}

    assert per_job("jaxpod_job_step")[running.id] >= 3
    assert per_job("jaxpod_job_steps_per_second")[running.id] > 0
    assert 0 < per_job("jaxpod_job_goodput_ratio")[running.id] <= 1
    assert running.id in per_job("jaxpod_job_compile_seconds")
    assert running.id in per_job("jaxpod_job_input_wait_seconds")
    hosts = {(s.labels["job_id"], s.labels["host"]): s.value
             for s in families["jaxpod_host_input_queue_depth"].samples}
    assert list(hosts) == [(running.id, "0")] and 0 <= hosts[(running.id, "0")] <= 2
    waits = [s for s in families["jaxpod_host_input_wait_seconds"].samples
             if s.labels["job_id"] == running.id]
    assert [s.labels["host"] for s in waits] == ["0"] and waits[0].value >= 0
    slices = {(s.labels["state"], s.labels["accelerator_type"]): s.value
              for s in families["jaxpod_slices"].samples}
    assert slices == {("busy", "v4-8"): 1.0}
    submitted = [s for s in families["jaxpod_rpc_duration_seconds"].samples
                 if s.name.endswith("_count") and s.labels["method"] == "SubmitJob"]
    assert submitted and submitted[0].value >= 1
    assert listed(families) >= 1


def test_jaxpod_status_prints_slices_and_jobs(service: Service, client: Any,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JAXPOD_TOKEN", service.token)
    monkeypatch.setenv("COLUMNS", "200")
    recent = client.jobs()[-3:]
    assert main(["status", "--address", service.address]) == 0
    out = capsys.readouterr().out
    assert "slices" in out and "v4-8" in out and "jobs" in out
    for job in recent:
        assert job.id in out and job.state in out
    assert main(["status", "--json", "--address", service.address]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [s["accelerator_type"] for s in summary["slices"]] == ["v4-8"]
    assert {j["id"] for j in summary["jobs"]} >= {j.id for j in recent}


def test_the_page_shows_the_steps_per_wall_clock_second_the_client_sees(
        client: Any, api: httpx.Client) -> None:
    """The steps/s the page renders (the API's ``steps_per_s``) is steps per wall-clock
    second, as a client watching the job counts them over the service's rate window:
    within 10 % mid-run, once that window has moved past the attempt's start (until
    then it averages in the start-up). Not compared with the progress bar's own rate:
    tqdm weights the last few updates, which swing by more than 10 % on a busy
    machine; the bar is shown and must count the steps watched."""
    from jaxpod.client.jobs import _ProgressBar
    from jaxpod.service.jobs.runner import RATE_WINDOW

    window = RATE_WINDOW.seconds()
    # Long enough for any machine; cancelled once compared.
    job = submit(client, steps=5000, steps_per_run=2, paced=True, name="rate")
    bar = _ProgressBar(job)
    seen: list[tuple[float, int]] = []  # (when the client received it, step)
    compared = None
    try:
        for status in job.watch():
            bar.show(status)
            assert bar._bar.n == status.step
            if status.state != "RUNNING":
                continue
            now = time.monotonic()
            seen.append((now, status.step))
            if now - seen[0][0] > window + 2:
                shown = api.get(f"/api/v1/jobs/{job.id}").json()["steps_per_s"]
                t0, s0 = next(s for s in seen if s[0] >= now - window)
                counted = (status.step - s0) / (now - t0)
                compared = (counted, shown, status.steps_per_s)
                break
    finally:
        bar.close()
        job.cancel()
    assert compared is not None, "the job ended before its rate window had moved on"
    counted, shown, streamed = compared
    assert shown == pytest.approx(counted, rel=0.10), compared
    assert streamed == pytest.approx(counted, rel=0.10), compared
    # Not the productive rate, which leaves the paced host work out.
    summary = api.get(f"/api/v1/jobs/{job.id}").json()
    assert summary["steps_per_productive_s"] is None or \
        summary["steps_per_productive_s"] >= summary["steps_per_s"]


def test_the_committed_openapi_document_is_current() -> None:
    assert OPENAPI_PATH.read_text() == openapi_document(), (
        "service/http/openapi.json is out of date with the HTTP API; regenerate it with "
        "`python -m jaxpod.service.http.app` and commit the result.")
