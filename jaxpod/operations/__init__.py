"""The protocol between the coordinator and its host workers, defined once.

Every host operation is a frozen dataclass, naming its fields and, through
``Operation[R]``, its result type. The coordinator's replica-group handle sends
operation objects (``ReplicaGroup.call(op) -> list[R]``, one result per host); the
worker runs each by calling the :class:`Host` method of the same name
(``op.apply(host)``), so mypy checks that both ends agree and a reader can follow an
operation from the call to its handler. Adding an operation means one dataclass in the
module of its kind, its name here, and one method on the worker's ``Host``.

The types both ends share are here too: values on the workers are named by
:class:`Handle`; what the coordinator dropped rides along as :class:`Dropped`; a new
value is described by :class:`HandleInfo`; an exception raised on a worker comes back
as :class:`RemoteError`; hosts other than the first answer a uniform operation with a
:class:`Digest` of their result.

Import them from here (``from jaxpod import operations as ops``); they are declared in
the package's modules:

* :mod:`~jaxpod.operations.handles` -- handles, dropped objects, value infos, value ids;
* :mod:`~jaxpod.operations.base` -- the ``Operation`` base, the ``Envelope``, the
  replies besides a result, the sequence's errors;
* :mod:`~jaxpod.operations.strategy` -- the strategy methods' operations: set-up,
  functions, runs, input, results;
* :mod:`~jaxpod.operations.jobs` -- a job runner's: host reports, checkpoints;
* :mod:`~jaxpod.operations.admin` -- the hosts' own: figures, reset, output, profiles,
  preemption notices;
* :mod:`~jaxpod.operations.host` -- the ``Host`` protocol the workers implement.
"""

from jaxpod.operations.admin import (
    CaptureOutput,
    HostReset,
    HostStats,
    Notice,
    PreemptionNotices,
    ResetHost,
    StartProfile,
    Stats,
    StopProfile,
    TakeOutput,
)
from jaxpod.operations.base import (
    Digest,
    Digested,
    DivergedError,
    Envelope,
    IdRangeError,
    Operation,
    OperationOrderError,
    RemoteError,
)
from jaxpod.operations.handles import (
    OUTPUT_BITS,
    Dropped,
    Handle,
    HandleInfo,
    ValueArgs,
    ValueInfos,
    op_of,
    output_id,
    output_index,
    values_in,
)
from jaxpod.operations.host import Host
from jaxpod.operations.jobs import (
    DropMemoryCheckpoints,
    HostNews,
    HostReport,
    MemoryHoldings,
    RestoreCheckpoint,
    RestoreMemoryCheckpoint,
    SaveCheckpoint,
    SaveMemoryCheckpoint,
    WaitCheckpoints,
)
from jaxpod.operations.strategy import (
    Configure,
    CreateIterator,
    Define,
    DistributeDataset,
    DistributeDatasetsFromFunction,
    FetchParts,
    FetchShards,
    GatherParts,
    LocalResults,
    NextInput,
    Reduce,
    ReplicaValue,
    Run,
    RunSpmd,
    RunSteps,
    SetGlobalView,
    ShardIndex,
    StepItems,
    ValuesFromFunction,
)

__all__ = [
    "OUTPUT_BITS",
    "CaptureOutput",
    "Configure",
    "CreateIterator",
    "Define",
    "Digest",
    "Digested",
    "DistributeDataset",
    "DistributeDatasetsFromFunction",
    "DivergedError",
    "DropMemoryCheckpoints",
    "Dropped",
    "Envelope",
    "FetchParts",
    "FetchShards",
    "GatherParts",
    "Handle",
    "HandleInfo",
    "Host",
    "HostNews",
    "HostReport",
    "HostReset",
    "HostStats",
    "IdRangeError",
    "LocalResults",
    "MemoryHoldings",
    "NextInput",
    "Notice",
    "Operation",
    "OperationOrderError",
    "PreemptionNotices",
    "Reduce",
    "RemoteError",
    "ReplicaValue",
    "ResetHost",
    "RestoreCheckpoint",
    "RestoreMemoryCheckpoint",
    "Run",
    "RunSpmd",
    "RunSteps",
    "SaveCheckpoint",
    "SaveMemoryCheckpoint",
    "SetGlobalView",
    "ShardIndex",
    "StartProfile",
    "Stats",
    "StepItems",
    "StopProfile",
    "TakeOutput",
    "ValueArgs",
    "ValueInfos",
    "ValuesFromFunction",
    "WaitCheckpoints",
    "op_of",
    "output_id",
    "output_index",
    "values_in",
]
