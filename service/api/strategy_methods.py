"""The strategy methods' own RPCs: everything of a slice but the operation stream.

:class:`StrategyMethodsServicer` (a mixin of ``CoordinatorService``) defines
functions, takes uploads (``Put``), distributes datasets and makes their iterators,
streams large results in chunks once the operation stream applied the operation the
client sent before them (``Reduce``, ``Gather``, ``LocalResults``, ``Fetch``), and frees,
measures and profiles what the slice holds.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from jaxpod.errors import MessageTooLargeError
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import job_messages, tensors
from jaxpod.service.api.engine_calls import EngineCalls, dropped
from jaxpod.service.sessions import Session, SessionManager
from jaxpod.service.slices.group_handles import DefinedFunction
from jaxpod.service.slices.held import HeldSlice
from jaxpod.service.slices.profiles import SliceProfiler
from jaxpod.shipping import ShippedFunction
from jaxpod.storage import join

_T = TypeVar("_T")
#: A result stream: the skeleton message, then data chunks already serialized.
ResultStream = AsyncIterator[pb.ResultChunk | bytes]
#: The most bytes one Put may upload (a tensor argument); it streams in chunks.
MAX_UPLOAD_BYTES = 4 * 1024 * 1024 * 1024


class StrategyMethodsServicer(EngineCalls):
    """``DefineFunction`` ... ``ProfileSlice`` but ``Stream``; the class using it
    provides ``sessions``, ``checkpoint_dir``, ``check_session``, ``_blocking``,
    ``_stream``, ``_slice`` and ``_after``."""

    sessions: SessionManager
    checkpoint_dir: str

    if TYPE_CHECKING:
        def check_session(self, request: Any, context: Any) -> None: ...

        async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T: ...

        def _stream(self, compute: Callable[[], Any]) -> ResultStream: ...

        def _slice(self, request: Any, drop: bool = True) -> tuple[Session, HeldSlice]: ...

        def _after(self, request: Any) -> tuple[Session, HeldSlice]: ...

    # ------------------------------------------------------- functions and inputs
    async def DefineFunction(self, request: pb.DefineFunctionRequest, context: Any
                             ) -> pb.DefineFunctionResponse:
        _, held = self._slice(request)
        shipped = ShippedFunction(request.payload, dict(request.runtime_versions))
        defined = await self._blocking(held.engine.define, shipped)
        return pb.DefineFunctionResponse(function_id=defined.id)

    async def Put(self, request_iterator: AsyncIterator[pb.TensorChunk], context: Any
                  ) -> pb.PutResponse:
        first: pb.TensorChunk | None = None
        parts: list[bytes] = []
        size = declared = 0
        async for chunk in request_iterator:
            if first is None:  # refused before any more of it is read
                first = chunk
                self.check_session(first, context)
                self.sessions.get(first.session_id)
                declared = _upload_size(first)
            size += len(chunk.data)
            if size > declared:
                raise ValueError(
                    f"Put: the upload sends more than the {declared} bytes its dtype "
                    f"{first.dtype} and shape {list(first.shape)} hold.")
            parts.append(chunk.data)
        if first is None:
            raise ValueError("Put: the upload stream was empty.")
        session = self.sessions.get(first.session_id)
        array = tensors.from_tensor(pb.Tensor(dtype=first.dtype, shape=first.shape,
                                              data=b"".join(parts)))
        return pb.PutResponse(blob=session.add_blob(array))

    async def DistributeDataset(self, request: pb.DistributeDatasetRequest, context: Any
                                ) -> pb.DatasetResponse:
        session, held = self._slice(request)
        source = request.WhichOneof("source")
        versions = dict(request.runtime_versions)
        options = ShippedFunction(request.options, versions) if request.options else None
        if source == "function_id":
            dataset = await self._blocking(held.engine.distribute_datasets_from_function,
                                           DefinedFunction(request.function_id), options)
        else:
            payload = (request.dataset if source == "dataset"
                       else session.blob(request.dataset_blob).tobytes())
            dataset = await self._blocking(held.engine.experimental_distribute_dataset,
                                           ShippedFunction(payload, versions), options)
        held.datasets[dataset.id] = dataset
        return pb.DatasetResponse(dataset_id=dataset.id)

    async def CreateIterator(self, request: pb.IteratorRequest, context: Any
                             ) -> pb.IteratorResponse:
        _, held = self._slice(request)
        dataset = held.dataset(request.id)
        iterator = await self._blocking(dataset.iterate, request.steps_per_run or None)
        held.iterators[iterator.id] = iterator
        return pb.IteratorResponse(iterator_id=iterator.id)

    # ------------------------------------------------------------ streamed results
    def _result_stream(self, compute: Callable[[Session, HeldSlice, Any], Any], request: Any
                       ) -> ResultStream:
        """``compute``'s result, streamed, once the op stream applied ``after_op``."""
        def run() -> Any:
            session, held = self._after(request)
            return compute(session, held, request)

        return self._stream(run)

    def Reduce(self, request: pb.ReduceRequest, context: Any) -> ResultStream:
        return self._result_stream(self._reduce_in_parts, request)

    def Gather(self, request: pb.GatherRequest, context: Any) -> ResultStream:
        return self._result_stream(self._gather_in_parts, request)

    def LocalResults(self, request: pb.ValueRequest, context: Any) -> ResultStream:
        return self._result_stream(self._local_results_in_parts, request)

    def Fetch(self, request: pb.ValueRequest, context: Any) -> ResultStream:
        return self._result_stream(self._fetch_in_parts, request)

    # ---------------------------------------------------- what the slice holds
    async def Free(self, request: pb.FreeRequest, context: Any) -> pb.Empty:
        session = self.sessions.get(request.session_id)
        for blob in request.blobs:
            session.blobs.pop(blob, None)
        held = session.slices.get(request.slice_id)
        if held is not None:  # else released already: everything on it is gone
            held.drop(dropped(request.dropped))
        return pb.Empty()

    async def SliceStats(self, request: pb.SliceRequest, context: Any
                         ) -> pb.SliceStatsResponse:
        _, held = self._slice(request)
        stats = await self._blocking(held.engine.stats)
        return pb.SliceStatsResponse(hosts=[pb.HostStats(**s) for s in stats])

    async def ProfileSlice(self, request: pb.ProfileSliceRequest, context: Any
                           ) -> pb.JobProfile:
        session, held = self._slice(request)
        if held.profiler is None:
            held.profiler = SliceProfiler(join(self.checkpoint_dir, "sessions",
                                               tensors.holder_label(session.id)))
        if request.stop:
            profile = await self._blocking(held.profiler.stop, held.engine.stop_profile)
        else:
            profile = await self._blocking(held.profiler.start, held.engine.start_profile,
                                           request.seconds)
        return job_messages.to_message(profile)


def _upload_size(first: pb.TensorChunk) -> int:
    """The bytes an upload's first chunk declares (its dtype and shape), refused over
    ``MAX_UPLOAD_BYTES`` before the rest is read."""
    if any(d < 0 for d in first.shape):
        raise ValueError(f"Put: the upload's shape {list(first.shape)} has a negative "
                         "dimension.")
    # Python integers: a hostile shape must not wrap around in int64.
    declared = math.prod(first.shape) * tensors.dtype_from_name(first.dtype).itemsize
    if declared > MAX_UPLOAD_BYTES:
        raise MessageTooLargeError(
            f"Put: the upload declares {declared} bytes (dtype {first.dtype}, shape "
            f"{list(first.shape)}), over the {MAX_UPLOAD_BYTES}-byte limit; split the "
            "tensor into several arguments.")
    return declared
