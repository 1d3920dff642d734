"""jaxpod.client: the SDK side of the service.

``jaxpod.connect()`` returns a :class:`Client` (one session); ``client.strategy(...)``
a :class:`RemoteStrategy` with the methods of ``jaxpod.TPUStrategy``, run on a slice
the service holds; ``client.submit(...)`` a :class:`Job`. Nothing here imports Ray or
``jaxpod.service``.
"""

from jaxpod.client.client import Client, connect
from jaxpod.client.jobs import Job
from jaxpod.client.remote import RemoteDataset, RemoteIterator, RemotePerReplica, RemoteStrategy

__all__ = ["Client", "Job", "RemoteDataset", "RemoteIterator", "RemotePerReplica",
           "RemoteStrategy", "connect"]
