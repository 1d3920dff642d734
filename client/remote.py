"""``RemoteStrategy``: ``jaxpod.TPUStrategy``'s methods on a slice the service holds.

Step and dataset functions travel once, pickled by value (so functions from scripts,
notebooks and test modules work as they are), and are cached by the service by
content. Arguments travel as :mod:`jaxpod.proto.tensors` trees (any pytree: nodes
other than dicts, lists and tuples travel frozen, :mod:`jaxpod.trees`, and come back
as the same types); arrays larger than ``UPLOAD_BYTES`` are uploaded in chunks first.
Results of ``run`` stay on the workers as :class:`RemotePerReplica` handles (freed
when garbage-collected) in the structure the step function returned; bytes come back
only from ``reduce``, ``gather``, ``experimental_local_results`` and ``.array``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from google.protobuf.message import Message

from jaxpod import trees
from jaxpod.client import rpc
from jaxpod.client.stream import OpStream
from jaxpod.client.templates import signature, value_refs
from jaxpod.errors import (
    HandleError,
    MessageTooLargeError,
    SessionError,
    UnknownFunctionError,
)
from jaxpod.jobs import JobProfile, check_profile_seconds, check_spmd
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.proto.job_messages import from_message
from jaxpod.scope import current_strategy_stand_in, strategy_scope
from jaxpod.shipping import ShippedFunction, ship, ship_object
from jaxpod.tf_compat import TFCompatMixin
from jaxpod.types import InputOptions, ReduceOp
from jaxpod.values import DistributedDataset, DistributedIterator, PerReplica, padding_of

if TYPE_CHECKING:
    from jaxpod.client.client import Client

_T = TypeVar("_T")

#: Arrays larger than this are uploaded with ``Put`` instead of travelling inline.
UPLOAD_BYTES = 1024 * 1024
#: Function and dataset pickles above this are refused with advice.
MAX_PICKLE_BYTES = tensors.MAX_MESSAGE_BYTES - 1024 * 1024


class RemotePerReplica:
    """A ``PerReplica`` value held on a remote slice.

    Same attributes as :class:`jaxpod.PerReplica`: ``shape`` and ``dtype`` of one
    replica's (padded) component, ``valid_rows``, ``num_replicas``, ``padding``, and
    ``array`` (every replica's padded component stacked, fetched on first use).
    """

    __slots__ = ("__weakref__", "_array", "_strategy", "dtype", "id", "shape", "valid_rows")

    def __init__(self, strategy: RemoteStrategy, ref: pb.ValueRef) -> None:
        self._strategy = strategy
        self.id = int(ref.id)
        self.shape = tuple(int(d) for d in ref.shape)
        self.dtype = _dtype(ref.dtype)
        self.valid_rows = (np.asarray(ref.valid_rows, dtype=np.int64) if ref.has_valid_rows
                           else None)
        self._array: np.ndarray | None = None
        weakref.finalize(self, strategy._release, "value_ids", self.id)

    @property
    def num_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def array(self) -> np.ndarray:
        """All replicas' padded components, stacked (shape ``(replicas, *shape)``)."""
        if self._array is None:
            self._array = self._strategy._fetch(self)
        return self._array

    @property
    def padding(self) -> np.ndarray | None:
        return padding_of(self.shape, self.valid_rows)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self!r} lives on the service and cannot be pickled into a step function. "
            "Pass it to strategy.run(fn, args=(value,)) instead of capturing it.")

    def __repr__(self) -> str:
        rows = "" if self.valid_rows is None else f", valid_rows={self.valid_rows.tolist()}"
        return (f"RemotePerReplica(id={self.id}, shape={self.shape}, dtype={self.dtype}"
                f"{rows})")


PerReplica.register(RemotePerReplica)


class RemoteGlobalValue:
    """A global ``jax.Array`` held on a remote slice: what an ``strategy.spmd``
    function returns. ``shape`` and ``dtype`` are the whole array's; ``numpy()`` (or
    ``np.asarray(value)``) fetches it. Pass it to the next spmd function as it is: it
    stays on the devices with its sharding."""

    __slots__ = ("__weakref__", "_strategy", "dtype", "id", "shape")

    def __init__(self, strategy: RemoteStrategy, ref: pb.ValueRef) -> None:
        self._strategy = strategy
        self.id = int(ref.id)
        self.shape = tuple(int(d) for d in ref.shape)
        self.dtype = _dtype(ref.dtype)
        weakref.finalize(self, strategy._release, "value_ids", self.id)

    def numpy(self) -> np.ndarray:
        """The whole array, fetched from the slice."""
        return self._strategy._fetch(self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self!r} lives on the service and cannot be pickled into a function. Pass "
            "it as an argument of the spmd function instead of capturing it.")

    def __repr__(self) -> str:
        return f"RemoteGlobalValue(id={self.id}, shape={self.shape}, dtype={self.dtype})"


