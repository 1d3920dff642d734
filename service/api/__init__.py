"""The gRPC edge: the one place that turns protobuf messages into the service's types
and back.

* :mod:`~jaxpod.service.api.coordinator` -- ``CoordinatorService``: sessions and
  slices, and the class that gathers the RPCs of the modules below;
* :mod:`~jaxpod.service.api.strategy_methods` -- the strategy methods' RPCs but the
  operation stream (definitions, uploads, datasets, streamed results, stats, profiles);
* :mod:`~jaxpod.service.api.op_stream` -- the operation stream (``Stream``);
* :mod:`~jaxpod.service.api.engine_calls` -- the strategy methods' requests as the
  held slice's engine calls;
* :mod:`~jaxpod.service.api.error_mapping` -- malformed requests refused, exceptions
  answered as statuses;
* :mod:`~jaxpod.service.api.ahead` -- the operation stream's send-ahead of operations
  whose outputs the client predicted;
* :mod:`~jaxpod.service.api.jobs` -- the job RPCs (a mixin of the coordinator);
* :mod:`~jaxpod.service.api.status` -- exceptions as gRPC statuses;
* :mod:`~jaxpod.service.api.stopping` -- open calls that end when the service stops;
* :mod:`~jaxpod.service.api.server` -- the server: handlers, the token check, TLS.

Imports every package but :mod:`jaxpod.service.http` and :mod:`jaxpod.service.cli`.
"""
