"""Shipping step functions and the per-group operation order, without Ray."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import jaxpod
from jaxpod import operations as ops
from jaxpod.operations import Envelope, IdRangeError, OperationOrderError, RemoteError
from jaxpod.shipping import ShippedFunction, check_versions, runtime_versions, ship
from jaxpod.worker.engine import Engine
from jaxpod.worker.functions import (
    CACHE_BYTES_ENV,
    DEFAULT_CACHE_BYTES,
    FunctionRegistry,
    UnknownFunctionError,
)
from jaxpod.worker.host_operations import HostOperations


def test_function_ids_are_content_hashes_and_define_is_idempotent() -> None:
    def double(x: np.ndarray) -> np.ndarray:
        return x * 2

    a, b = ship(double), ship(double)
    assert a.function_id == b.function_id
    assert ship(lambda x: x + 1).function_id != a.function_id
    registry = FunctionRegistry()
    fid = registry.define(a)
    assert registry.define(b) == fid
    np.testing.assert_array_equal(registry.get(fid)(np.arange(3)), np.arange(3) * 2)


def _triple_plus_offset(x: int) -> int:
    return 3 * x + OFFSET


OFFSET = 7


def test_functions_of_test_modules_travel_by_value(tmp_path: Path) -> None:
    """This module is not installed: a fresh process without it must still load it."""
    payload = tmp_path / "fn.pkl"
    payload.write_bytes(ship(_triple_plus_offset).payload)
    code = ("import cloudpickle, sys; "
            "f = cloudpickle.loads(open(sys.argv[1], 'rb').read()); print(f(5))")
    out = subprocess.run([sys.executable, "-c", code, str(payload)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(_triple_plus_offset(5))


def test_unpicklable_function_is_a_clear_type_error() -> None:
    lock = threading.Lock()

    def uses_lock(x: np.ndarray) -> np.ndarray:
        with lock:
            return x

    with pytest.raises(TypeError, match=r"cannot be pickled.*lock"):
        ship(uses_lock)


def test_version_mismatch_names_the_versions() -> None:
    theirs = dict(runtime_versions(), jax="0.0.1")
    with pytest.raises(jaxpod.VersionMismatchError, match=r"jax: sender 0\.0\.1"):
        check_versions(theirs)
    check_versions(runtime_versions())  # the same runtime is fine


def test_skipped_operation_is_detected_not_deadlocked() -> None:
    host = HostOperations(0, Engine())
    first = host.execute(Envelope(0, ops.Stats()))
    assert (first.num_values, first.device_bytes, first.num_iterators,
            first.operations) == (0, 0, 0, 0)
    skipped = host.execute(Envelope(2, ops.Stats()))  # #1 never arrived
    assert isinstance(skipped, RemoteError)
    assert isinstance(skipped.error, OperationOrderError)
    assert "expected operation #1 but received #2" in str(skipped.error)


def test_an_operation_sent_ahead_makes_no_more_objects_than_its_ids() -> None:
    """An operation sent ahead of another gets a block of ids: one that would make
    more fails, keeping none of them; within its block, its values take its ids."""
    host = HostOperations(0, Engine())
    pair = host.execute(Envelope(0, ops.Define(ship(lambda ctx: (np.float32(1),
                                                                   np.float32(2))))))
    too_many = host.execute(Envelope(1, ops.ValuesFromFunction(pair), first_id=10,
                                     id_limit=11, ahead=True))
    assert isinstance(too_many, RemoteError)
    assert isinstance(too_many.error, IdRangeError), too_many.error
    assert host.store.stats().num_values == 0
    made = host.execute(Envelope(2, ops.ValuesFromFunction(pair), first_id=20,
                                 id_limit=22, ahead=True))
    assert [info.id for info in made] == [20, 21]
    assert host.store.stats().num_values == 2


def _adder(k: int) -> Callable[[int], int]:
    def add(x: int) -> int:
        return x + k

    return add


def _shipped_adders(n: int) -> tuple[list[ShippedFunction], int]:
    """``n`` functions whose pickles have the same size, and that size."""
    shipped = [ship(_adder(k)) for k in range(n)]
    sizes = {len(s.payload) for s in shipped}
    assert len(sizes) == 1, sizes
    return shipped, sizes.pop()


def test_function_cache_evicts_the_least_recently_used() -> None:
    (a, b, c), size = _shipped_adders(3)
    registry = FunctionRegistry(max_bytes=2 * size)
    fa, fb = registry.define(a), registry.define(b)
    assert registry.get(fa)(1) == 1  # now used more recently than b
    fc = registry.define(c)
    assert (registry.get(fa)(1), registry.get(fc)(1)) == (1, 3)
    with pytest.raises(UnknownFunctionError, match="evicted"):
        registry.get(fb)


def test_function_cache_stays_within_its_byte_bound() -> None:
    shipped, size = _shipped_adders(10)
    registry = FunctionRegistry(max_bytes=3 * size + size // 2)
    for s in shipped:
        registry.define(s)
        assert registry.held_bytes <= registry.max_bytes
    assert registry.held_bytes == 3 * size
    assert [registry.get(s.function_id)(0) for s in shipped[-3:]] == [7, 8, 9]
    for s in shipped[:7]:
        with pytest.raises(UnknownFunctionError):
            registry.get(s.function_id)


def test_evicted_function_can_be_defined_again() -> None:
    (a, b), size = _shipped_adders(2)
    registry = FunctionRegistry(max_bytes=size)
    fa = registry.define(a)
    registry.define(b)  # evicts a
    with pytest.raises(UnknownFunctionError):
        registry.get(fa)
    assert registry.define(a) == fa
    assert registry.get(fa)(5) == 5
    with pytest.raises(UnknownFunctionError, match="evicted"):  # b made room for a
        registry.get(b.function_id)


def test_evicted_function_error_says_what_happened_and_the_fix() -> None:
    (a, b), size = _shipped_adders(2)
    registry = FunctionRegistry(max_bytes=size)
    fa = registry.define(a)
    registry.define(b)
    with pytest.raises(UnknownFunctionError) as evicted:
        registry.get(fa)
    message = str(evicted.value)
    for part in (fa, "evicted", f"{CACHE_BYTES_ENV}={size} bytes", "least recently used",
                 "Define it again", f"raise {CACHE_BYTES_ENV}"):
        assert part in message, (part, message)
    with pytest.raises(UnknownFunctionError, match=r"0+ is not defined on this worker"):
        registry.get("0" * 32)  # never defined


def test_function_cache_size_comes_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_BYTES_ENV, raising=False)
    assert FunctionRegistry().max_bytes == DEFAULT_CACHE_BYTES == 256 * 2**20
    monkeypatch.setenv(CACHE_BYTES_ENV, "1000")
    assert FunctionRegistry().max_bytes == 1000
    monkeypatch.setenv(CACHE_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=rf"{CACHE_BYTES_ENV}='lots' is not valid"):
        FunctionRegistry()


def test_function_larger_than_the_cache_is_refused_clearly() -> None:
    (a,), size = _shipped_adders(1)
    registry = FunctionRegistry(max_bytes=size - 1)
    with pytest.raises(ValueError, match=rf"{size} bytes.*{CACHE_BYTES_ENV}={size - 1}"):
        registry.define(a)
    assert registry.held_bytes == 0


def test_user_modules_are_registered_by_value_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = (f"shipprobe_{uuid.uuid4().hex}" for _ in range(2))  # fresh names
    for name in (first, second):
        (tmp_path / f"{name}.py").write_text("def plus_one(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered: list[str] = []
    register = cloudpickle.register_pickle_by_value

    def counted(module: types.ModuleType) -> None:
        registered.append(module.__name__)
        register(module)

    monkeypatch.setattr(cloudpickle, "register_pickle_by_value", counted)
    try:
        module = importlib.import_module(first)
        ship(module.plus_one)
        assert registered.count(first) == 1
        before = list(registered)
        ship(module.plus_one)
        assert registered == before  # nothing new imported: nothing registered again
        ship(importlib.import_module(second).plus_one)
        assert registered[len(before):] == [second]  # only the newly imported module
    finally:
        for name in (first, second):
            if name in sys.modules:
                with contextlib.suppress(ValueError):
                    cloudpickle.unregister_pickle_by_value(sys.modules[name])
                del sys.modules[name]
