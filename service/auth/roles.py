"""The role each gRPC method and HTTP route needs: one table, checked in one place.

The gRPC interceptor (:mod:`jaxpod.service.api.server`) and the HTTP dependency
(:mod:`jaxpod.service.http.app`) look calls up here before any handler runs; a method
or route missing from the table is refused, so a new one cannot ship without a role.
Ownership (a submitter acts only on its own jobs and sessions) is the handlers' second
check, on the objects they look up.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from jaxpod.service.auth.tokens import Role

_VIEWER, _SUBMITTER = Role.VIEWER, Role.SUBMITTER

#: ``Coordinator`` methods by name. A session alone holds nothing, so viewers open
#: them (the CLI's status and job listings run in one); what fills a session, slices
#: and the values on them, needs a submitter.
RPC_ROLES: Mapping[str, Role] = MappingProxyType({
    "OpenSession": _VIEWER, "Heartbeat": _VIEWER, "CloseSession": _VIEWER,
    "ClusterStatus": _VIEWER,
    "ListJobs": _VIEWER, "GetJob": _VIEWER, "WatchJob": _VIEWER, "GetJobMetrics": _VIEWER,
    "AcquireSlice": _SUBMITTER, "ReleaseSlice": _SUBMITTER, "DefineFunction": _SUBMITTER,
    "Put": _SUBMITTER, "DistributeDataset": _SUBMITTER, "CreateIterator": _SUBMITTER,
    "Stream": _SUBMITTER, "Reduce": _SUBMITTER, "Gather": _SUBMITTER,
    "LocalResults": _SUBMITTER, "Fetch": _SUBMITTER, "Free": _SUBMITTER,
    "SliceStats": _SUBMITTER, "ProfileSlice": _SUBMITTER,
    # Of its own jobs only (an admin: anyone's), checked on the job.
    "SubmitJob": _SUBMITTER, "CancelJob": _SUBMITTER, "GetJobResult": _SUBMITTER,
    "GetJobLogs": _SUBMITTER, "ProfileJob": _SUBMITTER, "GetJobStacks": _SUBMITTER,
    "PinJob": _SUBMITTER, "SuspendJob": _SUBMITTER, "ResumeJob": _SUBMITTER,
    "ForkJob": _SUBMITTER,
    "ListAudit": Role.ADMIN,
})

#: gRPC services open to anyone: probes and reflection carry no data.
OPEN_SERVICES = ("/grpc.health.", "/grpc.reflection.")

#: HTTP routes by (method, path template); ``None``: open to anyone (the probes and the
#: sign-in form, which loads nothing else).
ROUTE_ROLES: Mapping[tuple[str, str], Role | None] = MappingProxyType({
    ("GET", "/healthz"): None, ("GET", "/readyz"): None,
    ("GET", "/login"): None, ("POST", "/login"): None, ("POST", "/logout"): None,
    ("GET", "/"): _VIEWER, ("GET", "/static/{name}"): _VIEWER, ("GET", "/api/v1/whoami"): _VIEWER,
    ("GET", "/api/v1/openapi.json"): _VIEWER, ("GET", "/metrics"): _VIEWER,
    ("GET", "/api/v1/cluster"): _VIEWER, ("GET", "/api/v1/sessions"): _VIEWER,
    ("GET", "/api/v1/jobs"): _VIEWER, ("GET", "/api/v1/jobs/{job_id}"): _VIEWER,
    ("GET", "/api/v1/jobs/{job_id}/events"): _VIEWER,
    ("POST", "/api/v1/jobs/{job_id}/cancel"): _SUBMITTER,  # its own jobs, or an admin
    ("POST", "/api/v1/jobs/{job_id}/pin"): _SUBMITTER,
    ("POST", "/api/v1/jobs/{job_id}/suspend"): _SUBMITTER,
    ("POST", "/api/v1/jobs/{job_id}/resume"): _SUBMITTER,
    ("POST", "/api/v1/jobs/{job_id}/fork"): _SUBMITTER,  # of its own jobs, or an admin
    ("DELETE", "/api/v1/jobs/{job_id}/pin"): _SUBMITTER,
    ("POST", "/api/v1/jobs/{job_id}/profile"): _SUBMITTER,  # the same
    ("GET", "/api/v1/jobs/{job_id}/stacks"): _SUBMITTER,  # the same
    ("GET", "/api/v1/audit"): Role.ADMIN,
})


def rpc_role(method: str) -> Role | None:
    """The role ``/package.Service/Method`` needs; ``None``: open.

    Raises:
      KeyError: a ``Coordinator`` method the table does not name (refused).
    """
    if method.startswith(OPEN_SERVICES):
        return None
    return RPC_ROLES[method.rsplit("/", 1)[-1]]