class SpmdFunction:
    """``strategy.spmd(fn, mesh=...)``: calling it runs ``fn(*args, **kwargs)`` as one
    ``jax.jit`` program over the slice's mesh and returns :class:`RemoteGlobalValue`
    handles in ``fn``'s output structure."""

    def __init__(self, strategy: RemoteStrategy, fn: Callable[..., Any],
                 mesh: dict[str, int], batch_sharding: Any) -> None:
        self._strategy = strategy
        self.fn = fn
        self.mesh = mesh
        self.batch_sharding = batch_sharding
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._strategy._run_spmd(self, args, kwargs)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"SpmdFunction({name}, mesh={self.mesh})"


def _dtype(name: str) -> Any:
    """A value's dtype: numpy's, or the name of a JAX-only one (``key<fry>``)."""
    try:
        return tensors.dtype_from_name(name)
    except ValueError:
        return name


def _thawed_result(chunks: Iterator[Any]) -> Any:
    return trees.thaw(tensors.read_result(chunks))


class RemoteStrategy(TFCompatMixin):
    """``jaxpod.TPUStrategy``'s methods, run by a slice's host workers.

    Get one from :meth:`jaxpod.client.Client.strategy`; it holds its slice until
    closed (use it as a context manager). TF1's and TF 1.x's members and ``extended``
    come from :mod:`jaxpod.tf_compat`, as on the in-process strategy.
    """

    #: The service resolved the cluster and allocated the slice (``info``); the client
    #: holds no resolver object, as an in-process strategy made without one.
    cluster_resolver: Any = None

    def __init__(self, client: Client, info: pb.SliceInfo, steps_per_run: int,
                 computation_shape: Sequence[int] | None = None,
                 owns_slice: bool = True, ops: OpStream | None = None) -> None:
        self._client = client
        self.info = info
        self.slice_id = info.slice_id
        # The slice's operation stream and templates, shared with with_steps_per_run's.
        self._ops = OpStream(client, info.slice_id) if ops is None else ops
        self.steps_per_run = steps_per_run
        self._computation_shape = list(computation_shape or ())
        self._owns_slice = owns_slice
        self._closed = False
        self._functions: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._dropped = pb.Dropped()
        # What finalizers dropped, not yet in _dropped: a finalizer can run on any
        # thread at any allocation, also while this thread holds _lock, so it only
        # appends here (deque appends need no lock) and calls drain it under the lock.
        self._released: collections.deque[tuple[str, int]] = collections.deque()

    # ------------------------------------------------------------ properties
    @property
    def num_replicas_in_sync(self) -> int:
        return int(self.info.num_replicas)

    @property
    def num_hosts(self) -> int:
        return int(self.info.num_hosts)

    @property
    def closed(self) -> bool:
        return self._closed or self._client.closed

    def with_steps_per_run(self, steps_per_run: int) -> RemoteStrategy:
        """Another strategy on the same slice with a different default steps per run.

        It does not own the slice: closing it leaves the slice to this strategy.
        """
        return RemoteStrategy(self._client, self.info, steps_per_run,
                              self._computation_shape, owns_slice=False, ops=self._ops)

    # ------------------------------------------------------------------- calls
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise SessionError(
                f"{what}: this strategy is closed (its slice was released). Create a new "
                "one with client.strategy(...).")

    @property
    def _stub(self) -> Any:
        return self._client.stub

    def _call(self, rpc: Any, request: Any, what: str, idempotent: bool = False) -> Any:
        """Calls ``rpc`` (a method of the client's stub) on behalf of ``what``, after
        the operations sent before it (what it drops may be their inputs)."""
        self._check_open(what)
        self._ops.drain()
        with self._dropped_riding(request):
            return self._client.call(rpc, request, what=what, idempotent=idempotent)

    def _result(self, rpc: Any, kind: str, request: Any, what: str, size: float) -> Any:
        """Returns the result of ``request``, runs after the operations sent before it.
        One of at most ``INLINE_BYTES`` (``size``: its bound, :meth:`_result_bytes`)
        is a ``kind`` operation on the slice's stream: one message each way. A larger
        one streams from the ``rpc`` (a method of the stub) in chunks; the service runs
        it after ``after_op``. Either way it goes without waiting for the earlier
        operations' answers. A synchronising call: a failure of an operation sent
        before it raises here, in place of its own result or error."""
        self._check_open(what)
        try:
            with self._dropped_riding(request):
                if size <= tensors.INLINE_BYTES:
                    op, _ = self._ops.send(kind, request, what)
                else:
                    request.after_op = self._ops.last_op
                    return self._synced(
                        self._client.stream(rpc, request, _thawed_result, what=what), what)
            return self._synced(trees.thaw(tensors.decode(self._ops.result(op))), what)
        except Exception:
            self._ops.sync(what)  # the failure that caused this one, if any, first
            raise

    def _synced(self, result: _T, what: str) -> _T:
        self._ops.sync(what)
        return result

    def _result_bytes(self, handles: Sequence[Any], tree: pb.Tree, blobs: list[int],
                      every_replica: bool) -> float:
        """At most how many bytes the result of a call on ``tree`` (with these handle
        signatures, :func:`_handle_signature`, and uploads) has: one replica's of each
        value for a reduce, every replica's (``every_replica``) for the others."""
        if blobs:
            return math.inf
        replicas = self.num_replicas_in_sync if every_replica else 1
        total = float(tree.ByteSize() * replicas)
        for kind, shape, dtype, *_ in handles:
            try:
                itemsize = tensors.dtype_from_name(dtype).itemsize
            except (TypeError, ValueError):  # a JAX-only dtype (PRNG keys)
                return math.inf
            total += math.prod(shape) * itemsize * (replicas if kind == "per_replica" else 1)
        return total

    def _dispatch(self, kind: str, request: Any, what: str, key: Hashable | None, *,
                  may_predict: bool = True,
                  is_template: Callable[[pb.Tree], bool] = lambda outputs: True,
                  on_success: Callable[[pb.SliceReply], None] | None = None) -> Any:
        """Sends a value-making operation (``kind``: a ``SliceOp`` body) on the slice's
        stream; returns its values. With a template for ``key`` (and asynchronous
        dispatch on, and ``may_predict``) it returns the predicted handles at once; else
        it waits, and outputs that pass ``is_template`` become ``key``'s template."""
        self._check_open(what)
        ops = self._ops
        predict = (ops.templates.predictor(key)
                   if key is not None and may_predict and ops.asynchronous else None)

        def on_failure(failure: Any) -> None:
            if failure.is_prediction_error():
                ops.templates.forget(key)

        with self._dropped_riding(request):
            op, expected = ops.send(kind, request, what, predict, on_failure, on_success)
        if expected is not None:
            return self._values(expected)
        outputs = ops.result(op)
        if key is not None and is_template(outputs):
            ops.templates.record(key, outputs)
        return self._values(outputs)

    def _dispatch_defined(self, fn: Callable[..., Any], kind: str, request: Any, what: str,
                          key: Callable[[str], Hashable | None]) -> Any:
        """:meth:`_dispatch` with ``request.function_id`` set to ``fn``'s id (``key``:
        the template key for that id), through :meth:`_with_defined`."""
        call = _call_name(what, fn)

        def dispatch(function_id: str) -> Any:
            request.function_id = function_id
            return self._dispatch(kind, request, call, key(function_id))

        return self._with_defined(fn, what, dispatch)

    def _with_defined(self, fn: Callable[..., Any], what: str,
                      use: Callable[[str], _T]) -> _T:
        """``use(fn's id)``. The workers keep functions in a bounded cache: if they
        evicted this one since it was defined, it is defined again and ``use`` called
        once more (nothing ran the first time)."""
        try:
            return use(self._define(fn, what))
        except UnknownFunctionError:
            with contextlib.suppress(KeyError, TypeError):
                del self._functions[fn]
            return use(self._define(fn, what))

    def _ids(self) -> Any:  # the two ids every slice request starts with
        return {"session_id": self._client.session_id, "slice_id": self.slice_id}

    # -------------------------------------------------------------- functions
    def _define(self, fn: Callable[..., Any], what: str) -> str:
        try:
            return self._functions[fn]
        except (KeyError, TypeError):
            pass
        shipped = ship(fn)
        _check_size(shipped, f"{what}: the function {getattr(fn, '__qualname__', fn)!r}")
        reply = self._call(self._stub.DefineFunction, pb.DefineFunctionRequest(
            **self._ids(), payload=shipped.payload, runtime_versions=shipped.versions),
            what, idempotent=True)
        with contextlib.suppress(TypeError):  # not weak-referenceable: define again next time
            self._functions[fn] = reply.function_id
        return str(reply.function_id)

    def _encode(self, value: Any, path: str, handles: list[Hashable] | None = None
                ) -> tuple[pb.Tree, list[int]]:
        """``value`` as a tree; large arrays uploaded (their blob ids returned). Each
        handle in it travels as its id alone; ``handles`` gets what else of it shapes
        a call's outputs (:func:`_handle_signature`), in the tree's order."""
        blobs: list[int] = []

        def leaf(x: Any, where: str) -> Any:
            if isinstance(x, RemotePerReplica | RemoteGlobalValue):
                if x._strategy.slice_id != self.slice_id:
                    kind = (f"a PerReplica value of a strategy with {x.num_replicas} replicas"
                            if isinstance(x, RemotePerReplica) else "a global value of a strategy")
                    raise HandleError(
                        f"{where} is {kind} on slice {x._strategy.slice_id}, not of this strategy "
                        f"({self.num_replicas_in_sync} replicas on {self.slice_id}). Values "
                        "cannot move between strategies; fetch it and pass the array "
                        "instead.")
                self._ops.check_usable(x.id, where)
                if handles is not None:
                    handles.append(_handle_signature(x))
                return pb.Tree(value=pb.ValueRef(id=x.id, slice_id=self.slice_id))
            if isinstance(x, ReduceOp):
                return pb.Tree(str_value=x.value)
            if (isinstance(x, np.ndarray) or tensors._is_jax_array(x)) and \
                    x.nbytes > UPLOAD_BYTES:
                blob = self._put(tensors.wire_array(x, where))
                blobs.append(blob)
                return pb.Tree(blob=blob)
            return tensors.NOT_HANDLED

        try:
            return tensors.encode(value, leaf, path), blobs
        except BaseException:
            self._release_blobs(blobs)
            raise

    def _put(self, array: np.ndarray) -> int:
        """Uploads ``array`` (in the wire's layout: :func:`tensors.wire_array`)."""
        flat = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]

        def chunks() -> Iterator[pb.TensorChunk]:
            yield pb.TensorChunk(session_id=self._client.session_id, dtype=array.dtype.name,
                                 shape=array.shape, data=bytes(flat[:tensors.CHUNK_BYTES]))
            for start in range(tensors.CHUNK_BYTES, len(flat), tensors.CHUNK_BYTES):
                yield pb.TensorChunk(data=bytes(flat[start:start + tensors.CHUNK_BYTES]))

        reply = self._call(self._stub.Put, chunks(), "upload")
        return int(reply.blob)

    def _release_blobs(self, blobs: list[int]) -> None:
        if blobs and not self.closed:
            self._client.call(self._client.stub.Free, pb.FreeRequest(**self._ids(), blobs=blobs),
                              what="free", idempotent=True, timeout=rpc.CONTROL_TIMEOUT)

    def _values(self, tree: pb.Tree) -> Any:
        def leaf(node: pb.Tree) -> Any:
            if node.value.global_view:
                return RemoteGlobalValue(self, node.value)
            return RemotePerReplica(self, node.value)

        return trees.thaw(tensors.decode(tree, leaf))

    # --------------------------------------------------------------------- run
    def run(self, fn: Callable[..., Any], args: Any = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once per replica on the slice; returns ``PerReplica`` handles."""
        self._define(fn, "run")  # the function's errors first
        return self._run(fn, "run", args, kwargs)

    def _run(self, fn: Callable[..., Any], what: str, args: Any, kwargs: Any,
             **fields: Any) -> Any:
        """The ``run`` operation of ``run`` and of spmd functions (``fields``: the mesh)."""
        handles: list[Hashable] = []
        encoded_args, blobs = self._encode(args, "args", handles)
        try:
            encoded_kwargs, more = self._encode(kwargs, "kwargs", handles)
            blobs += more
            request = pb.RunRequest(**self._ids(), args=encoded_args, kwargs=encoded_kwargs,
                                    **fields)
            shape = None if blobs else signature(request.args, request.kwargs,
                                                 request.batch_sharding, handles=handles)

            def key(function_id: str) -> Hashable | None:
                return None if shape is None else (
                    "run", function_id, shape, tuple(request.mesh_axes),
                    tuple(request.mesh_shape))

            return self._dispatch_defined(fn, "run", request, what, key)
        finally:
            self._release_blobs(blobs)

    def spmd(self, fn: Callable[..., Any], *, mesh: dict[str, int] | None = None,
             batch_sharding: Any = None) -> SpmdFunction:
        """``fn`` as a global-view program over the slice, to call interactively: what a
        job submitted with ``mesh=`` runs, step by step (DESIGN §8).

        Each call runs ``fn(*args, **kwargs)`` under ``jax.jit`` over a mesh of ``mesh``
        (axis names to sizes; one may be -1; default ``{"data": -1}``), with
        ``jaxpod.mesh()`` and the current mesh set, so bare ``PartitionSpec`` s work.
        Results stay on the devices as :class:`RemoteGlobalValue` handles, each with the
        sharding ``fn`` gave it; pass them to the next call, and fetch one with
        ``.numpy()`` (or ``np.asarray``). Host arrays among the
        arguments are split by ``batch_sharding`` (one ``PartitionSpec``; default:
        rows over the mesh's first axis where they divide, else replicated).
        """
        axes, spec = check_spmd(fn, mesh, batch_sharding)
        self._define(fn, "spmd")  # the function's errors first
        return SpmdFunction(self, fn, axes, spec)

    def _run_spmd(self, spmd: SpmdFunction, args: Any, kwargs: Any) -> Any:
        spec = None if spmd.batch_sharding is None else tuple(spmd.batch_sharding)
        return self._run(spmd.fn, "spmd", args, kwargs, mesh_axes=list(spmd.mesh),
                         mesh_shape=list(spmd.mesh.values()),
                         batch_sharding=tensors.encode(spec, path="batch_sharding"))

    def run_steps(self, fn: Callable[..., Any], iterator: Any, steps: int | None = None,
                  initial_state: Any = None) -> Any:
        """Runs ``steps`` (default ``steps_per_run``) steps in one on-device loop."""
        k = self.steps_per_run if steps is None else steps
        self._define(fn, "run_steps")  # the function's errors first
        handles: list[Hashable] = []
        state, blobs = self._encode(initial_state, "initial_state", handles)
        request = pb.RunStepsRequest(**self._ids(), steps=tensors.encode(k, path="steps"),
                                     initial_state=state)
        try:
            if isinstance(iterator, RemoteIterator) and iterator._strategy.slice_id == \
                    self.slice_id:
                request.iterator_id = iterator.id
                if isinstance(k, int):
                    iterator.took(k)
            else:
                # Any other iterator of values: take the steps' elements here, as the
                # in-process engine would (none if ``steps`` is invalid: the engine says so).
                valid = isinstance(k, int) and not isinstance(k, bool) and k > 0
                items, more = self._encode(list(itertools.islice(iterator, k if valid else 0)),
                                           "iterator", handles)
                blobs += more
                request.has_items = True
                request.items.CopyFrom(items)
            # Over a remote iterator the outputs depend on how much input is left: the
            # call waits for its reply.
            shape = None if blobs or not request.has_items else signature(
                request.steps, request.initial_state, request.items, handles=handles)

            def key(function_id: str) -> Hashable | None:
                return None if shape is None else ("run_steps", function_id, shape)

            return self._dispatch_defined(fn, "run_steps", request, "run_steps", key)
        finally:
            self._release_blobs(blobs)

    # ----------------------------------------------------------------- results
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Any = None, *,
               destinations: Any = None) -> Any:
        """Reduces across replicas (and ``axis``); returns numpy. TF1's form with
        ``destinations`` works as on ``jaxpod.TPUStrategy``."""
        return self._reduce_tf1(self._reduce, reduce_op, value, axis, destinations)

    def _reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None) -> Any:
        handles: list[Hashable] = []
        encoded, blobs = self._encode(value, "value", handles)
        try:
            return self._result(self._stub.Reduce, "reduce", pb.ReduceRequest(
                **self._ids(), reduce_op=self._encode(reduce_op, "reduce_op")[0],
                value=encoded, axis=tensors.encode(axis, path="axis")), "reduce",
                self._result_bytes(handles, encoded, blobs, every_replica=False))
        finally:
            self._release_blobs(blobs)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along ``axis``; returns numpy."""
        handles: list[Hashable] = []
        encoded, blobs = self._encode(value, "value", handles)
        try:
            return self._result(self._stub.Gather, "gather", pb.GatherRequest(
                **self._ids(), value=encoded, axis=tensors.encode(axis, path="axis")),
                "gather", self._result_bytes(handles, encoded, blobs, every_replica=True))
        finally:
            self._release_blobs(blobs)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """Every replica's value (numpy), padding rows dropped, in replica order; a
        value with no per-replica leaf (global arrays, host values) is one value:
        ``(value,)``, as TF gives for a value that is not distributed."""
        import jax  # the user's pytrees: jax is loaded where they were made

        leaves = jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, RemotePerReplica))
        if not any(isinstance(v, RemotePerReplica) for v in leaves):
            return (value,)
        handles: list[Hashable] = []
        encoded, blobs = self._encode(value, "value", handles)
        try:
            return tuple(self._result(
                self._stub.LocalResults, "local_results",
                pb.ValueRequest(**self._ids(), value=encoded), "experimental_local_results",
                self._result_bytes(handles, encoded, blobs, every_replica=True)))
        finally:
            self._release_blobs(blobs)

    def _fetch(self, value: RemotePerReplica | RemoteGlobalValue) -> np.ndarray:
        handles: list[Hashable] = []
        encoded, blobs = self._encode(value, "value", handles)
        result: np.ndarray = self._result(
            self._stub.Fetch, "fetch", pb.ValueRequest(**self._ids(), value=encoded), "fetch",
            self._result_bytes(handles, encoded, blobs, every_replica=True))
        return result

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[..., Any]) -> Any:
        """Calls ``value_fn(ValueContext)`` on the workers, once per replica."""
        what = "experimental_distribute_values_from_function"
        return self._dispatch_defined(value_fn, "distribute_values",
                                      pb.DistributeValuesRequest(**self._ids()), what,
                                      lambda function_id: ("values", function_id))

    # ------------------------------------------------------------------- input
    def experimental_distribute_dataset(self, dataset: Iterable[Any],
                                        options: InputOptions | None = None
                                        ) -> RemoteDataset:
        """Ships ``dataset`` (pickled by value) to the workers, which rebatch it."""
        what = "experimental_distribute_dataset"
        shipped = ship_object(dataset, f"the dataset ({type(dataset).__name__})",
                              "Pass a list of batches, or use distribute_datasets_from_function "
                              "to build the dataset on the workers.")
        request = pb.DistributeDatasetRequest(**self._ids(),
                                              options=self._options(options),
                                              runtime_versions=shipped.versions)
        blobs: list[int] = []
        if len(shipped.payload) > UPLOAD_BYTES:
            blobs.append(self._put(np.frombuffer(shipped.payload, dtype=np.uint8)))
            request.dataset_blob = blobs[0]
        else:
            request.dataset = shipped.payload
        try:
            reply = self._call(self._stub.DistributeDataset, request, what)
        finally:
            self._release_blobs(blobs)
        return RemoteDataset(self, int(reply.dataset_id))

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any],
                                          options: InputOptions | None = None
                                          ) -> RemoteDataset:
        """Calls ``dataset_fn(InputContext)`` on each host of the slice."""
        what = "distribute_datasets_from_function"
        request = pb.DistributeDatasetRequest(**self._ids(), options=self._options(options),
                                              runtime_versions=self._client.runtime_versions)

        def distribute(function_id: str) -> Any:
            request.function_id = function_id
            return self._call(self._stub.DistributeDataset, request, what)

        reply = self._with_defined(dataset_fn, what, distribute)
        return RemoteDataset(self, int(reply.dataset_id))

    def _options(self, options: InputOptions | None) -> bytes:
        if options is None:
            return b""
        return ship_object(options, "the input options", "Pass a jaxpod.InputOptions.").payload

    # --------------------------------------------------------- logical devices
    def experimental_split_to_logical_devices(self, tensor: Any,
                                              partition_dimensions: Sequence[int]) -> Any:
        return self._annotation("experimental_split_to_logical_devices", tensor)

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        return self._annotation("experimental_replicate_to_logical_devices", tensor)

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        return self._annotation("experimental_assign_to_logical_device", tensor)

    def _annotation(self, what: str, tensor: Any) -> Any:
        # Inside a step function this object is the worker's engine (see __reduce__);
        # here, on the client, there is nothing to place unless replicas span devices.
        if not self._computation_shape or all(d == 1 for d in self._computation_shape):
            return tensor
        raise RuntimeError(f"{what} annotates values inside a step function; call it "
                           "from the function you pass to strategy.run.")

    # -------------------------------------------------------------------- scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[RemoteStrategy]:
        """Makes this the current strategy (``jaxpod.get_strategy()``)."""
        with strategy_scope(self):
            yield self

    # ---------------------------------------------------------------- lifetime
    def _release(self, kind: str, object_id: int) -> None:
        """Queues a dropped value/iterator/dataset (``kind``: a ``Dropped`` field) to be
        freed with the next call; a finalizer must not make calls, nor take locks."""
        self._released.append((kind, object_id))

    def _take_released(self) -> None:
        """Moves what finalizers queued into ``_dropped`` (the caller holds _lock)."""
        while self._released:
            kind, object_id = self._released.popleft()
            getattr(self._dropped, kind).append(object_id)

    @contextlib.contextmanager
    def _dropped_riding(self, request: Any) -> Iterator[None]:
        """Moves what was dropped since the previous call into ``request`` (every slice
        request message has a ``dropped`` field; an upload stream is no message), and
        back if the call fails: it may not have reached the service, and dropping the
        same ids twice is harmless there."""
        if not isinstance(request, Message):
            yield
            return
        with self._lock:
            self._take_released()
            if self._dropped.ByteSize():
                request.dropped.CopyFrom(self._dropped)
                self._dropped.Clear()
        try:
            yield
        except BaseException:
            with self._lock:
                self._dropped.MergeFrom(request.dropped)
            raise

    def stats(self) -> list[dict[str, Any]]:
        """Each host's live values, device bytes and iterators (frees pending first), and
        the seconds it spent running operations (``busy_s``, over ``operations``): the
        work measured inside the workers, without the time spent reaching them; and the
        seconds its steps waited for input (``input_wait_s``) and the chunks of steps its
        infeeds have ready (``input_queue_depth``)."""
        reply = self._call(self._stub.SliceStats, pb.SliceRequest(**self._ids()), "stats",
                           idempotent=True)
        return [{f.name: getattr(h, f.name) for f in h.DESCRIPTOR.fields}
                for h in reply.hosts]

    def profile(self, seconds: float = 60.0) -> SliceProfile:
        """A ``jax.profiler`` trace of every host of the slice, as a context manager:
        the trace starts when the ``with`` block starts (after the operations sent
        before it) and ends when it ends (after the operations sent in it), or after
        ``seconds``, whichever comes first::

            with strategy.profile() as traced:
                for _ in range(10):
                    state, loss = strategy.run(step, args=(state, next(iterator)))
            print(traced.result.path)   # one host-<i>/ per host, TensorBoard's layout

        The hosts write it under the service's checkpoint dir
        (``sessions/<session>/profiles/<time>/``); ``result`` is a
        :class:`jaxpod.JobProfile` once the block ended.
        """
        return SliceProfile(self, check_profile_seconds(seconds))

    def _profile(self, seconds: float, stop: bool) -> JobProfile:
        request = pb.ProfileSliceRequest(**self._ids(), seconds=seconds, stop=stop)
        return from_message(JobProfile, self._call(self._stub.ProfileSlice, request,
                                                   "profile"))

    def close(self) -> None:
        """Waits for the operations sent, releases the slice (every value on it goes
        with it), then raises the failure of an asynchronous operation not raised yet,
        if any. Idempotent."""
        if self._closed:
            return
        deferred: BaseException | None = None
        if not self._client.closed:
            try:
                self._ops.sync("close")
            except Exception as e:  # raised once the slice is released
                deferred = e
        self._closed = True
        if self._owns_slice:
            self._ops.close()
            if not self._client.closed:
                self._client.call(self._client.stub.ReleaseSlice,
                                  pb.SliceRequest(**self._ids()), what="close",
                                  idempotent=True)
        if deferred is not None:
            raise deferred

    def __enter__(self) -> RemoteStrategy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:  # the exception in flight stays the one raised
            self.close()
        except Exception as e:
            exc.add_note(f"jaxpod: closing the strategy also raised {type(e).__name__}: {e}")

    def __reduce__(self) -> Any:
        # A step function that captured this strategy gets the worker's engine.
        return (current_strategy_stand_in, ())

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.slice_id
        return (f"RemoteStrategy({self.info.accelerator_type}, "
                f"replicas={self.num_replicas_in_sync}, hosts={self.num_hosts}, "
                f"steps_per_run={self.steps_per_run}, {state})")


