"""A host worker as a plain process of this machine, without Ray.

``python -m jaxpod.worker.host_process READ_FD WRITE_FD`` holds one
:class:`~jaxpod.worker.host_worker.HostWorker`. It answers the calls a Ray actor
would (the constructor, ``node_address``, ``reserve_port``, ``initialize``,
``open_channel``, ``shutdown``), one at a time, over two pipes from the process that
started it (:class:`jaxpod.service.capacity.process_hosts.ProcessWorkers`). The pipes are
not stdin and stdout: the worker captures its own output streams for the user's
step functions. Operations then go over the operation channel, as they do for a Ray
actor. When the starter goes away, however it goes, the read pipe ends and this
process exits at once: a worker never outlives its coordinator.

Each message is a 4-byte big-endian length and a pickle: ``(method, args)`` one way,
``(ok, value)`` the other, where a failed call's value is its exception, with the
worker's traceback as a note.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback
from typing import Any

from jaxpod.worker.host_worker import HostWorker

_LENGTH = struct.Struct(">I")
LOOPBACK = "127.0.0.1"


class LocalHostWorker(HostWorker):
    """A :class:`HostWorker` whose hosts are all this machine's processes."""

    def node_address(self) -> str:
        return LOOPBACK


def write_message(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_message(fd: int) -> Any:
    """The next message, or raises ``EOFError`` once the other end closed."""
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    return pickle.loads(_read_exactly(fd, length))


def _read_exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("the pipe closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def serve(read_fd: int, write_fd: int) -> None:
    """Answers calls until the read pipe ends; the first call constructs the worker."""
    worker: LocalHostWorker | None = None
    while True:
        try:
            method, args = read_message(read_fd)
        except EOFError:
            return
        try:
            if worker is None:
                if method != "__init__":
                    raise RuntimeError(f"{method}: the worker was not constructed first.")
                worker, result = LocalHostWorker(*args), None
            else:
                result = getattr(worker, method)(*args)
            reply = (True, result)
        except Exception as e:
            e.add_note(f"Remote traceback (host process {os.getpid()}):\n"
                       f"{traceback.format_exc()}")
            reply = (False, e)
        write_message(write_fd, reply)


def main(argv: list[str]) -> None:
    read_fd, write_fd = int(argv[0]), int(argv[1])
    serve(read_fd, write_fd)
    # The starter is gone or done: leave without waiting for peers in
    # jax.distributed's shutdown, nor for the channel's threads.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
