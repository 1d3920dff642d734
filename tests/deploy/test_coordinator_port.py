"""``JAXPOD_COORDINATOR_PORT``, which the manifests set on every TPU pod, is the port
host 0's worker gives ``jax.distributed`` (the play shows it listening there)."""

from __future__ import annotations

import pytest

from jaxpod.worker.host_worker import COORDINATOR_PORT_ENV, HostWorker


def _worker() -> HostWorker:
    # reserve_port needs no started worker: skip __init__ (it sets up JAX and signals).
    return HostWorker.__new__(HostWorker)


def test_the_pinned_port_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COORDINATOR_PORT_ENV, "8482")
    assert _worker().reserve_port() == 8482


@pytest.mark.parametrize("value", ["http", "0", "65536", "-1"])
def test_a_malformed_pin_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(COORDINATOR_PORT_ENV, value)
    with pytest.raises(ValueError, match=(f"{COORDINATOR_PORT_ENV}='{value}' is not valid: "
                                          r"expected a TCP port \(1-65535\)")):
        _worker().reserve_port()