def _handle_signature(x: RemotePerReplica | RemoteGlobalValue) -> Hashable:
    """What of a handle argument shapes a call's outputs: its kind, shape, dtype and
    valid rows (kept here: the wire carries only its id)."""
    if isinstance(x, RemoteGlobalValue):
        return ("global", x.shape, trees.dtype_name(x.dtype))
    valid = None if x.valid_rows is None else tuple(x.valid_rows.tolist())
    return ("per_replica", x.shape, trees.dtype_name(x.dtype), valid)


def _call_name(what: str, fn: Any) -> str:
    """``strategy.run(train_step)``: the call, for messages about it."""
    return f"strategy.{what}({getattr(fn, '__qualname__', type(fn).__name__)})"


def _check_size(shipped: ShippedFunction, what: str) -> None:
    if len(shipped.payload) > MAX_PICKLE_BYTES:
        raise MessageTooLargeError(
            f"{what} pickles to {len(shipped.payload)} bytes, over the "
            f"{MAX_PICKLE_BYTES}-byte limit. It probably captures a large array: pass "
            "that array as an argument instead (arguments are uploaded in chunks).")


class RemoteDataset(DistributedDataset):
    """A dataset distributed over a remote slice's hosts; iterate it once per epoch."""

    def __init__(self, strategy: RemoteStrategy, dataset_id: int) -> None:
        self._strategy = strategy
        self.id = dataset_id
        weakref.finalize(self, strategy._release, "dataset_ids", dataset_id)

    def __iter__(self) -> RemoteIterator:
        s = self._strategy
        reply = s._call(s._stub.CreateIterator, pb.IteratorRequest(
            **s._ids(), id=self.id, steps_per_run=s.steps_per_run), "iter(dataset)")
        return RemoteIterator(s, int(reply.iterator_id))


