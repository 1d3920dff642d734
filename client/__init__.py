"""jaxpod.client: the SDK side of the service.

``jaxpod.connect()`` returns a :class:`Client` (one session); ``client.strategy(...)``
a :class:`RemoteStrategy` with the methods of ``jaxpod.TPUStrategy``, run on a slice
the service holds; ``client.submit(...)`` a :class:`Job`. Nothing here imports Ray or
``jaxpod.service``; importing this package loads nothing heavy (the SDK's modules, and
JAX with them, load on first use), so :func:`connect` can start the embedded service
before they load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxpod import settings
from jaxpod.client import embedded

if TYPE_CHECKING:
    from jaxpod.client.client import Client
    from jaxpod.client.handles import RemoteDataset, RemoteIterator, RemotePerReplica
    from jaxpod.client.jobs import Job
    from jaxpod.client.remote import RemoteStrategy

__all__ = ["Client", "Job", "RemoteDataset", "RemoteIterator", "RemotePerReplica",
           "RemoteStrategy", "connect"]

_LAZY = {"Client": "jaxpod.client.client", "Job": "jaxpod.client.jobs",
         "RemoteDataset": "jaxpod.client.handles", "RemoteIterator": "jaxpod.client.handles",
         "RemotePerReplica": "jaxpod.client.handles", "RemoteStrategy": "jaxpod.client.remote"}


def connect(address: str | None = None, token: str | None = None, *,
            lease_s: float | None = None, tls_ca: str | bytes | bool | None = None
            ) -> Client:
    """Connects to a jaxpod service and opens a session.

    Args:
      address: ``host:port`` of ``jaxpod serve``. ``None``: ``$JAXPOD_ADDRESS``; if
        that is unset too, the embedded local service (started once per process as
        a child, on a simulated cluster, and stopped when this process exits).
      token: the service's bearer token (default ``$JAXPOD_TOKEN``).
      lease_s: how long the service keeps this session without a heartbeat
        (default: the service's).
      tls_ca: reach the service over TLS, trusting this CA certificate (a PEM file's
        path, or its bytes; ``True``: the system's roots; default ``$JAXPOD_TLS_CA``, a
        path; unset: plain text).

    Returns:
      The client; close it (or use it as a context manager) to release its slices.
    """
    settings.check_once()  # a typo'd JAXPOD_ADDRESS must not start a local service
    if not (address or settings.ADDRESS.get()):
        embedded.shared(wait=False)  # it starts while the SDK and JAX load
    from jaxpod.client.client import connect as open_session

    return open_session(address, token, lease_s=lease_s, tls_ca=tls_ca)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpod.client' has no attribute {name!r}")
