"""Fixtures for the engine's semantic tests: strategies over 1, 2 and 8 replicas.

Every strategy fixture is parametrized over two backends: ``local`` (the in-process
``jaxpod.TPUStrategy``) and ``remote`` (a ``RemoteStrategy`` from ``jaxpod.connect()``
on a real ``jaxpod serve --local`` child process, over loopback gRPC, whose host
workers run the same engine). The same tests run unchanged against both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest

import jaxpod

BACKENDS = ("local", "remote")
#: The remote backend's slices: one host each, with 1, 4 and 8 simulated chips.
REMOTE_SLICES = {1: "v6e-1", 2: "v6e-4", 8: "v6e-8"}


def make_strategy(num_replicas: int, steps_per_run: int = 1) -> jaxpod.TPUStrategy:
    """An in-process strategy over the first ``num_replicas`` simulated devices."""
    da = jaxpod.DeviceAssignment.build(jax.devices()[:num_replicas])
    return jaxpod.TPUStrategy(steps_per_run=steps_per_run, device_assignment=da)


class _Remote:
    """The remote backend: one embedded service and one slice per replica count,
    shared by the whole session (strategies with other ``steps_per_run`` share it)."""

    def __init__(self) -> None:
        self._service: Any = None
        self._client: Any = None
        #: The strategies that own each slice, by replica count (``steps_per_run`` 1).
        self._bases: dict[int, Any] = {}
        #: Copies of those with other ``steps_per_run``, sharing their slices.
        self._copies: dict[tuple[int, int], Any] = {}

    def strategy(self, num_replicas: int, steps_per_run: int = 1) -> Any:
        base = self._bases.get(num_replicas)
        if base is None:
            if self._client is None:
                from jaxpod.client import embedded

                self._service = embedded.start(",".join(REMOTE_SLICES.values()))
                self._client = jaxpod.connect(self._service.address, token=self._service.token)
            base = self._bases[num_replicas] = self._client.strategy(
                REMOTE_SLICES[num_replicas], num_replicas=num_replicas)
        if steps_per_run == 1:
            return base
        key = (num_replicas, steps_per_run)
        if key not in self._copies:
            self._copies[key] = base.with_steps_per_run(steps_per_run)
        return self._copies[key]

    def close(self) -> None:
        # Closing the session releases every slice and marks the strategies closed.
        if self._client is not None:
            self._client.close()
        if self._service is not None:
            self._service.stop()


_SHARED: dict[tuple[int, int], jaxpod.TPUStrategy] = {}


def shared_strategy(num_replicas: int, steps_per_run: int = 1) -> jaxpod.TPUStrategy:
    """A strategy reused by every test of the session (compiled helpers stay cached).

    Strategies hold no state besides compilation caches, so sharing them is safe; the
    tests' step functions are defined per test, so each test still traces its own.
    """
    key = (num_replicas, steps_per_run)
    if key not in _SHARED:
        _SHARED[key] = make_strategy(num_replicas, steps_per_run)
    return _SHARED[key]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs ``in_process`` tests on the local backend only: what they observe (Python
    side effects of a step function) happens in the worker for a remote strategy."""
    remote_only_local = [
        item for item in items
        if item.get_closest_marker("in_process") is not None
        and getattr(getattr(item, "callspec", None), "params", {}).get("backend") == "remote"]
    if remote_only_local:
        config.hook.pytest_deselected(items=remote_only_local)
        items[:] = [item for item in items if item not in remote_only_local]


@pytest.fixture(scope="session")
def remote_backend() -> Iterator[_Remote]:
    remote = _Remote()
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """``local`` or ``remote``: every strategy fixture of a test uses the same one."""
    return str(request.param)


def _of(backend: str, request: pytest.FixtureRequest) -> Callable[..., Any]:
    if backend == "local":
        return shared_strategy
    remote: _Remote = request.getfixturevalue("remote_backend")
    return remote.strategy


@pytest.fixture(scope="session", params=[1, 2, 8], ids=lambda n: f"{n}replicas")
def sstrategy(request: pytest.FixtureRequest, backend: str) -> Any:
    """A strategy over 1, 2 and 8 replicas, shared for the whole session."""
    return _of(backend, request)(request.param)


@pytest.fixture(scope="session")
def strategy_of(request: pytest.FixtureRequest, backend: str) -> Callable[..., Any]:
    """``strategy_of(n, steps_per_run=1)``: the session's shared strategy of that size."""
    return _of(backend, request)


@pytest.fixture(scope="session")
def model_parallel_strategy() -> jaxpod.TPUStrategy:
    """8 devices as mesh (4, 1, 1, 2), computation shape [1, 1, 1, 2]: 4 replicas of
    2 logical devices each."""
    topology = jaxpod.Topology.from_devices(jax.devices(), mesh_shape=(4, 1, 1, 2))
    da = jaxpod.DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2])
    return jaxpod.TPUStrategy(device_assignment=da)
