"""jaxpod.client: the SDK side of the service.

``jaxpod.connect()`` returns a :class:`Client` (one session); ``client.strategy(...)``
a :class:`RemoteStrategy` with the methods of ``jaxpod.TPUStrategy``, run on a slice
the service holds. Nothing here imports Ray or ``jaxpod.service``.
"""

from jaxpod.client.client import Client, connect
from jaxpod.client.remote import RemoteDataset, RemoteIterator, RemotePerReplica, RemoteStrategy

__all__ = ["Client", "RemoteDataset", "RemoteIterator", "RemotePerReplica", "RemoteStrategy",
           "connect"]
