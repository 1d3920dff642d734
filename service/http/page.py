"""The HTML side: the status page at ``/``, the sign-in form and the page's files.

The page is rendered here, whole, so its tables read without JavaScript; the small
script in ``static/dashboard.js`` then keeps it live (job states polled, the shown job
followed over its event stream, its charts redrawn). No build step, nothing fetched
from elsewhere: the script and style ship in the package.
"""

from __future__ import annotations

import html
import time
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from jaxpod.errors import JobNotFoundError
from jaxpod.service.http import auth, models
from jaxpod.service.http.routes import CHART_POINTS, BackendDep, backend

router = APIRouter(include_in_schema=False)
DASH = "\u2013"  # what an empty figure shows

#: The page's files, by name (nothing else under static/ is served).
STATIC_TYPES = {"dashboard.js": "text/javascript; charset=utf-8",
                "dashboard.css": "text/css; charset=utf-8"}
_HEADERS = {"Cache-Control": "no-store", "Content-Security-Policy":
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}
_ = backend  # the dependency BackendDep names


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


@router.get("/static/{name}")
def static(name: str) -> Response:
    kind = STATIC_TYPES.get(name)
    if kind is None:
        return Response("not found", status_code=404, media_type="text/plain")
    body = resources.files("jaxpod.service.http").joinpath("static", name).read_bytes()
    return Response(body, media_type=kind, headers={"Cache-Control": "no-cache",
                                                    "X-Content-Type-Options": "nosniff"})


# ---------------------------------------------------------------------- sign-in
@router.get("/login")
def login_form(request: Request, failed: Annotated[int, Query()] = 0) -> HTMLResponse:
    checker: auth.Auth = request.app.state.auth
    note = ("<p class=bad>That is not the service's token.</p>" if failed else "")
    if not checker.enabled:
        note = "<p>This service has no token: the dashboard is open (loopback only).</p>"
    body = f"""<!doctype html><html lang=en><head><meta charset=utf-8>
<meta name=viewport content="width=device-width, initial-scale=1">
<title>jaxpod: sign in</title></head>
<body class=login><main><h1>jaxpod</h1>{note}
<form method=post action="/login">
<label>Token <input type=password name=token autocomplete=current-password autofocus
 required></label> <button type=submit>Sign in</button></form>
<p class=hint>The token is the <code>JAXPOD_TOKEN</code> the service was started with.</p>
</main></body></html>"""
    return HTMLResponse(body, headers=_HEADERS)


