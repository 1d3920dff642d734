"""The coordinator's gRPC server: its handlers, the token check, TLS.

:func:`create_server` builds and binds the server (port 0 picks a free port, which
tests use) with the ``Coordinator`` service, the standard ``grpc.health.v1`` health
service (``SERVING`` once the cluster is reachable: :func:`set_serving`) and server
reflection. Every coordinator call passes :class:`_Authorize` first: its token's role
against the role table (:mod:`jaxpod.service.auth.roles`). The ``jaxpod serve``
process runs it (:mod:`jaxpod.service.cli.serving`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxpod.errors import (
    AuthenticationError,
    PermissionDeniedError,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import coordinator_pb2_grpc as pb_grpc
from jaxpod.proto import tensors
from jaxpod.proto.tensors import channel_options
from jaxpod.service.api.error_mapping import request_deserializer
from jaxpod.service.api.status import status_of
from jaxpod.service.auth import roles
from jaxpod.service.auth.tokens import TokenBook, denial

logger = logging.getLogger(__name__)

LISTENING = "JAXPOD_LISTENING"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


class _Authorize(grpc.aio.ServerInterceptor):
    """Identifies each call's token and refuses it before any handler runs:
    ``UNAUTHENTICATED`` without a known token, ``PERMISSION_DENIED`` when its role is
    below the one :data:`jaxpod.service.auth.roles.RPC_ROLES` names for the method (or the
    method is not in that table). Health and reflection are open.

    Tokens are looked up by their SHA-256 (:meth:`TokenBook.identify`), so response
    times do not leak them.
    """

    def __init__(self, tokens: TokenBook, audit: Callable[..., None] | None = None) -> None:
        self._tokens = tokens
        self._audit = audit  # records refusals: (who, "refused", method, why)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        method = details.method or ""
        try:
            needed = roles.rpc_role(method)
        except KeyError:
            return _refuse(await continuation(details), PermissionDeniedError(
                f"{method} has no role in this service's role table, so no token may call "
                "it."))
        if needed is None:
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("authorization")
        who = self._tokens.identify_bearer(given)
        if who is None:
            return _refuse(await continuation(details), _unknown_token(given is not None))
        if not who.may(needed):
            name = method.rsplit("/", 1)[-1]
            refusal = PermissionDeniedError(denial(who, needed, name))
            if self._audit is not None:  # it never raises: the refusal stands
                await asyncio.to_thread(self._audit, who.name, "refused", name, str(refusal))
            return _refuse(await continuation(details), refusal)
        return await continuation(details)


#: gRPC's method handler factory by (request streaming, response streaming).
_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


def _unknown_token(token_given: bool) -> AuthenticationError:
    return AuthenticationError(
        "The jaxpod service refused the token this call carried: it is none of the tokens "
        "the service accepts. Pass yours to jaxpod.connect(token=...) or set JAXPOD_TOKEN "
        "to it." if token_given else
        "The jaxpod service requires a token and this call carried none: pass "
        "jaxpod.connect(token=...) or set JAXPOD_TOKEN to your token.")


def _refuse(handler: Any, error: Exception) -> Any:
    code, details, trailers = status_of(error)

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_trailing_metadata(trailers)
        await context.abort(code, details)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(request, context)
        yield  # pragma: no cover

    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(abort_stream if handler.response_streaming else abort,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def coordinator_handlers(service: pb_grpc.CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The ``Coordinator`` service's handlers, as the generated
    ``add_CoordinatorServicer_to_server`` makes them, except that result streams may
    yield data chunks already serialized (:func:`tensors.split_result`)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        request, response = (getattr(pb, t.name) for t in (method.input_type,
                                                           method.output_type))
        serialize = (tensors.serialize_chunk if response is pb.ResultChunk
                     else response.SerializeToString)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=request_deserializer(method.name,
                                                                               request),
                                     response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


@dataclass(frozen=True)
class TlsFiles:
    """The service's TLS certificate chain and private key (PEM files)."""

    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def create_server(address: str, service: pb_grpc.CoordinatorServicer,
                  tokens: TokenBook | None = None,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                  tls: TlsFiles | None = None
                  ) -> tuple[grpc.aio.Server, int, health_async.HealthServicer]:
    """Builds the server with every service on it and binds ``address``.

    Args:
      address: ``host:port``; port 0 picks a free one.
      service: the coordinator.
      tokens: when set, every coordinator call must carry one of them as a bearer
        token, of a role its method allows (``None``: open, loopback only).
      interceptors: run before the token check (the RPC timer of ``/metrics``).
      tls: serve over TLS with this certificate (``None``: plain text).

    Returns:
      The (not yet started) server, the bound port and its health servicer (set it
      ``NOT_SERVING`` until the cluster is reachable: it starts out ``SERVING``).
    """
    audit = getattr(service, "audit", None)
    chain = [*interceptors, *([_Authorize(tokens, audit)] if tokens is not None else [])]
    server = grpc.aio.server(options=channel_options(), interceptors=chain)
    server.add_generic_rpc_handlers((coordinator_handlers(service),))
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port = (server.add_secure_port(address, tls.credentials()) if tls is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"jaxpod serve: cannot listen on {address}; is the port in use?")
    return server, port, health


async def set_serving(health: health_async.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        await health.set(name, status)


