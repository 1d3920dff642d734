"""Fixtures for the engine's semantic tests: strategies over 1, 2, 8 and 16 replicas.

Every strategy fixture is parametrized over backends: ``local`` (the in-process
``jaxpod.TPUStrategy``) and the remote ones, each a ``RemoteStrategy`` from
``jaxpod.connect()`` on a real ``jaxpod serve --local`` child process, over loopback
gRPC, whose host workers run the same engine: ``remote`` on one-host slices,
``remote-2hosts`` and ``remote-4hosts`` on slices of 2 and 4 hosts (one worker process
per host, gloo collectives). The same tests run unchanged against all of them; a test
asking for a replica count a backend has no slice for is deselected (``sstrategy``) or
skipped (``strategy_of``). Multi-host slices cost a process per host, so the 4-host
backend runs the ``sstrategy`` tests only, at 16 replicas (4 per host).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import pytest

import jaxpod


@dataclass(frozen=True)
class RemoteSlice:
    """A slice of the embedded service, configured for one replica count."""

    accelerator_type: str
    num_replicas: int | None = None
    computation_shape: tuple[int, ...] | None = None


#: Each backend's slices, by replica count. Multi-host slices have 4 chips per host,
#: so 2 replicas on 2 hosts take 4 chips (logical devices) each.
REMOTE_SLICES: dict[str, dict[int, RemoteSlice]] = {
    "remote": {1: RemoteSlice("v6e-1"), 2: RemoteSlice("v6e-4", num_replicas=2),
               8: RemoteSlice("v6e-8")},
    "remote-2hosts": {2: RemoteSlice("v4-16", computation_shape=(4, 1, 1, 1)),
                      8: RemoteSlice("v4-16")},
    "remote-4hosts": {16: RemoteSlice("v4-32")},
}
BACKENDS = ("local", *REMOTE_SLICES)
#: Replica counts of the in-process backend (the test process has 8 CPU devices).
LOCAL_REPLICAS = (1, 2, 8)
#: The ``sstrategy`` sizes, over all backends.
SSTRATEGY_REPLICAS = (1, 2, 8, 16)


def replica_counts(backend: str) -> tuple[int, ...]:
    """The replica counts ``backend`` has strategies for."""
    return LOCAL_REPLICAS if backend == "local" else tuple(REMOTE_SLICES[backend])


def make_strategy(num_replicas: int, steps_per_run: int = 1) -> jaxpod.TPUStrategy:
    """An in-process strategy over the first ``num_replicas`` simulated devices."""
    da = jaxpod.DeviceAssignment.build(jax.devices()[:num_replicas])
    return jaxpod.TPUStrategy(steps_per_run=steps_per_run, device_assignment=da)


class _Remote:
    """The remote backends: one embedded service holding every backend's slices, and
    one strategy per slice, shared by the whole session (strategies with other
    ``steps_per_run`` share their slice)."""

    def __init__(self) -> None:
        self._service: Any = None
        self._client: Any = None
        #: The strategies that own each slice (``steps_per_run`` 1).
        self._bases: dict[RemoteSlice, Any] = {}
        #: Copies of those with other ``steps_per_run``, sharing their slices.
        self._copies: dict[tuple[RemoteSlice, int], Any] = {}

    def strategy(self, backend: str, num_replicas: int, steps_per_run: int = 1) -> Any:
        """``backend``'s strategy of ``num_replicas`` (skips the test if it has none)."""
        spec = REMOTE_SLICES[backend].get(num_replicas)
        if spec is None:
            pytest.skip(f"{backend} has no slice of {num_replicas} replicas "
                        f"(it has {sorted(REMOTE_SLICES[backend])}).")
        base = self._bases.get(spec)
        if base is None:
            base = self._bases[spec] = self._connect().strategy(
                spec.accelerator_type, num_replicas=spec.num_replicas,
                computation_shape=spec.computation_shape)
        if steps_per_run == 1:
            return base
        key = (spec, steps_per_run)
        if key not in self._copies:
            self._copies[key] = base.with_steps_per_run(steps_per_run)
        return self._copies[key]

    def _connect(self) -> Any:
        if self._client is None:
            from jaxpod.client import embedded

            slices = [s.accelerator_type for by_count in REMOTE_SLICES.values()
                      for s in by_count.values()]
            self._service = embedded.start(",".join(slices))
            self._client = jaxpod.connect(self._service.address, token=self._service.token)
        return self._client

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "one_logical_device: needs one device per replica; deselected on "
        "backends whose slice of that size gives replicas several logical devices")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects what a backend cannot run: ``in_process`` tests on remote backends
    (what they observe, Python side effects of a step function, happens in the
    worker), ``sstrategy`` sizes a backend has no strategy for, and
    ``one_logical_device`` tests where that size's replicas span several devices."""
    deselected = [item for item in items if not _runs_on_its_backend(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


def _runs_on_its_backend(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    backend = params.get("backend")
    if backend is None:
        return True
    if backend != "local" and item.get_closest_marker("in_process") is not None:
        return False
    n = params.get("sstrategy")
    if n is None:
        return True
    if n not in replica_counts(backend):
        return False
    spec = REMOTE_SLICES.get(backend, {}).get(n)
    multi_device = spec is not None and spec.computation_shape is not None
    return not (multi_device and item.get_closest_marker("one_logical_device") is not None)


@pytest.fixture(scope="session")
def remote_backend() -> Iterator[_Remote]:
    remote = _Remote()
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """One of ``BACKENDS``: every strategy fixture of a test uses the same one."""
    return str(request.param)


def _of(backend: str, request: pytest.FixtureRequest) -> Callable[..., Any]:
    if backend == "local":
        return shared_strategy
    remote: _Remote = request.getfixturevalue("remote_backend")
    return lambda n, steps_per_run=1: remote.strategy(backend, n, steps_per_run)


@pytest.fixture(scope="session", params=SSTRATEGY_REPLICAS, ids=lambda n: f"{n}replicas")
def sstrategy(request: pytest.FixtureRequest, backend: str) -> Any:
    """A strategy over 1, 2, 8 or 16 replicas (those its backend has), shared for the
    whole session."""
    return _of(backend, request)(request.param)


@pytest.fixture(scope="session")
def strategy_of(request: pytest.FixtureRequest, backend: str) -> Callable[..., Any]:
    """``strategy_of(n, steps_per_run=1)``: the session's shared strategy of that size
    (the test is skipped on a backend without one)."""
    return _of(backend, request)


@pytest.fixture(scope="session")
def model_parallel_strategy() -> jaxpod.TPUStrategy:
    """8 devices as mesh (4, 1, 1, 2), computation shape [1, 1, 1, 2]: 4 replicas of
    2 logical devices each."""
    topology = jaxpod.Topology.from_devices(jax.devices(), mesh_shape=(4, 1, 1, 2))
    da = jaxpod.DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2])
    return jaxpod.TPUStrategy(device_assignment=da)


@pytest.fixture(scope="session")
def four_core_strategy() -> jaxpod.TPUStrategy:
    """8 devices as mesh (2, 2, 1, 2), computation shape [1, 2, 1, 2]: 2 replicas of
    4 logical devices each."""
    topology = jaxpod.Topology.from_devices(jax.devices(), mesh_shape=(2, 2, 1, 2))
    da = jaxpod.DeviceAssignment.build(topology, computation_shape=[1, 2, 1, 2])
    return jaxpod.TPUStrategy(device_assignment=da)
