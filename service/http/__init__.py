"""The HTTP side of ``jaxpod serve``: a JSON API, Prometheus metrics and a status page.

:func:`~jaxpod.service.http.app.create_app` builds the FastAPI app over a
:class:`~jaxpod.service.http.backend.Backend` (the running service's sessions, jobs and
cluster); :func:`~jaxpod.service.http.server.start_http` serves it with uvicorn on the
service's own event loop, beside gRPC. The app reads through the same functions as the
gRPC handlers (:mod:`jaxpod.service.api.jobs`), so both show a job alike.
"""
