"""The FastAPI app: routers, the token check, error answers and the page.

:func:`create_app` builds it apart from serving it (tests, the OpenAPI document and the
drift check build one without a service behind it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

import jaxpod
from jaxpod.errors import JobNotFoundError, JobNotRunningError, PermissionDeniedError
from jaxpod.service.auth.roles import ROUTE_ROLES
from jaxpod.service.auth.tokens import TokenBook, denial
from jaxpod.service.http import auth, page, routes
from jaxpod.service.http.auth import Auth
from jaxpod.service.http.backend import Backend, NoJobsError

#: Where the committed OpenAPI document lives (a test fails when it drifts).
OPENAPI_PATH = Path(__file__).resolve().parent / "openapi.json"


class Unauthorized(Exception):
    """No valid token or cookie (answered 401, or a redirect to the sign-in form)."""


class Forbidden(Exception):
    """A role too low for the route, or a state change from another origin (answered
    403); the message says which and what to do."""


async def check_access(request: Request) -> None:
    """The dependency every route has: who the caller is (:mod:`.auth`) and whether its
    role allows the route (:data:`~jaxpod.service.auth.roles.ROUTE_ROLES`); the caller is
    left in ``request.state.principal``. A coroutine, as it never blocks: FastAPI runs a
    plain ``def`` dependency in its thread pool, a thread hand-off per request that cost
    more than the rest of a cached answer."""
    checker: Auth = request.app.state.auth
    method = "GET" if request.method == "HEAD" else request.method
    template = getattr(request.scope.get("route"), "path", request.url.path)
    if (method, template) not in ROUTE_ROLES:
        raise Forbidden(f"{method} {template} has no role in this service's role table, "
                        "so no token may call it")
    needed = ROUTE_ROLES[(method, template)]
    if needed is None:
        return
    found = checker.identify(request)
    if found is None:
        raise Unauthorized()
    how, who = found
    problem = auth.origin_problem(request, how)
    if problem:
        raise Forbidden(f"Refused: {problem}. Use the dashboard's own page, or a bearer "
                        "token from a non-browser client")
    if not who.may(needed):
        refusal = denial(who, needed, f"{method} {template}")
        await _audit_refusal(request, who.name, f"{method} {template}", refusal)
        raise Forbidden(refusal)
    request.state.principal = who


async def _audit_refusal(request: Request, who: str, target: str, why: str) -> None:
    backend: Backend | None = request.app.state.backend
    if backend is not None:  # it never raises: the refusal stands
        await run_in_threadpool(backend.service.audit, who, "refused", target, why)


def create_app(backend: Backend | None, tokens: TokenBook | None = None) -> FastAPI:
    """The dashboard app over ``backend`` (``None``: routes that read it fail; for the
    OpenAPI document), guarded by ``tokens`` (``None``: open)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The service's resources (store, cluster) belong to `jaxpod serve`; what the
        # app holds of its own is the stop signal for open event streams.
        try:
            yield
        finally:
            if backend is not None:
                backend.stopping.set()

    app = FastAPI(title="jaxpod", version=jaxpod.__version__,
                  description="The jaxpod coordinator's status API: cluster, sessions and "
                              "jobs. Every route but /healthz and /readyz needs "
                              "`Authorization: Bearer <token>` (or the cookie of the /login "
                              "form) when the service has tokens: reads need the viewer "
                              "role, cancelling a job the submitter role (its own jobs) "
                              "or admin.",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(check_access)])
    app.state.backend = backend
    app.state.auth = Auth(tokens)
    app.state.recent = routes.Recent()
    if backend is not None and backend.metrics is not None:
        from jaxpod.service.http.metrics import HttpTimer

        app.add_middleware(HttpTimer, histogram=backend.metrics.http_seconds)
    for router in (routes.health, routes.cluster, routes.sessions, routes.jobs,
                   routes.metrics, page.router):
        app.include_router(router)

    @app.get("/api/v1/openapi.json", include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized) -> Response:
        if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/login", status_code=303)
        return _error(401, "unauthorized",
                      "This jaxpod service requires a token: send `Authorization: Bearer "
                      "<token>` (your JAXPOD_TOKEN), or sign in at /login in a browser.",
                      {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(Forbidden)
    async def forbidden(request: Request, exc: Forbidden) -> Response:
        return _error(403, "forbidden", f"{exc}.")

    @app.exception_handler(PermissionDeniedError)
    async def not_owner(request: Request, exc: PermissionDeniedError) -> Response:
        who = getattr(request.state, "principal", None)
        if who is not None:
            await _audit_refusal(request, who.name, f"{request.method} {request.url.path}",
                                 str(exc))
        return _error(403, "forbidden", str(exc))

    @app.exception_handler(JobNotFoundError)
    async def not_found(request: Request, exc: JobNotFoundError) -> Response:
        return _error(404, "not_found", f"{exc} (GET /api/v1/jobs lists them.)")

    @app.exception_handler(JobNotRunningError)
    async def not_running(request: Request, exc: JobNotRunningError) -> Response:
        return _error(409, "not_running", str(exc))

    @app.exception_handler(NoJobsError)
    async def no_jobs(request: Request, exc: NoJobsError) -> Response:
        return _error(404, "not_found", str(exc))

    return app


def _error(status: int, kind: str, message: str,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message}, status_code=status,
                        headers=headers)


def openapi_document() -> str:
    """The app's OpenAPI document as committed (sorted keys, a newline at the end)."""
    return json.dumps(create_app(None).openapi(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    """``python -m jaxpod.service.http.app``: writes ``service/http/openapi.json``."""
    OPENAPI_PATH.write_text(openapi_document())
    print(f"wrote {OPENAPI_PATH}")


if __name__ == "__main__":
    main()
