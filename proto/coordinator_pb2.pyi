from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("session_id", "dtype", "shape", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ValueRef(_message.Message):
    __slots__ = ("id", "slice_id", "shape", "dtype", "has_valid_rows", "valid_rows", "global_view")
    ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_VALID_ROWS_FIELD_NUMBER: _ClassVar[int]
    VALID_ROWS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_VIEW_FIELD_NUMBER: _ClassVar[int]
    id: int
    slice_id: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    has_valid_rows: bool
    valid_rows: _containers.RepeatedScalarFieldContainer[int]
    global_view: bool
    def __init__(self, id: _Optional[int] = ..., slice_id: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., has_valid_rows: _Optional[bool] = ..., valid_rows: _Optional[_Iterable[int]] = ..., global_view: _Optional[bool] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Tree]
    def __init__(self, items: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ...) -> None: ...

class Mapping(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[Tree]
    values: _containers.RepeatedCompositeFieldContainer[Tree]
    def __init__(self, keys: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ...) -> None: ...

class Structure(_message.Message):
    __slots__ = ("recipe", "type_name", "paths", "leaves")
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    recipe: bytes
    type_name: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    leaves: _containers.RepeatedCompositeFieldContainer[Tree]
    def __init__(self, recipe: _Optional[bytes] = ..., type_name: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., leaves: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ...) -> None: ...

class KeyData(_message.Message):
    __slots__ = ("impl", "data")
    IMPL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    impl: str
    data: Tree
    def __init__(self, impl: _Optional[str] = ..., data: _Optional[_Union[Tree, _Mapping]] = ...) -> None: ...

class Tree(_message.Message):
    __slots__ = ("tensor", "value", "blob", "float_value", "int_value", "bool_value", "str_value", "none", "tuple", "list", "dict", "streamed", "structure", "key")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    STR_VALUE_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    value: ValueRef
    blob: int
    float_value: float
    int_value: int
    bool_value: bool
    str_value: str
    none: bool
    tuple: Sequence
    list: Sequence
    dict: Mapping
    streamed: Tensor
    structure: Structure
    key: KeyData
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[ValueRef, _Mapping]] = ..., blob: _Optional[int] = ..., float_value: _Optional[float] = ..., int_value: _Optional[int] = ..., bool_value: _Optional[bool] = ..., str_value: _Optional[str] = ..., none: _Optional[bool] = ..., tuple: _Optional[_Union[Sequence, _Mapping]] = ..., list: _Optional[_Union[Sequence, _Mapping]] = ..., dict: _Optional[_Union[Mapping, _Mapping]] = ..., streamed: _Optional[_Union[Tensor, _Mapping]] = ..., structure: _Optional[_Union[Structure, _Mapping]] = ..., key: _Optional[_Union[KeyData, _Mapping]] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("skeleton", "data")
    SKELETON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    skeleton: Tree
    data: bytes
    def __init__(self, skeleton: _Optional[_Union[Tree, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_version", "protocol_version", "lease_s", "runtime_versions")
    class RuntimeVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    protocol_version: int
    lease_s: float
    runtime_versions: _containers.ScalarMap[str, str]
    def __init__(self, client_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., lease_s: _Optional[float] = ..., runtime_versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_s", "server_version", "protocol_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_s: float
    server_version: str
    protocol_version: int
    def __init__(self, session_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., server_version: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class AcquireSliceRequest(_message.Message):
    __slots__ = ("session_id", "accelerator_type", "num_slices", "steps_per_run", "computation_shape", "num_replicas", "timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_RUN_FIELD_NUMBER: _ClassVar[int]
    COMPUTATION_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accelerator_type: str
    num_slices: int
    steps_per_run: int
    computation_shape: _containers.RepeatedScalarFieldContainer[int]
    num_replicas: int
    timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., num_slices: _Optional[int] = ..., steps_per_run: _Optional[int] = ..., computation_shape: _Optional[_Iterable[int]] = ..., num_replicas: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SliceInfo(_message.Message):
    __slots__ = ("slice_id", "accelerator_type", "num_slices", "num_hosts", "num_replicas", "steps_per_run", "slice_names")
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_RUN_FIELD_NUMBER: _ClassVar[int]
    SLICE_NAMES_FIELD_NUMBER: _ClassVar[int]
    slice_id: str
    accelerator_type: str
    num_slices: int
    num_hosts: int
    num_replicas: int
    steps_per_run: int
    slice_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, slice_id: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., num_slices: _Optional[int] = ..., num_hosts: _Optional[int] = ..., num_replicas: _Optional[int] = ..., steps_per_run: _Optional[int] = ..., slice_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SliceRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class ProfileSliceRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "seconds", "stop", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    seconds: float
    stop: bool
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., seconds: _Optional[float] = ..., stop: _Optional[bool] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class SliceStatsResponse(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostStats]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostStats, _Mapping]]] = ...) -> None: ...

class HostStats(_message.Message):
    __slots__ = ("num_values", "device_bytes", "num_iterators", "busy_s", "operations", "input_wait_s", "input_queue_depth")
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ITERATORS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    INPUT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    INPUT_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    num_values: int
    device_bytes: int
    num_iterators: int
    busy_s: float
    operations: int
    input_wait_s: float
    input_queue_depth: int
    def __init__(self, num_values: _Optional[int] = ..., device_bytes: _Optional[int] = ..., num_iterators: _Optional[int] = ..., busy_s: _Optional[float] = ..., operations: _Optional[int] = ..., input_wait_s: _Optional[float] = ..., input_queue_depth: _Optional[int] = ...) -> None: ...

class DefineFunctionRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "payload", "runtime_versions", "dropped")
    class RuntimeVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    payload: bytes
    runtime_versions: _containers.ScalarMap[str, str]
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., payload: _Optional[bytes] = ..., runtime_versions: _Optional[_Mapping[str, str]] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class DefineFunctionResponse(_message.Message):
    __slots__ = ("function_id",)
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    function_id: str
    def __init__(self, function_id: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("blob",)
    BLOB_FIELD_NUMBER: _ClassVar[int]
    blob: int
    def __init__(self, blob: _Optional[int] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "function_id", "args", "kwargs", "mesh_axes", "mesh_shape", "batch_sharding", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    MESH_AXES_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SHARDING_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    function_id: str
    args: Tree
    kwargs: Tree
    mesh_axes: _containers.RepeatedScalarFieldContainer[str]
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    batch_sharding: Tree
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., function_id: _Optional[str] = ..., args: _Optional[_Union[Tree, _Mapping]] = ..., kwargs: _Optional[_Union[Tree, _Mapping]] = ..., mesh_axes: _Optional[_Iterable[str]] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., batch_sharding: _Optional[_Union[Tree, _Mapping]] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class RunStepsRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "function_id", "iterator_id", "steps", "initial_state", "has_items", "items", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    function_id: str
    iterator_id: int
    steps: Tree
    initial_state: Tree
    has_items: bool
    items: Tree
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., function_id: _Optional[str] = ..., iterator_id: _Optional[int] = ..., steps: _Optional[_Union[Tree, _Mapping]] = ..., initial_state: _Optional[_Union[Tree, _Mapping]] = ..., has_items: _Optional[bool] = ..., items: _Optional[_Union[Tree, _Mapping]] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class DistributeValuesRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "function_id", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    function_id: str
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., function_id: _Optional[str] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class DistributeDatasetRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "dataset", "dataset_blob", "function_id", "options", "runtime_versions", "dropped")
    class RuntimeVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_BLOB_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    dataset: bytes
    dataset_blob: int
    function_id: str
    options: bytes
    runtime_versions: _containers.ScalarMap[str, str]
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., dataset: _Optional[bytes] = ..., dataset_blob: _Optional[int] = ..., function_id: _Optional[str] = ..., options: _Optional[bytes] = ..., runtime_versions: _Optional[_Mapping[str, str]] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class DatasetResponse(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: int
    def __init__(self, dataset_id: _Optional[int] = ...) -> None: ...

class IteratorRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "id", "steps_per_run", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_RUN_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    id: int
    steps_per_run: int
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., id: _Optional[int] = ..., steps_per_run: _Optional[int] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class IteratorResponse(_message.Message):
    __slots__ = ("iterator_id",)
    ITERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    iterator_id: int
    def __init__(self, iterator_id: _Optional[int] = ...) -> None: ...

class SliceOp(_message.Message):
    __slots__ = ("op", "predicted", "expect", "run", "run_steps", "distribute_values", "next", "reduce", "gather", "local_results", "fetch")
    OP_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RUN_STEPS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTE_VALUES_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    GATHER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    op: int
    predicted: bool
    expect: Tree
    run: RunRequest
    run_steps: RunStepsRequest
    distribute_values: DistributeValuesRequest
    next: IteratorRequest
    reduce: ReduceRequest
    gather: GatherRequest
    local_results: ValueRequest
    fetch: ValueRequest
    def __init__(self, op: _Optional[int] = ..., predicted: _Optional[bool] = ..., expect: _Optional[_Union[Tree, _Mapping]] = ..., run: _Optional[_Union[RunRequest, _Mapping]] = ..., run_steps: _Optional[_Union[RunStepsRequest, _Mapping]] = ..., distribute_values: _Optional[_Union[DistributeValuesRequest, _Mapping]] = ..., next: _Optional[_Union[IteratorRequest, _Mapping]] = ..., reduce: _Optional[_Union[ReduceRequest, _Mapping]] = ..., gather: _Optional[_Union[GatherRequest, _Mapping]] = ..., local_results: _Optional[_Union[ValueRequest, _Mapping]] = ..., fetch: _Optional[_Union[ValueRequest, _Mapping]] = ...) -> None: ...

class SliceOps(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[SliceOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[SliceOp, _Mapping]]] = ...) -> None: ...

class SliceReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[SliceReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[SliceReply, _Mapping]]] = ...) -> None: ...

class OpFailure(_message.Message):
    __slots__ = ("code", "details", "error", "traceback", "caused_by")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    CAUSED_BY_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    error: bytes
    traceback: bytes
    caused_by: int
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., error: _Optional[bytes] = ..., traceback: _Optional[bytes] = ..., caused_by: _Optional[int] = ...) -> None: ...

