"""How a ``RemoteStrategy``'s calls reach its slice: the base class :class:`SliceCalls`.

It sends value-making operations on the slice's operation stream (predicting their
handles from templates when it can), and other calls as RPCs after the operations sent
before them; brings results back inline or streamed in chunks; defines functions on the
slice once (pickled by value); encodes arguments (uploading large arrays with ``Put``)
and decodes new values into handles; and lets what the handles' finalizers dropped
ride on the next call.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from google.protobuf.message import Message

from jaxpod import trees
from jaxpod.client import rpc
from jaxpod.client.handles import RemoteGlobalValue, RemotePerReplica, handle_signature
from jaxpod.client.stream import OpStream
from jaxpod.errors import (
    HandleError,
    MessageTooLargeError,
    SessionError,
    UnknownFunctionError,
)
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.shipping import ShippedFunction, ship
from jaxpod.types import ReduceOp

if TYPE_CHECKING:
    from jaxpod.client.client import Client

_T = TypeVar("_T")

#: Arrays larger than this are uploaded with ``Put`` instead of travelling inline.
UPLOAD_BYTES = 1024 * 1024
#: Function and dataset pickles above this are refused with advice.
MAX_PICKLE_BYTES = tensors.MAX_MESSAGE_BYTES - 1024 * 1024


def _thawed_result(chunks: Iterator[Any]) -> Any:
    return trees.thaw(tensors.read_result(chunks))


class SliceCalls:
    """The slice a strategy holds (``info``) and the calls to it, under the strategy's
    public methods (:class:`~jaxpod.client.remote.RemoteStrategy`)."""

    def __init__(self, client: Client, info: pb.SliceInfo, ops: OpStream | None) -> None:
        self._client = client
        self.info = info
        self.slice_id = info.slice_id
        # The slice's operation stream and templates, shared with with_steps_per_run's.
        self._ops = OpStream(client, info.slice_id) if ops is None else ops
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
        signatures, :func:`handle_signature`, and uploads) has: one replica's of each
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
        a call's outputs (:func:`handle_signature`), in the tree's order."""
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
                    handles.append(handle_signature(x))
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

    # ----------------------------------------------------------------- results
    def _fetch(self, value: RemotePerReplica | RemoteGlobalValue) -> np.ndarray:
        handles: list[Hashable] = []
        encoded, blobs = self._encode(value, "value", handles)
        result: np.ndarray = self._result(
            self._stub.Fetch, "fetch", pb.ValueRequest(**self._ids(), value=encoded), "fetch",
            self._result_bytes(handles, encoded, blobs, every_replica=True))
        return result

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


def _call_name(what: str, fn: Any) -> str:
    """``strategy.run(train_step)``: the call, for messages about it."""
    return f"strategy.{what}({getattr(fn, '__qualname__', type(fn).__name__)})"


def _check_size(shipped: ShippedFunction, what: str) -> None:
    if len(shipped.payload) > MAX_PICKLE_BYTES:
        raise MessageTooLargeError(
            f"{what} pickles to {len(shipped.payload)} bytes, over the "
            f"{MAX_PICKLE_BYTES}-byte limit. It probably captures a large array: pass "
            "that array as an argument instead (arguments are uploaded in chunks).")
