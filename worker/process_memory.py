"""Reading another process's memory (Linux ``process_vm_readv``), for the operation
channel's same-host path.

When the coordinator and a host worker run on one machine, moving a large reply
through a loopback socket costs a copy into the kernel on the worker's side, a copy
out of it on the coordinator's, and the TCP stack and wake-ups in between, on CPUs
that the computation and the client share. Instead the worker sends where its buffers
are, and the coordinator copies them straight into its own ``bytes`` objects: one
copy, and none of the worker's time. Whether it may is not assumed: only a
coordinator that reached the worker over its Unix-domain socket (which proves the same
machine) and proved it holds the group's key is granted the reading, by the pid the
kernel names for that socket's peer (:func:`allow_reader`), and only while that
connection lasts (:func:`revoke_reader`). The handshake then has the coordinator read a
random token at an address the worker names (:func:`reads_back`), which proves the
same pid namespace and the permission to read, and falls back to the socket otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpod import settings

#: Set to ``0`` to send every reply through the channel's socket.
LEND_ENV = settings.CHANNEL_LEND.name
_PR_SET_PTRACER = 0x59616D61  # prctl option of the Yama security module
_IOV_MAX = 1024
#: Whether the Yama security module limits reading to ancestors and granted readers.
_YAMA = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        read = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    read.restype = ctypes.c_ssize_t
    read.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                     ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    return libc


_LIBC = _libc()
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = [ctypes.py_object]


def enabled() -> bool:
    """Whether this process should try the same-host path (``JAXPOD_CHANNEL_LEND``)."""
    return bool(settings.CHANNEL_LEND.get()) and _LIBC is not None


def address_of(buffer: Any) -> int:
    """Where a C-contiguous buffer (read-only ones included) starts in memory."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def new_bytes(size: int) -> tuple[bytes, memoryview]:
    """A ``bytes`` object of ``size`` bytes not yet filled, and a writable view of it.

    The view is for filling it before anyone else sees it; afterwards, the object is
    as immutable as any other ``bytes``.
    """
    data = _new_bytes(None, size)
    if size == 0:
        return data, memoryview(bytearray())
    return data, memoryview((ctypes.c_char * size).from_address(_bytes_address(data))
                            ).cast("B")


class _Grant:
    """The one reader this process has granted (Yama keeps one per process) and how
    many holders (channel connections from that pid) still need it."""

    lock = threading.Lock()
    reader: int | None = None
    holders = 0


def allow_reader(pid: int) -> bool:
    """Lets process ``pid`` read this one's memory where the Yama security module would
    otherwise allow only this process's ancestors to, until as many
    :func:`revoke_reader` calls as successful grants. Call it only for a pid the
    kernel named (a Unix socket's peer credentials), never for one a peer claims.

    Returns:
      Whether it is granted: false where another process holds the grant (it is not
      taken away from it) or the kernel refused. Without Yama the grant is recorded
      (:func:`granted_reader`) and the kernel's plain ptrace rules decide alone.
    """
    if pid <= 0:
        return False
    with _Grant.lock:
        if _Grant.reader not in (None, pid):
            return False
        if _Grant.reader is None and not _set_ptracer(pid):
            return False
        _Grant.reader = pid
        _Grant.holders += 1
        return True


def revoke_reader(pid: int) -> None:
    """Gives back one grant :func:`allow_reader` made to ``pid``; the last one given
    back revokes the permission (a later process that reuses the pid gets nothing)."""
    with _Grant.lock:
        if _Grant.reader != pid or _Grant.holders == 0:
            return
        _Grant.holders -= 1
        if _Grant.holders == 0:
            _set_ptracer(0)
            _Grant.reader = None


def granted_reader() -> int | None:
    """The pid this process has granted the reading of its memory, if any."""
    with _Grant.lock:
        return _Grant.reader


def _set_ptracer(pid: int) -> bool:
    """``prctl(PR_SET_PTRACER, pid)`` where Yama is there (``0`` revokes); whether the
    kernel took it."""
    if _LIBC is None or not _YAMA:
        return True
    return int(_LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), ctypes.c_ulong(0),
                           ctypes.c_ulong(0), ctypes.c_ulong(0))) == 0


def read_into(pid: int, spans: Sequence[tuple[memoryview, int]]) -> None:
    """Fills each writable view with process ``pid``'s memory from its address.

    Raises:
      OSError: the process is gone or its memory cannot be read (``errno`` says why).
    """
    _read_spans(pid, [(address_of(view), address, view.nbytes) for view, address in spans])


def _read_spans(pid: int, spans: Sequence[tuple[int, int, int]]) -> None:
    """``(local address, address in pid, length)`` each, many per system call."""
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available here")
    pending = [span for span in spans if span[2]]
    while pending:
        batch, pending = pending[:_IOV_MAX], pending[_IOV_MAX:]
        local = (_IOVec * len(batch))(*[_IOVec(at, n) for at, _, n in batch])
        remote = (_IOVec * len(batch))(*[_IOVec(address, n) for _, address, n in batch])
        got = _LIBC.process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got <= 0:  # 0: nothing readable where something was asked for
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"reading process {pid}'s memory: {os.strerror(code)}")
        # A partial read stops at a span's edge or within it: go on from there.
        for i, (at, address, n) in enumerate(batch):
            if got >= n:
                got -= n
                continue
            pending = [(at + got, address + got, n - got), *batch[i + 1:], *pending]
            break


def reads_back(pid: int, address: int, expected: bytes) -> bool:
    """Whether ``expected`` is what this process reads at ``address`` in process
    ``pid``: false where the process is elsewhere, in another pid namespace, or not
    readable from here."""
    if _LIBC is None or pid <= 0:
        return False
    out = bytearray(len(expected))
    try:
        read_into(pid, [(memoryview(out), address)])
    except OSError:
        return False
    return bytes(out) == expected
