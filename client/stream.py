"""One slice's value-making operations, sent in order on one ``Stream`` call.

``run``, ``run_steps``, ``next`` and ``experimental_distribute_values_from_function``
travel as numbered ``SliceOp`` messages on a bidirectional stream; the coordinator
runs them in that order and answers each. An operation whose outputs the client can
predict (:mod:`jaxpod.client.templates`) is dispatched asynchronously: the call
returns handles named ``op << 20 | n`` at once, and its reply only confirms it. Its
failure is kept and raised at the next synchronising call (``reduce``, ``gather``,
fetching a value, ``close`` ...) with a note naming the call that failed and where
the user's code issued it; operations that used its outputs are not run.
``JAXPOD_ASYNC_DISPATCH=0`` waits for every reply, so errors raise where they happen.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from jaxpod import settings
from jaxpod.client import rpc
from jaxpod.client.templates import Templates
from jaxpod.errors import (
    AsyncPredictionError,
    DeadlineExceededError,
    HandleError,
    ServiceUnavailableError,
)
from jaxpod.operations import op_of
from jaxpod.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from jaxpod.client.client import Client

ASYNC_DISPATCH_ENV = settings.ASYNC_DISPATCH.name
WINDOW = settings.ASYNC_WINDOW
#: Failed operations remembered, to refuse their outputs' handles at once.
_MAX_FAILED = 4096
_END = object()


def async_dispatch_enabled() -> bool:
    """``$JAXPOD_ASYNC_DISPATCH`` (default on); ``0`` waits for every operation."""
    return bool(settings.ASYNC_DISPATCH.get())


def call_site() -> str:
    """Where the user's code called into jaxpod: ``file:line in function``."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(
            ("jaxpod.", "contextlib")):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclass
class _Pending:
    what: str
    site: str
    predicted: bool
    on_failure: Callable[[_Failure], None] | None
    on_success: Callable[[pb.SliceReply], None] | None
    reply: pb.SliceReply | None = None


@dataclass
class _Failure:
    """A failed operation; ``skipped``: how many later ones were not run because of it."""

    op: int
    what: str
    site: str
    failure: pb.OpFailure
    known: BaseException | None = None  # an error made here (a lost stream)
    skipped: int = 0
    _error: BaseException | None = None

    def error(self) -> BaseException:
        """The exception, unpickled once, when raised: loading the user's classes by
        value changes how they pickle, and so the ids of functions defined later."""
        if self._error is None:
            self._error = self.known or rpc.error_from_parts(
                rpc.status_code(self.failure.code), self.failure.details, self.failure.error,
                self.failure.traceback, self.what)
        return self._error

    def is_prediction_error(self) -> bool:
        return self.failure.details.startswith(f"{AsyncPredictionError.__name__}:")


