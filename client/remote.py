"""``RemoteStrategy``: ``jaxpod.TPUStrategy``'s methods on a slice the service holds.

Step and dataset functions travel once, pickled by value (so functions from scripts,
notebooks and test modules work as they are), and are cached by the service by
content. Arguments travel as :mod:`jaxpod.proto.tensors` trees (any pytree: nodes
other than dicts, lists and tuples travel frozen, :mod:`jaxpod.trees`, and come back
as the same types); arrays larger than ``UPLOAD_BYTES`` are uploaded in chunks first.
Results of ``run`` stay on the workers as :class:`RemotePerReplica` handles (freed
when garbage-collected) in the structure the step function returned; bytes come back
only from ``reduce``, ``gather``, ``experimental_local_results`` and ``.array``.

The handles live in :mod:`jaxpod.client.handles`; how the calls travel (the operation
stream, uploads, results inline or streamed) in :mod:`jaxpod.client.slice_calls`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpod.client.handles import RemoteDataset, RemoteIterator, RemotePerReplica, SpmdFunction
from jaxpod.client.slice_calls import UPLOAD_BYTES, SliceCalls
from jaxpod.client.stream import OpStream
from jaxpod.client.templates import signature
from jaxpod.jobs import JobProfile, check_profile_seconds, check_spmd
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.proto.job_messages import from_message
from jaxpod.scope import current_strategy_stand_in, strategy_scope
from jaxpod.shipping import ship_object
from jaxpod.tf_compat import TFCompatMixin
from jaxpod.types import InputOptions, ReduceOp

if TYPE_CHECKING:
    from jaxpod.client.client import Client


class RemoteStrategy(TFCompatMixin, SliceCalls):
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
        super().__init__(client, info, ops)
        self.steps_per_run = steps_per_run
        self._computation_shape = list(computation_shape or ())
        self._owns_slice = owns_slice

    def with_steps_per_run(self, steps_per_run: int) -> RemoteStrategy:
        """Another strategy on the same slice with a different default steps per run.

        It does not own the slice: closing it leaves the slice to this strategy.
        """
        return RemoteStrategy(self._client, self.info, steps_per_run,
                              self._computation_shape, owns_slice=False, ops=self._ops)

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
