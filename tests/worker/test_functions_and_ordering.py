"""Shipping step functions and the per-group operation order, without Ray."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import jaxpod
from jaxpod.operations import OperationOrderError, RemoteError
from jaxpod.shipping import check_versions, runtime_versions, ship
from jaxpod.worker.functions import FunctionRegistry
from jaxpod.worker.host_worker import HostWorker
from jaxpod.worker.value_store import ValueStore


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
    worker = HostWorker(0, 1, devices_per_host=8, platform="tpu")  # no JAX set-up needed
    worker._store = ValueStore()
    first = worker.execute(0, "stats")
    assert {k: first[k] for k in ("num_values", "device_bytes", "num_iterators",
                                  "operations")} == {"num_values": 0, "device_bytes": 0,
                                                     "num_iterators": 0, "operations": 0}
    skipped = worker.execute(2, "stats")  # #1 never arrived
    assert isinstance(skipped, RemoteError)
    assert isinstance(skipped.error, OperationOrderError)
    assert "expected operation #1 but received #2" in str(skipped.error)
