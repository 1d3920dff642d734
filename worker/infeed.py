"""The infeed: a host-side thread that prepares input ahead of the device loop.

For each distributed iterator a producer thread pulls this host's steps from its
:class:`~jaxpod.worker.input.HostFeed`, pads and stacks ``steps`` of them, places them
on the local devices as global arrays, and puts the chunk in a bounded queue (double
buffering by default), so input preparation overlaps device compute. End of input and
exceptions raised by the user's dataset code travel through the same queue, so they
reach the caller in order and with their own type.

Only host-local work happens on the thread; anything that talks to other hosts (the
agreement on how many steps remain) stays on the caller's thread, where every host
issues it in the same order.

Each infeed says how far ahead it is (:attr:`Infeed.depth`, chunks ready) and adds the
time its caller waited for a chunk to an :class:`InputWait` shared by the engine's
infeeds: a host whose input cannot keep up shows as that host's input wait.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpod.timeouts import Count, Timeout
from jaxpod.worker import input as input_lib

PREFETCH_DEPTH = Count("JAXPOD_INFEED_PREFETCH_DEPTH", 2, "the infeed's prefetch depth, in chunks")
# How long closing an infeed at exit waits for its thread (which may be in user code).
CLOSE_TIMEOUT = Timeout("JAXPOD_INFEED_CLOSE_TIMEOUT_S", 5.0)
# How long the producer waits for room in the queue before checking for a stop.
_PUT_POLL_S = 0.1
_THREAD_NAME = "jaxpod-infeed"


@dataclass(frozen=True)
class Chunk:
    """``num_steps`` padded steps of this host's input.

    Attributes:
      host: per leaf, ``(local_replicas, num_steps, rows, *row_shape)`` numpy arrays.
      counts: real rows, ``(local_replicas, num_steps)``.
      placed: per leaf, the same data as global arrays on the devices, then the
        counts; empty for chunks only kept on the host.
      last: this host's input ended within (or right after) this chunk.
      positions: the input position each step started at (``None`` where the
        dataset does not tell).
      stepless: ``placed`` has no steps axis: one step, placed as ``next`` takes it.
    """

    host: list[np.ndarray]
    counts: np.ndarray
    placed: list[jax.Array]
    last: bool
    positions: tuple[Any, ...] = ()
    stepless: bool = False

    @property
    def num_steps(self) -> int:
        return int(self.counts.shape[1])


@dataclass(frozen=True)
class _Failure:
    error: BaseException


_END = object()


class InputWait:
    """Seconds callers spent waiting for input that was not ready yet, summed over
    the infeeds that add to it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ns = 0

    def add(self, ns: int) -> None:
        with self._lock:
            self._ns += ns

    def seconds(self) -> float:
        with self._lock:
            return self._ns / 1e9

    def reset(self) -> None:
        with self._lock:
            self._ns = 0