class SliceReply(_message.Message):
    __slots__ = ("op", "tree", "done", "failure", "full_steps_ahead")
    OP_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    FULL_STEPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    op: int
    tree: Tree
    done: bool
    failure: OpFailure
    full_steps_ahead: int
    def __init__(self, op: _Optional[int] = ..., tree: _Optional[_Union[Tree, _Mapping]] = ..., done: _Optional[bool] = ..., failure: _Optional[_Union[OpFailure, _Mapping]] = ..., full_steps_ahead: _Optional[int] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "reduce_op", "value", "axis", "after_op", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    AFTER_OP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    reduce_op: Tree
    value: Tree
    axis: Tree
    after_op: int
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., reduce_op: _Optional[_Union[Tree, _Mapping]] = ..., value: _Optional[_Union[Tree, _Mapping]] = ..., axis: _Optional[_Union[Tree, _Mapping]] = ..., after_op: _Optional[int] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class GatherRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "value", "axis", "after_op", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    AFTER_OP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    value: Tree
    axis: Tree
    after_op: int
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., value: _Optional[_Union[Tree, _Mapping]] = ..., axis: _Optional[_Union[Tree, _Mapping]] = ..., after_op: _Optional[int] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class ValueRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "value", "after_op", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AFTER_OP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    value: Tree
    after_op: int
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., value: _Optional[_Union[Tree, _Mapping]] = ..., after_op: _Optional[int] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("session_id", "slice_id", "blobs", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slice_id: str
    blobs: _containers.RepeatedScalarFieldContainer[int]
    dropped: Dropped
    def __init__(self, session_id: _Optional[str] = ..., slice_id: _Optional[str] = ..., blobs: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ...) -> None: ...

class Dropped(_message.Message):
    __slots__ = ("value_ids", "iterator_ids", "dataset_ids")
    VALUE_IDS_FIELD_NUMBER: _ClassVar[int]
    ITERATOR_IDS_FIELD_NUMBER: _ClassVar[int]
    DATASET_IDS_FIELD_NUMBER: _ClassVar[int]
    value_ids: _containers.RepeatedScalarFieldContainer[int]
    iterator_ids: _containers.RepeatedScalarFieldContainer[int]
    dataset_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, value_ids: _Optional[_Iterable[int]] = ..., iterator_ids: _Optional[_Iterable[int]] = ..., dataset_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("slices", "num_sessions", "server_version", "teams")
    SLICES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEAMS_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[ClusterSlice]
    num_sessions: int
    server_version: str
    teams: _containers.RepeatedCompositeFieldContainer[TeamShare]
    def __init__(self, slices: _Optional[_Iterable[_Union[ClusterSlice, _Mapping]]] = ..., num_sessions: _Optional[int] = ..., server_version: _Optional[str] = ..., teams: _Optional[_Iterable[_Union[TeamShare, _Mapping]]] = ...) -> None: ...

class TeamShare(_message.Message):
    __slots__ = ("team", "weight", "held", "entitled", "borrowed", "queued")
    TEAM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    ENTITLED_FIELD_NUMBER: _ClassVar[int]
    BORROWED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    team: str
    weight: float
    held: int
    entitled: float
    borrowed: int
    queued: int
    def __init__(self, team: _Optional[str] = ..., weight: _Optional[float] = ..., held: _Optional[int] = ..., entitled: _Optional[float] = ..., borrowed: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...

class ClusterSlice(_message.Message):
    __slots__ = ("name", "accelerator_type", "num_hosts", "holder")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    name: str
    accelerator_type: str
    num_hosts: int
    holder: str
    def __init__(self, name: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., num_hosts: _Optional[int] = ..., holder: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "accelerator_type", "num_slices", "steps", "steps_per_run", "step_fn", "init_fn", "dataset", "dataset_fn", "outputs", "checkpoint_every", "max_retries_preemption", "max_retries_failure", "runtime_versions", "computation_shape", "mesh_axes", "mesh_shape", "batch_sharding", "priority", "accelerator_types", "grow_back", "memory_checkpoint_every", "min_runtime_s", "max_runtime_s")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RuntimeVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FN_FIELD_NUMBER: _ClassVar[int]
    INIT_FN_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_FN_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTATION_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MESH_AXES_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SHARDING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPES_FIELD_NUMBER: _ClassVar[int]
    GROW_BACK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    MIN_RUNTIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNTIME_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    accelerator_type: str
    num_slices: int
    steps: int
    steps_per_run: int
    step_fn: bytes
    init_fn: bytes
    dataset: bytes
    dataset_fn: bytes
    outputs: _containers.ScalarMap[str, str]
    checkpoint_every: int
    max_retries_preemption: int
    max_retries_failure: int
    runtime_versions: _containers.ScalarMap[str, str]
    computation_shape: _containers.RepeatedScalarFieldContainer[int]
    mesh_axes: _containers.RepeatedScalarFieldContainer[str]
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    batch_sharding: bytes
    priority: int
    accelerator_types: _containers.RepeatedScalarFieldContainer[str]
    grow_back: bool
    memory_checkpoint_every: int
    min_runtime_s: float
    max_runtime_s: float
    def __init__(self, name: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., num_slices: _Optional[int] = ..., steps: _Optional[int] = ..., steps_per_run: _Optional[int] = ..., step_fn: _Optional[bytes] = ..., init_fn: _Optional[bytes] = ..., dataset: _Optional[bytes] = ..., dataset_fn: _Optional[bytes] = ..., outputs: _Optional[_Mapping[str, str]] = ..., checkpoint_every: _Optional[int] = ..., max_retries_preemption: _Optional[int] = ..., max_retries_failure: _Optional[int] = ..., runtime_versions: _Optional[_Mapping[str, str]] = ..., computation_shape: _Optional[_Iterable[int]] = ..., mesh_axes: _Optional[_Iterable[str]] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., batch_sharding: _Optional[bytes] = ..., priority: _Optional[int] = ..., accelerator_types: _Optional[_Iterable[str]] = ..., grow_back: _Optional[bool] = ..., memory_checkpoint_every: _Optional[int] = ..., min_runtime_s: _Optional[float] = ..., max_runtime_s: _Optional[float] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job_id", "detail", "without_state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    detail: bool
    without_state: bool
    def __init__(self, job_id: _Optional[str] = ..., detail: _Optional[bool] = ..., without_state: _Optional[bool] = ...) -> None: ...

class ForkJobRequest(_message.Message):
    __slots__ = ("job_id", "step", "steps", "overrides", "override")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    steps: int
    overrides: JobSpec
    override: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., overrides: _Optional[_Union[JobSpec, _Mapping]] = ..., override: _Optional[_Iterable[str]] = ...) -> None: ...

class PinJobRequest(_message.Message):
    __slots__ = ("job_id", "pinned")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    pinned: bool
    def __init__(self, job_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("state", "limit", "offset")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    state: str
    limit: int
    offset: int
    def __init__(self, state: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class JobTransition(_message.Message):
    __slots__ = ("from_state", "to_state", "at", "reason")
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    from_state: str
    to_state: str
    at: float
    reason: str
    def __init__(self, from_state: _Optional[str] = ..., to_state: _Optional[str] = ..., at: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class JobAttempt(_message.Message):
    __slots__ = ("number", "started_at", "ended_at", "cause", "step_reached", "running_at", "start_step", "first_step_at", "programs_loaded", "programs_compiled", "accelerator_type")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    STEP_REACHED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_AT_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_AT_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_LOADED_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_COMPILED_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    number: int
    started_at: float
    ended_at: float
    cause: str
    step_reached: int
    running_at: float
    start_step: int
    first_step_at: float
    programs_loaded: int
    programs_compiled: int
    accelerator_type: str
    def __init__(self, number: _Optional[int] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., cause: _Optional[str] = ..., step_reached: _Optional[int] = ..., running_at: _Optional[float] = ..., start_step: _Optional[int] = ..., first_step_at: _Optional[float] = ..., programs_loaded: _Optional[int] = ..., programs_compiled: _Optional[int] = ..., accelerator_type: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("id", "state", "name", "accelerator_type", "step", "steps", "attempts", "queue_position", "error", "metrics", "created_at", "started_at", "finished_at", "goodput", "steps_per_s", "owner", "wait_reason", "priority", "stragglers", "pinned", "pruned_at", "team")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class GoodputEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WAIT_REASON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PRUNED_AT_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: str
    name: str
    accelerator_type: str
    step: int
    steps: int
    attempts: int
    queue_position: int
    error: str
    metrics: _containers.ScalarMap[str, float]
    created_at: float
    started_at: float
    finished_at: float
    goodput: _containers.ScalarMap[str, float]
    steps_per_s: float
    owner: str
    wait_reason: str
    priority: int
    stragglers: _containers.RepeatedScalarFieldContainer[int]
    pinned: bool
    pruned_at: float
    team: str
    def __init__(self, id: _Optional[str] = ..., state: _Optional[str] = ..., name: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., attempts: _Optional[int] = ..., queue_position: _Optional[int] = ..., error: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., goodput: _Optional[_Mapping[str, float]] = ..., steps_per_s: _Optional[float] = ..., owner: _Optional[str] = ..., wait_reason: _Optional[str] = ..., priority: _Optional[int] = ..., stragglers: _Optional[_Iterable[int]] = ..., pinned: _Optional[bool] = ..., pruned_at: _Optional[float] = ..., team: _Optional[str] = ...) -> None: ...

class HostInput(_message.Message):
    __slots__ = ("host", "input_wait_s", "input_queue_depth", "node", "address", "pid", "step_s", "straggler")
    HOST_FIELD_NUMBER: _ClassVar[int]
    INPUT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    INPUT_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    host: int
    input_wait_s: float
    input_queue_depth: int
    node: str
    address: str
    pid: int
    step_s: float
    straggler: str
    def __init__(self, host: _Optional[int] = ..., input_wait_s: _Optional[float] = ..., input_queue_depth: _Optional[int] = ..., node: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., step_s: _Optional[float] = ..., straggler: _Optional[str] = ...) -> None: ...

class HostStacks(_message.Message):
    __slots__ = ("host", "node", "pid", "stacks")
    HOST_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    host: int
    node: str
    pid: int
    stacks: str
    def __init__(self, host: _Optional[int] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., stacks: _Optional[str] = ...) -> None: ...

class JobStacks(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostStacks]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostStacks, _Mapping]]] = ...) -> None: ...

class JobCheckpoint(_message.Message):
    __slots__ = ("step", "path", "saved_at", "stall_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAVED_AT_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    saved_at: float
    stall_s: float
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., saved_at: _Optional[float] = ..., stall_s: _Optional[float] = ...) -> None: ...

class JobProfile(_message.Message):
    __slots__ = ("path", "started_at", "seconds", "files")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    path: str
    started_at: float
    seconds: float
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., started_at: _Optional[float] = ..., seconds: _Optional[float] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...

class ProfileJobRequest(_message.Message):
    __slots__ = ("job_id", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seconds: float
    def __init__(self, job_id: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class JobDetails(_message.Message):
    __slots__ = ("status", "history", "attempts", "hosts", "checkpoints", "profiles")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    status: JobStatus
    history: _containers.RepeatedCompositeFieldContainer[JobTransition]
    attempts: _containers.RepeatedCompositeFieldContainer[JobAttempt]
    hosts: _containers.RepeatedCompositeFieldContainer[HostInput]
    checkpoints: _containers.RepeatedCompositeFieldContainer[JobCheckpoint]
    profiles: _containers.RepeatedCompositeFieldContainer[JobProfile]
    def __init__(self, status: _Optional[_Union[JobStatus, _Mapping]] = ..., history: _Optional[_Iterable[_Union[JobTransition, _Mapping]]] = ..., attempts: _Optional[_Iterable[_Union[JobAttempt, _Mapping]]] = ..., hosts: _Optional[_Iterable[_Union[HostInput, _Mapping]]] = ..., checkpoints: _Optional[_Iterable[_Union[JobCheckpoint, _Mapping]]] = ..., profiles: _Optional[_Iterable[_Union[JobProfile, _Mapping]]] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class MetricSeries(_message.Message):
    __slots__ = ("name", "steps", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class JobMetrics(_message.Message):
    __slots__ = ("series",)
    SERIES_FIELD_NUMBER: _ClassVar[int]
    series: _containers.RepeatedCompositeFieldContainer[MetricSeries]
    def __init__(self, series: _Optional[_Iterable[_Union[MetricSeries, _Mapping]]] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job_id", "after", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after: int
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("seq", "host", "line", "at")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    host: int
    line: str
    at: float
    def __init__(self, seq: _Optional[int] = ..., host: _Optional[int] = ..., line: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class JobLogs(_message.Message):
    __slots__ = ("lines", "more")
    LINES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedCompositeFieldContainer[LogLine]
    more: bool
    def __init__(self, lines: _Optional[_Iterable[_Union[LogLine, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("limit", "before")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    limit: int
    before: int
    def __init__(self, limit: _Optional[int] = ..., before: _Optional[int] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("seq", "at", "who", "action", "target", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: float
    who: str
    action: str
    target: str
    detail: str
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[float] = ..., who: _Optional[str] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class AuditLog(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ...) -> None: ...
