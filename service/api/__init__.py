"""The gRPC edge: the one place that turns protobuf messages into the service's types
and back.

* :mod:`~jaxpod.service.api.coordinator` -- ``CoordinatorService``: sessions, slices
  and the strategy methods on them, the operation stream;
* :mod:`~jaxpod.service.api.ahead` -- the operation stream's send-ahead of operations
  whose outputs the client predicted;
* :mod:`~jaxpod.service.api.jobs` -- the job RPCs (a mixin of the coordinator);
* :mod:`~jaxpod.service.api.status` -- exceptions as gRPC statuses;
* :mod:`~jaxpod.service.api.stopping` -- open calls that end when the service stops;
* :mod:`~jaxpod.service.api.server` -- the server: handlers, the token check, TLS.

Imports every package but :mod:`jaxpod.service.http` and :mod:`jaxpod.service.cli`.
"""
