"""The HTML side: the status page at ``/``, the sign-in form and the page's files.

``/`` sends the page's frame with its first data embedded as JSON (the API's own
models: cluster, job list, the shown job's detail); the script in
``static/dashboard.js`` draws everything from data, that first time and on every
update (job list and cluster polled, the shown job followed over its event stream).
So the page is drawn in one place only. No build step, nothing fetched from elsewhere:
the script and style ship in the package.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from jaxpod.errors import JobNotFoundError
from jaxpod.service.http import auth, models
from jaxpod.service.http.routes import CHART_POINTS, BackendDep, backend

router = APIRouter(include_in_schema=False)

#: The page's files, by name (nothing else under static/ is served).
#: The page lists the newest jobs (the API pages through all of them).
JOBS_SHOWN = 200
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
    note = ("<p class=bad>That is none of the service's tokens.</p>" if failed else "")
    if not checker.enabled:
        note = "<p>This service has no token: the dashboard is open (loopback only).</p>"
    body = f"""<!doctype html><html lang=en><head><meta charset=utf-8>
<meta name=viewport content="width=device-width, initial-scale=1">
<title>jaxpod: sign in</title></head>
<body class=login><main><h1>jaxpod</h1>{note}
<form method=post action="/login">
<label>Token <input type=password name=token autocomplete=current-password autofocus
 required></label> <button type=submit>Sign in</button></form>
<p class=hint>Your token: the one <code>jaxpod token new</code> printed for you (or the
<code>JAXPOD_TOKEN</code> the service was started with).</p>
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
    who = checker.login(token)
    if who is None:
        return RedirectResponse("/login?failed=1", status_code=303)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(auth.COOKIE, checker.cookie_for(who), httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(auth.COOKIE, path="/")
    return response


# ---------------------------------------------------------------------- the page
class PageData(BaseModel):
    """What the page's script draws first: the answers it would fetch (so the page shows
    at once), the job asked for (``shown``; ``detail`` is null if there is none), and who
    is signed in (``caller``: the page offers only what its role may do)."""

    caller: models.Caller
    cluster: models.Cluster
    jobs: models.JobList
    detail: models.JobDetail | None
    shown: str | None


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, backend: BackendDep,
                job: Annotated[str | None, Query(max_length=200)] = None) -> HTMLResponse:
    cluster, jobs = await run_in_threadpool(
        lambda: (backend.cluster(), backend.job_list(None, JOBS_SHOWN, None)))
    shown = job or _pick(jobs.jobs)
    detail = None
    if shown:
        try:
            detail = await run_in_threadpool(backend.job_detail, shown, CHART_POINTS)
        except JobNotFoundError:
            detail = None
    data = PageData(caller=models.caller_of(request.state.principal), cluster=cluster,
                    jobs=jobs, detail=detail, shown=shown)
    return HTMLResponse(shell(data), headers=_HEADERS)


def _pick(jobs: list[models.JobSummary]) -> str | None:
    """The job the page follows unless asked: the newest running one, else the newest."""
    running = [j for j in jobs if j.state == "RUNNING"]
    chosen = (running or jobs)[-1:] if jobs else []
    return chosen[0].id if chosen else None


def embedded_json(model: BaseModel) -> str:
    """``model`` as JSON that is safe inside a ``<script>`` element: with every ``<``,
    ``>`` and ``&`` escaped (still the same JSON), no ``</script>`` or ``<!--`` in a
    value can end the element or change how the HTML parser reads it."""
    text = model.model_dump_json()  # as the API answers: NaN becomes null
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def shell(data: PageData) -> str:
    """The page: its frame, the data to draw, and the script that draws it."""
    job = data.detail.id if data.detail else ""
    return f"""<!doctype html><html lang=en><head><meta charset=utf-8>
<meta name=viewport content="width=device-width, initial-scale=1">
<title>jaxpod</title><link rel=stylesheet href="/static/dashboard.css"></head>
<body data-job="{_e(job)}">
<header><h1>jaxpod</h1>
<span>cluster <b id=cluster-state></b></span>
<span><b id=free-slices></b> free, <b id=busy-slices></b> busy slices</span>
<span><b id=num-sessions></b> sessions</span>
<span class=muted><span id=version></span> · <span id=updated></span></span>
<span>signed in as <b id=caller></b></span>
<form method=post action="/logout"><button type=submit>Sign out</button></form></header>
<main>
<noscript><p class=bad>This page is drawn by its script: allow JavaScript, or read
 <a href="/api/v1/cluster">/api/v1/cluster</a> and <a href="/api/v1/jobs">/api/v1/jobs</a>.
</p></noscript>
<section><h2>Slices and hosts</h2><div id=slices class=slices></div></section>
<section id=teams hidden><h2>Teams</h2><table><thead><tr><th>team</th><th>weight</th>
<th title="slices its jobs hold now">held</th>
<th title="the slices its weight gives it among the active teams">share</th>
<th title="slices held beyond its share">borrowed</th><th>queued</th></tr></thead>
<tbody></tbody></table></section>
<section><h2>Jobs</h2><table id=jobs><thead><tr><th>id</th><th>name</th><th>owner</th>
<th>priority</th><th>type</th>
<th>state</th><th title="place in its queue (1 is next); hover: what it waits for">queue</th>
<th>progress</th><th title="steps per wall-clock second">steps/s</th>
<th>goodput %</th><th>attempts</th>
<th>created</th></tr></thead><tbody></tbody></table></section>
<section id=job-detail><h2>Job</h2></section>
</main>
<script type="application/json" id=initial>{embedded_json(data)}</script>
<script src="/static/dashboard.js" defer></script></body></html>"""