@router.post("/login")
async def login(request: Request) -> Response:
    checker: auth.Auth = request.app.state.auth
    problem = auth.origin_problem(request, "cookie")
    if problem:
        return HTMLResponse(f"<p>Refused: {_e(problem)}.</p>", status_code=403)
    form = parse_qs((await request.body()).decode(errors="replace"))
    token = (form.get("token") or [""])[0]
    if not checker.enabled:
        return RedirectResponse("/", status_code=303)
    if not checker.token_matches(token):
        return RedirectResponse("/login?failed=1", status_code=303)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(auth.COOKIE, checker.cookie_value, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(auth.COOKIE, path="/")
    return response


# ---------------------------------------------------------------------- the page
@router.get("/", response_class=HTMLResponse)
async def index(backend: BackendDep,
                job: Annotated[str | None, Query(max_length=200)] = None) -> HTMLResponse:
    cluster, jobs = await run_in_threadpool(
        lambda: (backend.cluster(), backend.job_list(None, 200, 0)))
    shown = job or _pick(jobs.jobs)
    detail = None
    if shown:
        try:
            detail = await run_in_threadpool(backend.job_detail, shown, CHART_POINTS)
        except JobNotFoundError:
            detail = None
    return HTMLResponse(render(cluster, jobs, detail, shown), headers=_HEADERS)


def _pick(jobs: list[models.JobSummary]) -> str | None:
    """The job the page follows unless asked: the newest running one, else the newest."""
    running = [j for j in jobs if j.state == "RUNNING"]
    chosen = (running or jobs)[-1:] if jobs else []
    return chosen[0].id if chosen else None


def render(cluster: models.Cluster, jobs: models.JobList, detail: models.JobDetail | None,
           shown: str | None) -> str:
    missing = (f"<p class=bad>No job {_e(shown)}.</p>" if shown and detail is None else "")
    return f"""<!doctype html><html lang=en><head><meta charset=utf-8>
<meta name=viewport content="width=device-width, initial-scale=1">
<title>jaxpod</title><link rel=stylesheet href="/static/dashboard.css"></head>
<body data-job="{_e(detail.id if detail else '')}">
<header><h1>jaxpod</h1>
<span>cluster <b id=cluster-state class="st-{_e(cluster.state)}">{_e(cluster.state)}</b></span>
<span><b id=free-slices>{cluster.free_slices}</b> free, <b id=busy-slices>{cluster.busy_slices}</b>
 busy slices</span>
<span><b id=num-sessions>{cluster.num_sessions}</b> sessions</span>
<span class=muted>v{_e(cluster.server_version)} · <span id=updated>rendered
 {time.strftime('%H:%M:%S')}</span></span>
<form method=post action="/logout"><button type=submit>Sign out</button></form></header>
<main>
<section><h2>Slices and hosts</h2><div id=slices class=slices>{_slices(cluster)}</div></section>
<section><h2>Jobs</h2>{_jobs(jobs)}</section>
<section id=job-detail><h2>Job</h2>{missing}{_detail(detail) if detail else
    '<p class=muted>No job yet.</p>'}</section>
</main><script src="/static/dashboard.js" defer></script></body></html>"""


def _slices(cluster: models.Cluster) -> str:
    if not cluster.slices:
        return f"<p class=muted>No slices ({_e(cluster.state)}).</p>"
    out = []
    for s in cluster.slices:
        hosts = "".join(
            f"<div class=host title=\"host {h.worker_id} {_e(h.address)}\"><span>host "
            f"{h.worker_id}</span><span class=chips>"
            + "<i class=chip></i>" * h.chips + f"</span><small>{_e(h.address)}</small></div>"
            for h in s.hosts)
        problems = "".join(f"<p class=bad>{_e(p)}</p>" for p in s.problems)
        out.append(
            f"<div class=\"slice st-{_e(s.state)}\" data-slice=\"{_e(s.name)}\">"
            f"<div class=slice-head><b>{_e(s.name)}</b> <span>{_e(s.accelerator_type)} · "
            f"{_e(s.topology)} · {s.num_hosts}/{s.expected_hosts} hosts · {s.chips} chips"
            f"</span> <span class=state>{_e(s.state)}</span> <span class=holder>"
            f"{_e(s.holder or '')}</span></div><div class=hosts>{hosts}</div>{problems}</div>")
    return "".join(out)


def _num(value: float | None, digits: int = 2) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def _percent(share: float | None) -> str:
    return _num(None if share is None else 100 * share, 0)


def _when(at: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) if at else DASH


def _jobs(jobs: models.JobList) -> str:
    rows = "".join(
        f"<tr data-job-id=\"{_e(j.id)}\"><td><a href=\"/?job={_e(j.id)}\">{_e(j.id)}</a></td>"
        f"<td>{_e(j.name)}</td><td>{_e(j.accelerator_type)}</td>"
        f"<td class=\"state st-{_e(j.state)}\">{_e(j.state)}</td>"
        f"<td class=progress><progress max=\"{j.steps}\" value=\"{j.step}\"></progress> "
        f"<span class=step>{j.step}</span>/{j.steps}</td>"
        f"<td class=rate>{_num(j.steps_per_s, 1)}</td>"
        f"<td class=share>{_percent(j.productive_share)}</td>"
        f"<td>{j.attempts}</td><td>{_when(j.created_at)}</td></tr>"
        for j in reversed(jobs.jobs))
    empty = "<tr><td colspan=9 class=muted>No jobs.</td></tr>" if not jobs.jobs else ""
    return (f"<table id=jobs><thead><tr><th>id</th><th>name</th><th>type</th><th>state</th>"
            f"<th>progress</th><th title=\"steps per productive second (goodput)\">steps/s</th>"
            f"<th>goodput %</th><th>attempts</th>"
            f"<th>created</th></tr></thead><tbody>{rows}{empty}</tbody></table>")


def _detail(job: models.JobDetail) -> str:
    metric = "loss" if "loss" in job.series else next(iter(job.series), "loss")
    points = [(s, v) for s, v in job.series.get(metric, []) if v is not None]
    goodput = "".join(f"<tr><th>{_e(k)}</th><td>{_num(v, 3)}</td></tr>"
                      for k, v in job.goodput.items())
    history = "".join(f"<tr><td>{_when(t.at)}</td><td>{_e(t.from_state or '')}</td>"
                      f"<td>{_e(t.to_state)}</td><td>{_e(t.reason)}</td></tr>"
                      for t in job.history)
    attempts = "".join(f"<tr><td>{a.number}</td><td>{_when(a.started_at)}</td>"
                       f"<td>{_when(a.ended_at)}</td>"
                       f"<td>{DASH if a.step_reached is None else a.step_reached}</td>"
                       f"<td>{_e(a.cause or '')}</td></tr>" for a in job.attempt_records)
    hosts = "".join(f"<tr><td>{h.host}</td><td>{_num(h.input_wait_s, 3)}</td>"
                    f"<td>{h.input_queue_depth}</td></tr>" for h in job.hosts)
    error = f"<pre class=bad>{_e(job.error)}</pre>" if job.error else ""
    return f"""<p><b>{_e(job.name)}</b> ({_e(job.id)}) <span id=detail-state
 class="state st-{_e(job.state)}">{_e(job.state)}</span> step <span
 id=detail-step>{job.step}</span>/{job.steps}</p>{error}
<div class=charts>
<figure><figcaption>{_e(metric)} by step</figcaption>
{_chart("chart-loss", points, metric)}</figure>
<figure><figcaption>steps/s (live)</figcaption>{_chart("chart-rate", [], "steps/s")}</figure>
</div>
<div class=tables>
<table id=goodput><caption>goodput (s)</caption><tbody>{goodput or
    '<tr><td class=muted>none yet</td></tr>'}</tbody></table>
<table id=history><caption>history</caption><thead><tr><th>at</th><th>from</th><th>to</th>
<th>reason</th></tr></thead><tbody>{history}</tbody></table>
<table id=attempts><caption>attempts</caption><thead><tr><th>#</th><th>started</th><th>ended</th>
<th>step</th><th>cause</th></tr></thead><tbody>{attempts}</tbody></table>
<table id=hosts><caption>input per host (running attempt)</caption><thead><tr><th>host</th>
<th title="seconds its steps waited for input not ready yet">input wait (s)</th>
<th title="chunks of steps ready in its infeed">queue depth</th></tr></thead>
<tbody>{hosts}</tbody></table></div>"""


#: Chart size in SVG units (the script draws in the same box).
W, H, PAD = 480, 180, 28


def _chart(element_id: str, points: list[tuple[int, float]], metric: str) -> str:
    """An SVG line chart of ``points`` (drawn again by the script as points arrive)."""
    line = ""
    if points:
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        x0, x1 = min(xs), max(xs) or 1
        y0, y1 = min(ys), max(ys)
        def sx(x: float) -> float:
            return PAD + (x - x0) / ((x1 - x0) or 1) * (W - 2 * PAD)
        def sy(y: float) -> float:
            return H - PAD - (y - y0) / ((y1 - y0) or 1) * (H - 2 * PAD)
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
        line = (f"<polyline points=\"{line}\"/><text x=4 y=14>{y1:.4g}</text>"
                f"<text x=4 y={H - PAD + 4}>{y0:.4g}</text>"
                f"<text x={W - PAD} y={H - 6} text-anchor=end>{x1}</text>")
    return (f"<svg id={element_id} class=chart viewBox=\"0 0 {W} {H}\" role=img "
            f"aria-label=\"{_e(metric)}\" data-metric=\"{_e(metric)}\" "
            f"data-points=\"{len(points)}\">{line}</svg>")
