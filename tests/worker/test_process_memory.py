"""Reading another process's memory: a real second process holding known data, read in
many spans; tokens that read back and ones that do not; the switch's bad values; the
grant of the reading (its bookkeeping, and the prctl calls Yama would get)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from jaxpod.worker import process_memory

# A process that holds 1 MiB of known bytes and says where they are.
_HOLDER = """
import os, sys
import numpy as np
data = (np.arange(1 << 20) * 7 % 251).astype(np.uint8)
print(os.getpid(), data.ctypes.data, flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def holder() -> Iterator[tuple[int, int, np.ndarray]]:
    with subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            pid, address = (int(x) for x in proc.stdout.readline().split())
            yield pid, address, (np.arange(1 << 20) * 7 % 251).astype(np.uint8)
        finally:
            proc.kill()


def test_reads_spans_of_another_process_into_bytes(holder: tuple[int, int, np.ndarray]
                                                   ) -> None:
    pid, address, expected = holder
    # More spans than one system call takes (IOV_MAX), gaps left unread between them.
    spans = [(i * 600, address + i * 512, 500) for i in range(1500)]
    out, view = process_memory.new_bytes(1500 * 600 + 3)
    view[:] = b"\xff" * view.nbytes
    process_memory.read_into(pid, [(view[3 + at:3 + at + n], remote)
                                   for at, remote, n in spans])
    assert type(out) is bytes and len(out) == 1500 * 600 + 3
    got = np.frombuffer(out, np.uint8)
    for at, remote, n in spans[::97] + spans[-1:]:
        np.testing.assert_array_equal(got[3 + at:3 + at + n],
                                      expected[remote - address:remote - address + n])
        assert got[3 + at + n:3 + at + 600].tolist() == [255] * (600 - n)  # gap untouched


def test_a_token_reads_back_only_where_it_is(holder: tuple[int, int, np.ndarray]) -> None:
    pid, address, expected = holder
    assert process_memory.reads_back(pid, address + 64, expected[64:96].tobytes())
    assert not process_memory.reads_back(pid, address + 64, expected[65:97].tobytes())
    assert not process_memory.reads_back(pid, 8, b"\0" * 32)  # not mapped there
    assert not process_memory.reads_back(0, address, b"\0" * 32)


def test_reading_memory_that_is_not_there_raises_oserror(
        holder: tuple[int, int, np.ndarray]) -> None:
    pid, _, _ = holder
    _, view = process_memory.new_bytes(16)
    with pytest.raises(OSError, match=f"reading process {pid}'s memory"):
        process_memory.read_into(pid, [(view, 8)])


def test_the_switch_takes_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(process_memory.LEND_ENV, "0")
    assert not process_memory.enabled()
    monkeypatch.setenv(process_memory.LEND_ENV, "maybe")
    with pytest.raises(ValueError, match=r"JAXPOD_CHANNEL_LEND='maybe' is not valid: "
                                         r"expected 0 or 1"):
        process_memory.enabled()


class _FakeLibc:
    """Records ``prctl`` calls; answers ``result`` (0: taken, -1: refused)."""

    def __init__(self, result: int = 0) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

    def prctl(self, option: int, arg: Any, *rest: Any) -> int:
        self.calls.append((option, arg.value))
        return self.result


@pytest.fixture
def yama(monkeypatch: pytest.MonkeyPatch) -> _FakeLibc:
    """As on a machine with Yama, minus the kernel: prctl is recorded, not made."""
    libc = _FakeLibc()
    monkeypatch.setattr(process_memory, "_LIBC", libc)
    monkeypatch.setattr(process_memory, "_YAMA", True)
    assert process_memory.granted_reader() is None
    return libc


def test_one_reader_is_granted_until_its_last_holder_gives_it_back(yama: _FakeLibc
                                                                   ) -> None:
    set_ptracer = process_memory._PR_SET_PTRACER
    assert process_memory.allow_reader(1234)
    assert yama.calls == [(set_ptracer, 1234)] and process_memory.granted_reader() == 1234
    # Yama keeps one reader per process: another pid is refused, not swapped in.
    assert not process_memory.allow_reader(5678)
    assert process_memory.granted_reader() == 1234
    assert process_memory.allow_reader(1234)  # a second holder of the same grant
    process_memory.revoke_reader(5678)  # not granted: nothing happens
    process_memory.revoke_reader(1234)
    assert process_memory.granted_reader() == 1234 and len(yama.calls) == 1
    process_memory.revoke_reader(1234)  # the last holder: revoked in the kernel
    assert yama.calls == [(set_ptracer, 1234), (set_ptracer, 0)]
    assert process_memory.granted_reader() is None
    process_memory.revoke_reader(1234)  # given back already: nothing happens
    assert len(yama.calls) == 2
    assert not process_memory.allow_reader(0) and not process_memory.allow_reader(-1)
    assert len(yama.calls) == 2 and process_memory.granted_reader() is None


def test_a_grant_the_kernel_refuses_is_not_recorded(yama: _FakeLibc) -> None:
    yama.result = -1
    assert not process_memory.allow_reader(1234)
    assert process_memory.granted_reader() is None
    yama.result = 0
    assert process_memory.allow_reader(4321)  # a refusal leaves nothing held
    process_memory.revoke_reader(4321)
    assert process_memory.granted_reader() is None


def test_a_grant_without_yama_is_recorded_and_sets_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc()
    monkeypatch.setattr(process_memory, "_LIBC", libc)
    monkeypatch.setattr(process_memory, "_YAMA", False)
    assert process_memory.allow_reader(1234)
    assert process_memory.granted_reader() == 1234
    process_memory.revoke_reader(1234)
    assert process_memory.granted_reader() is None and libc.calls == []
