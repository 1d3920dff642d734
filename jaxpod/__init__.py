"""jaxpod: JAX step functions on TPU pod slices, with ``tf.distribute.TPUStrategy`` semantics.

This module only re-exports the public API; the parts live in ``jaxpod.worker``
(the engine), ``jaxpod.service`` (coordinator), ``jaxpod.client`` and ``jaxpod.proto``.
"""

from typing import TYPE_CHECKING, Any

from jaxpod.errors import (
    AllocationCancelledError,
    AllocationTimeoutError,
    AsyncPredictionError,
    AuthenticationError,
    DeadlineExceededError,
    DependencyFailedError,
    EndOfDataError,
    HandleError,
    JaxpodError,
    JobCancelledError,
    JobFailedError,
    JobNotFoundError,
    MalformedRequestError,
    MessageTooLargeError,
    OperationTimeoutError,
    PermissionDeniedError,
    QuotaExceededError,
    ServiceUnavailableError,
    SessionError,
    SliceResetError,
    UnknownFunctionError,
    VersionMismatchError,
    WorkerLostError,
    WorkerStartError,
)
from jaxpod.jobs import (
    JobAttempt,
    JobCheckpoint,
    JobProfile,
    JobResult,
    JobStatus,
    JobTransition,
)
from jaxpod.scope import get_strategy, mesh
from jaxpod.types import AutoShardPolicy, InputContext, InputOptions, ReduceOp, ValueContext

if TYPE_CHECKING:
    from jaxpod.client import Client, Job, RemoteStrategy, connect
    from jaxpod.service.capacity.resolvers import TPUClusterResolver
    from jaxpod.tf_extended import StrategyExtended
    from jaxpod.tf_inputs import InputReplicationMode
    from jaxpod.tf_multistep import MultiStepContext
    from jaxpod.values import DistributedDataset, DistributedIterator, PerReplica
    from jaxpod.worker.device_assignment import DeviceAssignment, Topology
    from jaxpod.worker.replica_context import ReplicaContext, get_replica_context
    from jaxpod.worker.strategy import TPUStrategy

__version__ = "0.1.0"

__all__ = [
    "AllocationCancelledError",
    "AllocationTimeoutError",
    "AsyncPredictionError",
    "AuthenticationError",
    "AutoShardPolicy",
    "Client",
    "DeadlineExceededError",
    "DependencyFailedError",
    "DeviceAssignment",
    "DistributedDataset",
    "DistributedIterator",
    "EndOfDataError",
    "HandleError",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "JaxpodError",
    "Job",
    "JobAttempt",
    "JobCancelledError",
    "JobCheckpoint",
    "JobFailedError",
    "JobNotFoundError",
    "JobProfile",
    "JobResult",
    "JobStatus",
    "JobTransition",
    "MalformedRequestError",
    "MessageTooLargeError",
    "MultiStepContext",
    "OperationTimeoutError",
    "PerReplica",
    "PermissionDeniedError",
    "QuotaExceededError",
    "ReduceOp",
    "RemoteStrategy",
    "ReplicaContext",
    "ServiceUnavailableError",
    "SessionError",
    "SliceResetError",
    "StrategyExtended",
    "TPUClusterResolver",
    "TPUStrategy",
    "Topology",
    "UnknownFunctionError",
    "ValueContext",
    "VersionMismatchError",
    "WorkerLostError",
    "WorkerStartError",
    "__version__",
    "connect",
    "get_replica_context",
    "get_strategy",
    "mesh",
]

# Re-exported lazily, so that each part loads only what it uses: a client never loads
# the engine (``jaxpod.worker``) or Ray (the resolvers, in ``jaxpod.service``), and
# ``import jaxpod`` does not load JAX (``jaxpod serve --local`` starts its simulated
# cluster first, ``jaxpod.connect()`` its embedded service).
_LAZY = {"InputReplicationMode": "jaxpod.tf_inputs", "MultiStepContext": "jaxpod.tf_multistep",
         "StrategyExtended": "jaxpod.tf_extended", "DistributedDataset": "jaxpod.values",
         "DistributedIterator": "jaxpod.values", "PerReplica": "jaxpod.values",
         "TPUClusterResolver": "jaxpod.service.capacity.resolvers",
         "connect": "jaxpod.client", "Client": "jaxpod.client", "Job": "jaxpod.client",
         "RemoteStrategy": "jaxpod.client",
         "TPUStrategy": "jaxpod.worker.strategy",
         "DeviceAssignment": "jaxpod.worker.device_assignment",
         "Topology": "jaxpod.worker.device_assignment",
         "ReplicaContext": "jaxpod.worker.replica_context",
         "get_replica_context": "jaxpod.worker.replica_context"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpod' has no attribute {name!r}")
