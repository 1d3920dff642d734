"""The infeed: a host-side thread that prepares input ahead of the device loop.

For each distributed iterator a producer thread pulls this host's steps from its
:class:`~jaxpod.worker.input.HostFeed`, pads and stacks ``steps`` of them into a chunk,
and places chunks on the local devices as global arrays, in order, keeping up to
``JAXPOD_INFEED_PREFETCH_DEPTH`` placed (double buffering by default), so input
preparation overlaps device compute. Beyond those it reads up to
``JAXPOD_INFEED_LOOKAHEAD_STEPS`` steps ahead into host memory only: a remote client may
send a ``next`` ahead of its answer for every full step read (the iterator's credit),
and host memory is cheaper than the devices'. End of input and exceptions raised by the
user's dataset code come after the chunks before them, so they reach the caller in
order and with their own type.

Only host-local work happens on the thread; anything that talks to other hosts (the
agreement on how many steps remain) stays on the caller's thread, where every host
issues it in the same order.

Each infeed says how far ahead it is (:attr:`Infeed.depth`, chunks ready) and adds the
time its caller waited for a chunk to an :class:`InputWait` shared by the engine's
infeeds: a host whose input cannot keep up shows as that host's input wait.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpod import settings
from jaxpod.worker import input as input_lib

PREFETCH_DEPTH = settings.INFEED_PREFETCH_DEPTH
LOOKAHEAD_STEPS = settings.INFEED_LOOKAHEAD_STEPS
# How long closing an infeed at exit waits for its thread (which may be in user code).
CLOSE_TIMEOUT = settings.INFEED_CLOSE_TIMEOUT
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
      full_steps: how many steps, from the first, give every replica all its rows.
    """

    host: list[np.ndarray]
    counts: np.ndarray
    placed: list[jax.Array]
    last: bool
    positions: tuple[Any, ...] = ()
    stepless: bool = False
    full_steps: int = 0

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
      depth: chunks placed ahead; default ``$JAXPOD_INFEED_PREFETCH_DEPTH`` or 2.
      lookahead: steps read ahead beyond those, kept on the host; default
        ``$JAXPOD_INFEED_LOOKAHEAD_STEPS`` or 8 (none for chunks longer than that).
      waits: where the time :meth:`get` waits for a chunk goes (default: one of its own).
    """

    def __init__(self, feed: input_lib.HostFeed, place: Callable[[np.ndarray], jax.Array],
                 num_replicas: int, steps: int, depth: int | None = None,
                 waits: InputWait | None = None, lookahead: int | None = None) -> None:
        self._feed = feed
        self.waits = waits if waits is not None else InputWait()
        self._place = place
        self._replicas = num_replicas
        self._steps = steps
        self._stepless = False
        self._depth = PREFETCH_DEPTH.value(depth)
        self._lookahead = LOOKAHEAD_STEPS.value(lookahead)
        # Chunks in order, then _END or a _Failure once the input is over; the first
        # ``_placed`` are on the devices, the rest on the host. Under ``_changed``.
        self._items: collections.deque[Any] = collections.deque()
        self._placed = 0
        self._changed = threading.Condition()
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
        """Chunks placed and waiting to be taken (at most the prefetch depth)."""
        with self._changed:
            return self._placed

    def get(self) -> Chunk | None:
        """The next chunk, placed; ``None`` once this host's input has ended. Time spent
        waiting for one goes to :attr:`waits`.

        Raises:
          Whatever the user's dataset code raised, unchanged.
        """
        with self._changed:
            if not self._front_ready():  # the input is behind: the caller waits for it
                started = time.perf_counter_ns()
                # bounded: the coordinator's operation time-out resets a stuck slice
                self._changed.wait_for(self._front_ready)
                self.waits.add(time.perf_counter_ns() - started)
            item = self._items[0]
            if item is _END:  # stays: keeps answering None
                return None
            if isinstance(item, _Failure):
                raise item.error
            self._items.popleft()
            self._placed -= 1
            self._changed.notify_all()
        assert isinstance(item, Chunk)
        return item

    def ready_chunks(self) -> list[Chunk]:
        """The chunks read and not taken, placed or not, in order, up to the input's
        end or error."""
        with self._changed:
            return [item for item in self._items if isinstance(item, Chunk)]

    def close(self, timeout_s: float = 0.0) -> None:
        """Stops the producer; waits up to ``timeout_s`` for its thread to end."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if timeout_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def settle(self) -> None:
        """Waits for the transfers of the chunks placed but not taken: copies still
        running when JAX's client is torn down at exit abort the process."""
        with self._changed:
            chunks = list(self._items)[:self._placed]
        for chunk in chunks:
            with contextlib.suppress(Exception):  # a failed transfer is no longer ours
                jax.block_until_ready(chunk.placed)

    def _front_ready(self) -> bool:
        return bool(self._items) and (self._placed > 0 or not isinstance(self._items[0], Chunk))

    def _produce(self) -> None:
        """Places the oldest chunk read while fewer than the depth are placed, else
        reads the next one while the lookahead has room, else waits for the caller."""
        try:
            while (task := self._next_task()) is not None:
                if isinstance(task, Chunk):
                    self._keep_placed(task)
                else:
                    self._read()
        except BaseException as e:  # placing failed: nothing after it can be taken
            with self._changed:
                while len(self._items) > self._placed:
                    self._items.pop()
                self._items.append(_Failure(e))
                self._changed.notify_all()

    def _next_task(self) -> Chunk | str | None:
        """The chunk to place, ``"read"``, or ``None`` once stopped or done."""
        with self._changed:
            while not self._stop.is_set():
                host = [item for item in list(self._items)[self._placed:]
                        if isinstance(item, Chunk)]
                if host and self._placed < self._depth:
                    return host[0]
                ended = bool(self._items) and not isinstance(self._items[-1], Chunk)
                if ended and not host:
                    return None
                # One chunk is read ahead of those placed however long it is, as
                # double buffering does; more while the lookahead has room.
                waiting = sum(chunk.num_steps for chunk in host)
                if not ended and (not host or waiting + self._steps <= self._lookahead):
                    return "read"
                self._changed.wait()  # bounded: a step taking a chunk, or close, wakes it
            return None

    def _read(self) -> None:
        end: Any = None
        try:
            chunk = self._next_chunk()
        except BaseException as e:  # the user's dataset raised: after what it gave
            chunk, end = None, _Failure(e)
        if end is None and (chunk is None or chunk.last):
            end = _END
        with self._changed:
            if chunk is not None:
                self._items.append(chunk)
            if end is not None:
                self._items.append(end)
            self._changed.notify_all()

    def _keep_placed(self, chunk: Chunk) -> None:
        placed = self.place(chunk.host, chunk.counts, chunk.last, chunk.positions)
        with self._changed:  # the caller takes only placed chunks: it is still there
            assert self._items[self._placed] is chunk
            self._items[self._placed] = placed
            self._placed += 1
            self._changed.notify_all()

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
        return Chunk(builder.leaves, builder.counts, [], builder.num_added < k,
                     tuple(builder.positions), full_steps=self._full_steps(builder.counts))

    def empty_chunk(self, num_steps: int) -> Chunk:
        """Steps with no rows, for a host whose input ended before the others'."""
        builder = input_lib.ChunkBuilder(self.spec, self.rows, self._replicas, num_steps)
        return self.place(builder.leaves, builder.counts, True, (None,) * num_steps)

    def _full_steps(self, counts: np.ndarray) -> int:
        """Leading steps of ``counts`` ``(replicas, steps)`` that every replica fills."""
        short = np.flatnonzero((counts != self.rows).any(axis=0))
        return int(short[0]) if short.size else int(counts.shape[1])

    def place(self, host: list[np.ndarray], counts: np.ndarray, last: bool,
              positions: tuple[Any, ...]) -> Chunk:
        stepless = self._stepless and counts.shape[1] == 1
        # Views: the host arrays keep their steps axis for rechunking.
        device = [a[:, 0] for a in [*host, counts]] if stepless else [*host, counts]
        return Chunk(host, counts, [self._place(a) for a in device], last, positions,
                     stepless, self._full_steps(counts))

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
                     positions[num_steps:], full_steps=self._full_steps(counts[:, num_steps:]))
        return self.place([h[:, :num_steps] for h in host], counts[:, :num_steps], False,
                          positions[:num_steps]), left



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