class OpStream:
    """The ordered operation stream of one slice, shared by its strategies.

    Args:
      client: the session the slice belongs to.
      slice_id: the slice.
    """

    def __init__(self, client: Client, slice_id: str) -> None:
        self._client = client
        self.slice_id = slice_id
        self.asynchronous = async_dispatch_enabled()
        self.templates = Templates()
        self._window = threading.BoundedSemaphore(WINDOW.value())
        self._lock = threading.Lock()
        self._replied = threading.Condition(self._lock)
        self._next_op = 1
        self._pending: dict[int, _Pending] = {}
        self._failures: list[_Failure] = []
        # op -> its failure (raised or not): dependents of a skipped op count under it.
        self._failed: collections.OrderedDict[int, _Failure] = collections.OrderedDict()
        self._raised: set[int] = set()
        self._requests: queue.SimpleQueue[Any] | None = None
        self._reader: threading.Thread | None = None
        client.streams.add(self)

    # ------------------------------------------------------------------ sending
    def send(self, kind: str, request: Any, what: str,
             predict: Callable[[int], pb.Tree] | None = None,
             on_failure: Callable[[_Failure], None] | None = None,
             on_success: Callable[[pb.SliceReply], None] | None = None
             ) -> tuple[int, pb.Tree | None]:
        """Queues one operation (``kind``: a ``SliceOp`` body field).

        Args:
          predict: the outputs, given the operation's number: the operation is then
            asynchronous (its failure deferred).
          on_failure: called with its failure, if it fails (e.g. to forget a template).
          on_success: called with its reply, if it succeeds, on the reader thread.

        Returns:
          The operation's number, and its predicted outputs (``None``: call
          :meth:`result`).
        """
        if not self._window.acquire(timeout=rpc.CALL_TIMEOUT.seconds()):
            raise DeadlineExceededError(
                f"{what}: {len(self._pending)} operations sent to slice {self.slice_id} are "
                f"still unanswered after {rpc.CALL_TIMEOUT.seconds():g}s; raise "
                f"{rpc.CALL_TIMEOUT.env_var} if steps legitimately take that long.")
        try:
            with self._lock:
                requests = self._open()
                op = self._next_op
                self._next_op += 1
                expect = predict(op) if predict is not None else None
                message = pb.SliceOp(op=op, **{kind: request})
                if expect is not None:
                    message.predicted = True
                    message.expect.CopyFrom(expect)
                self._pending[op] = _Pending(what, call_site(), expect is not None,
                                             on_failure, on_success)
                requests.put(message)
        except BaseException:
            self._window.release()
            raise
        return op, expect

    def _open(self) -> queue.SimpleQueue[Any]:
        """The request queue of the live stream, opened on first use and after a break
        (the caller holds ``_lock``; numbering goes on across streams)."""
        if self._requests is None:
            requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
            call = self._client.stub.Stream(_batches(requests),
                                            metadata=self._client.metadata)
            self._requests = requests
            self._reader = threading.Thread(target=self._read, args=(call, requests),
                                            name=f"jaxpod-stream-{self.slice_id}",
                                            daemon=True)
            self._reader.start()
        return self._requests

    # ------------------------------------------------------------------ replies
    def _read(self, call: Iterator[pb.SliceReplies], requests: queue.SimpleQueue[Any]
              ) -> None:
        error: BaseException | None = None
        try:
            for replies in call:
                self._on_replies(replies)
        except grpc.RpcError as e:
            error = rpc.error_from(e, f"the operations sent to slice {self.slice_id}")
        with self._lock:
            if self._requests is requests:
                self._requests = None
            lost = ServiceUnavailableError(
                f"The operation stream to slice {self.slice_id} ended before the service "
                f"answered ({error or 'closed'}); the outcome of the operations it carried "
                "is unknown. Call again: the next call opens a new stream.")
            for op in [op for op, p in self._pending.items() if p.reply is None]:
                self._answer(op, pb.SliceReply(op=op, failure=pb.OpFailure(
                    code=grpc.StatusCode.UNAVAILABLE.value[0], details=str(lost))), lost)
            self._replied.notify_all()

    def _on_replies(self, replies: pb.SliceReplies) -> None:
        with self._lock:
            for reply in replies.replies:
                if reply.op in self._pending:
                    self._answer(reply.op, reply, None)
            self._replied.notify_all()

    def _answer(self, op: int, reply: pb.SliceReply, error: BaseException | None) -> None:
        """Records ``reply`` (the caller holds ``_lock``)."""
        pending = self._pending[op]
        pending.reply = reply
        self._window.release()
        if not reply.HasField("failure"):
            if pending.on_success is not None:
                pending.on_success(reply)
            if pending.predicted:
                del self._pending[op]
            return
        failure = reply.failure
        root = self._failed.get(failure.caused_by) if failure.caused_by else None
        record = root if root is not None else _Failure(op, pending.what, pending.site,
                                                        failure, error)
        if root is not None:
            root.skipped += 1
        self._failed[op] = record
        if len(self._failed) > _MAX_FAILED:
            self._raised.discard(self._failed.popitem(last=False)[0])
        if pending.predicted:
            del self._pending[op]
            if root is None:
                self._failures.append(record)
        if pending.on_failure is not None and root is None:
            pending.on_failure(record)

    @property
    def last_op(self) -> int:
        """The number of the last operation sent (0: none)."""
        return self._next_op - 1

    # ------------------------------------------------------------------ waiting
    def result(self, op: int) -> pb.Tree:
        """Waits for an operation sent without a prediction; returns its outputs or
        raises its failure as the call's own."""
        with self._lock:
            self._wait(lambda: self._pending[op].reply is not None, f"operation #{op}")
            pending = self._pending.pop(op)
        reply = pending.reply
        assert reply is not None
        if reply.HasField("failure"):
            record = self._failed[op]
            if record.op == op:
                self._raised.add(op)
                raise record.error()
            if record in self._failures:  # skipped, for a failure not yet raised
                record.skipped -= 1  # the note counts the calls before this one
                self._raise(f"{pending.what} ({call_site()})")
            raise rpc.error_from_parts(rpc.status_code(reply.failure.code), reply.failure.details,
                                       reply.failure.error, b"", record.what)
        return reply.tree

    def drain(self) -> None:
        """Waits until every operation sent has been answered."""
        with self._lock:
            self._wait(lambda: not any(p.predicted for p in self._pending.values()),
                       "the operations sent")

    def sync(self, what: str) -> None:
        """A synchronising call: waits for every operation, then raises the first
        deferred failure (with a note on where it came from), if any."""
        self.drain()
        if self._failures:
            self._raise(f"{what} ({call_site()})")

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        limit = rpc.CALL_TIMEOUT.seconds()
        deadline = time.monotonic() + limit
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"{what} on slice {self.slice_id}: no answer within {limit:g}s; raise "
                    f"{rpc.CALL_TIMEOUT.env_var} if steps legitimately take that long.")
            self._replied.wait(left)

    def _raise(self, surfaced: str) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
        first = failures[0]
        skipped = first.skipped
        error = first.error()
        error.add_note(
            f"jaxpod: raised by {first.what} (operation #{first.op} on slice "
            f"{self.slice_id}), issued asynchronously at {first.site}; surfaced at "
            f"{surfaced}. {skipped} later operation{'s' if skipped != 1 else ''} that "
            "used its results were not run; operations independent of it ran.")
        if len(failures) > 1:
            others = ", ".join(f"{f.what} at {f.site}" for f in failures[1:4])
            error.add_note(f"jaxpod: {len(failures) - 1} other asynchronous operations "
                           f"failed too: {others}.")
        for f in failures:
            self._raised.add(f.op)
        raise error

    def check_usable(self, value_id: int, where: str) -> None:
        """Refuses at once a handle made by a failed operation whose failure was raised."""
        record = self._failed.get(op_of(value_id))
        if record is not None and record.op in self._raised:
            raise HandleError(
                f"{where} is an output of a call that never produced it: {record.what} "
                f"(issued at {record.site}) failed, and its error was raised. Use values "
                "made after it.")

    # ----------------------------------------------------------------- closing
    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the stream (the service finishes what it received) and waits for its
        reader thread."""
        with self._lock:
            requests, reader = self._requests, self._reader
            self._requests = None
        if requests is not None:
            requests.put(_END)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout_s)


def _batches(requests: queue.SimpleQueue[Any]) -> Iterator[pb.SliceOps]:
    """The stream's messages: every operation queued by the time the previous message
    left goes in the next one (a client ahead of the service sends fewer, larger
    messages), until ``_END``."""
    while True:
        first = requests.get()
        if first is _END:
            return
        batch = [first]
        while True:
            try:
                more = requests.get_nowait()
            except queue.Empty:
                break
            if more is _END:
                yield pb.SliceOps(ops=batch)
                return
            batch.append(more)
        yield pb.SliceOps(ops=batch)