class Infeed:
    """Runs a producer thread that turns a host feed into placed chunks of steps.

    Args:
      feed: this host's input.
      place: turns a host-local array (local replicas first) into a global array.
      num_replicas: local replicas.
      steps: steps per chunk.
      depth: chunks prepared ahead; default ``$JAXPOD_INFEED_PREFETCH_DEPTH`` or 2.
      waits: where the time :meth:`get` waits for a chunk goes (default: one of its own).
    """

    def __init__(self, feed: input_lib.HostFeed, place: Callable[[np.ndarray], jax.Array],
                 num_replicas: int, steps: int, depth: int | None = None,
                 waits: InputWait | None = None) -> None:
        self._feed = feed
        self.waits = waits if waits is not None else InputWait()
        self._place = place
        self._replicas = num_replicas
        self._steps = steps
        self._stepless = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=PREFETCH_DEPTH.value(depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=_THREAD_NAME,
                                        daemon=True)
        self._thread.start()
        _live.add(self)
        _close_all_first_at_exit()

    @property
    def feed(self) -> input_lib.HostFeed:
        return self._feed

    @property
    def spec(self) -> input_lib.ElementSpec:
        return self._feed.spec

    @property
    def rows(self) -> int:
        return self._feed.rows_per_replica

    def set_steps(self, steps: int) -> None:
        """Chunk size for chunks not yet started (a different ``run_steps`` length)."""
        self._steps = steps

    def set_stepless(self, stepless: bool) -> None:
        """Whether chunks of one step placed from now on leave out the steps axis, as
        ``next`` takes them (its caller then need not drop the axis on the devices)."""
        self._stepless = stepless

    @property
    def depth(self) -> int:
        """Chunks prepared and waiting to be taken (at most the prefetch depth)."""
        return len(self.ready_chunks())

    def get(self) -> Chunk | None:
        """The next chunk; ``None`` once this host's input has ended. Time spent
        waiting for one goes to :attr:`waits`.

        Raises:
          Whatever the user's dataset code raised, unchanged.
        """
        try:
            item = self._queue.get_nowait()
        except queue.Empty:  # the input is behind: the caller waits for it
            started = time.perf_counter_ns()
            item = self._queue.get()
            self.waits.add(time.perf_counter_ns() - started)
        if item is _END:
            self._queue.put(_END)  # keep answering None
            return None
        if isinstance(item, _Failure):
            self._queue.put(item)
            raise item.error
        assert isinstance(item, Chunk)
        return item

    def ready_chunks(self) -> list[Chunk]:
        """The chunks prepared and not taken, in order, up to the input's end or error."""
        ready = []
        with self._queue.mutex:
            for item in self._queue.queue:
                if not isinstance(item, Chunk):
                    break
                ready.append(item)
        return ready

    def close(self, timeout_s: float = 0.0) -> None:
        """Stops the producer; waits up to ``timeout_s`` for its thread to end."""
        self._stop.set()
        if timeout_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def settle(self) -> None:
        """Waits for the transfers of the chunks placed but not taken: copies still
        running when JAX's client is torn down at exit abort the process."""
        with self._queue.mutex:
            chunks = [item for item in self._queue.queue if isinstance(item, Chunk)]
        for chunk in chunks:
            with contextlib.suppress(Exception):  # a failed transfer is no longer ours
                jax.block_until_ready(chunk.placed)

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                chunk = self._next_chunk()
                if chunk is None:
                    break
                self._put(chunk)
                if chunk.last:
                    break
            self._put(_END)
        except BaseException as e:
            self._put(_Failure(e))

    def _next_chunk(self) -> Chunk | None:
        k = self._steps
        step = self._feed.next_step()
        if step is None:
            return None
        builder = input_lib.ChunkBuilder(self.spec, self.rows, self._replicas, k)
        while step is not None:
            builder.add(step)
            if builder.num_added == k:
                break
            step = self._feed.next_step()
        return self.place(builder.leaves, builder.counts, builder.num_added < k,
                          tuple(builder.positions))

    def empty_chunk(self, num_steps: int) -> Chunk:
        """Steps with no rows, for a host whose input ended before the others'."""
        builder = input_lib.ChunkBuilder(self.spec, self.rows, self._replicas, num_steps)
        return self.place(builder.leaves, builder.counts, True, (None,) * num_steps)

    def place(self, host: list[np.ndarray], counts: np.ndarray, last: bool,
              positions: tuple[Any, ...]) -> Chunk:
        stepless = self._stepless and counts.shape[1] == 1
        # Views: the host arrays keep their steps axis for rechunking.
        device = [a[:, 0] for a in [*host, counts]] if stepless else [*host, counts]
        return Chunk(host, counts, [self._place(a) for a in device], last, positions,
                     stepless)

    def rechunk(self, first: Chunk, num_steps: int) -> tuple[Chunk, Chunk | None]:
        """``num_steps`` steps starting with ``first``'s, pulling more chunks as needed.

        Returns:
          The placed chunk, and the steps left over (host only), if any.
        """
        if first.num_steps >= num_steps:  # enough already: slices are views, no copy
            return self._split(first.host, first.counts, first.last, first.positions,
                               num_steps)
        parts = [first]
        while sum(p.num_steps for p in parts) < num_steps and not parts[-1].last:
            more = self.get()
            if more is None:
                break
            parts.append(more)
        host = [np.concatenate(leaf, axis=1) for leaf in zip(*(p.host for p in parts),
                                                               strict=True)]
        counts = np.concatenate([p.counts for p in parts], axis=1)
        positions = tuple(at for p in parts for at in p.positions)
        last = parts[-1].last
        total = counts.shape[1]
        if total < num_steps:  # input ended: pad with empty steps
            empty = input_lib.ChunkBuilder(self.spec, self.rows, self._replicas,
                                           num_steps - total)
            host = [np.concatenate(pair, axis=1) for pair in zip(host, empty.leaves,
                                                                 strict=True)]
            counts = np.concatenate([counts, empty.counts], axis=1)
            positions += (None,) * (num_steps - total)
        return self._split(host, counts, last, positions, num_steps)

    def _split(self, host: list[np.ndarray], counts: np.ndarray, last: bool,
               positions: tuple[Any, ...], num_steps: int) -> tuple[Chunk, Chunk | None]:
        if counts.shape[1] == num_steps:
            return self.place(host, counts, last, positions), None
        left = Chunk([h[:, num_steps:] for h in host], counts[:, num_steps:], [], last,
                     positions[num_steps:])
        return self.place([h[:, :num_steps] for h in host], counts[:, :num_steps], False,
                          positions[:num_steps]), left



    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_PUT_POLL_S)
                return
            except queue.Full:
                continue


# Infeed threads are daemons so an abandoned iterator never blocks exit, but a daemon
# thread still inside a JAX call while the interpreter finalizes aborts the process;
# stop them all before that.
_live: weakref.WeakSet[Infeed] = weakref.WeakSet()


def _close_all_first_at_exit() -> None:
    """Makes :func:`_close_all` the exit handler registered last, so it runs first:
    before JAX's own (registered when its backends start), which tear down what a
    producer thread may still be using."""
    atexit.unregister(_close_all)
    atexit.register(_close_all)


def _close_all() -> None:
    for infeed in list(_live):
        infeed.close(CLOSE_TIMEOUT.seconds())
        infeed.settle()
    # An infeed dropped just before exit is freed by its producer thread as that thread
    # ends (it holds the last reference), with its chunks' device arrays: gone from
    # _live already, but still inside JAX.
    for thread in threading.enumerate():
        if thread.name == _THREAD_NAME and thread is not threading.current_thread():
            thread.join(CLOSE_TIMEOUT.seconds())