class RemoteIterator(DistributedIterator):
    """Yields one step of input per ``next``; its infeeds run on the workers.

    ``next`` returns at once while the workers have said that the step is ready in
    full (each answer says how many full steps follow it): such a step cannot end
    the input, and its handles are those of any full step. Past that it waits for
    its answer, so the end of the input raises ``EndOfDataError`` at the ``next``
    that ran past it, as the dataset's own error does.
    """

    def __init__(self, strategy: RemoteStrategy, iterator_id: int) -> None:
        self._strategy = strategy
        self.id = iterator_id
        self._taken = 0  # steps asked for, by next and run_steps
        self._full_until = 0  # steps up to this count are known ready in full
        weakref.finalize(self, strategy._release, "iterator_ids", iterator_id)

    def __iter__(self) -> RemoteIterator:
        return self

    def __next__(self) -> Any:
        s = self._strategy  # at the end, the call raises EndOfDataError (a StopIteration)
        self._taken += 1
        step = self._taken

        def ready(reply: pb.SliceReply) -> None:  # on the stream's reader thread
            self._full_until = max(self._full_until, step + reply.full_steps_ahead)

        return s._dispatch("next", pb.IteratorRequest(**s._ids(), id=self.id),
                           "next(iterator)", ("next", self.id),
                           may_predict=step <= self._full_until, is_template=_is_full,
                           on_success=ready)

    def took(self, steps: int) -> None:
        """Counts steps that ``run_steps`` asked for (up to ``steps`` were taken)."""
        self._taken += steps


def _is_full(outputs: pb.Tree) -> bool:
    """Whether a step's input has every row of every replica (what a step that the
    workers reported ready in full looks like)."""
    return not any(ref.has_valid_rows and any(v != ref.shape[0] for v in ref.valid_rows)
                   for ref in value_refs(outputs))


class SliceProfile:
    """``strategy.profile()``: starts the hosts' trace on entering, ends it on leaving;
    ``result`` is the :class:`jaxpod.JobProfile` then."""

    def __init__(self, strategy: RemoteStrategy, seconds: float) -> None:
        self._strategy = strategy
        self.seconds = seconds
        #: Where the trace goes (its folder), once started.
        self.started: JobProfile | None = None
        #: The trace written, once the block ended.
        self.result: JobProfile | None = None

    def __enter__(self) -> SliceProfile:
        self.started = self._strategy._profile(self.seconds, stop=False)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        # The block's own error goes first: ending the trace may fail for its cause.
        with contextlib.suppress(Exception) if kind is not None else contextlib.nullcontext():
            self.result = self._strategy._profile(0.0, stop=True)
