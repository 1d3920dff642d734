"""jaxpod: JAX step functions on TPU pod slices, with ``tf.distribute.TPUStrategy`` semantics.

This module only re-exports the public API; the parts live in ``jaxpod.worker``
(the engine), ``jaxpod.service`` (coordinator), ``jaxpod.client`` and ``jaxpod.proto``.
"""

from typing import Any

from jaxpod.errors import (
    AllocationCancelledError,
    AllocationTimeoutError,
    AuthenticationError,
    DeadlineExceededError,
    EndOfDataError,
    HandleError,
    JaxpodError,
    MessageTooLargeError,
    ServiceUnavailableError,
    SessionError,
    VersionMismatchError,
    WorkerLostError,
    WorkerStartError,
)
from jaxpod.types import AutoShardPolicy, InputContext, InputOptions, ReduceOp, ValueContext
from jaxpod.worker.device_assignment import DeviceAssignment, Topology
from jaxpod.worker.engine import DistributedDataset, DistributedIterator
from jaxpod.worker.replica_context import ReplicaContext, get_replica_context, get_strategy
from jaxpod.worker.strategy import TPUStrategy
from jaxpod.worker.values import PerReplica

__version__ = "0.1.0"

__all__ = [
    "AllocationCancelledError",
    "AllocationTimeoutError",
    "AuthenticationError",
    "AutoShardPolicy",
    "Client",
    "DeadlineExceededError",
    "DeviceAssignment",
    "DistributedDataset",
    "DistributedIterator",
    "EndOfDataError",
    "HandleError",
    "InputContext",
    "InputOptions",
    "JaxpodError",
    "MessageTooLargeError",
    "PerReplica",
    "ReduceOp",
    "RemoteStrategy",
    "ReplicaContext",
    "ServiceUnavailableError",
    "SessionError",
    "TPUClusterResolver",
    "TPUStrategy",
    "Topology",
    "ValueContext",
    "VersionMismatchError",
    "WorkerLostError",
    "WorkerStartError",
    "__version__",
    "connect",
    "get_replica_context",
    "get_strategy",
]

# Re-exported lazily: the resolvers live in the service part, which pulls in Ray on
# use; a client-only install never loads it unless asked. The client loads gRPC.
_LAZY = {"TPUClusterResolver": "jaxpod.service.resolvers",
         "connect": "jaxpod.client", "Client": "jaxpod.client",
         "RemoteStrategy": "jaxpod.client"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpod' has no attribute {name!r}")
