"""TLS: a real ``jaxpod serve --local --tls-cert --tls-key`` and clients of it.

A CA and a certificate it signs for 127.0.0.1 are made here (``cryptography``). A
client trusting the CA (``tls_ca=``, or ``$JAXPOD_TLS_CA`` in a fresh interpreter and
for ``jaxpod status``) runs a step, compared with numpy; the HTTP API answers over
HTTPS; a plain-text client, a client trusting another CA or the system's roots, and
plain HTTP all fail. The CLI refuses half a TLS configuration, naming what is missing.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_process import PROCESSES, Service, make_ca, start_service, stop_service

import jaxpod

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return make_ca(tmp_path_factory.mktemp("pki"), "jaxpod test CA")


@pytest.fixture(scope="module")
def service(pki: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Service]:
    ca, cert, key = pki
    running = start_service(tmp_path_factory.mktemp("tls") / "serve.log", "v6e-8",
                            args=("--tls-cert", str(cert), "--tls-key", str(key),
                                  *PROCESSES),
                            tls_ca=ca.read_bytes())
    try:
        yield running
    finally:
        stop_service(running)


def test_a_client_trusting_the_ca_is_served(service: Service) -> None:
    x = np.arange(6, dtype=np.float32)
    with service.connect() as client, client.strategy("v6e-8") as strategy:
        got = strategy.reduce("SUM", strategy.run(lambda v: v * 3, args=(x,)), axis=None)
        np.testing.assert_allclose(got, x * 3 * strategy.num_replicas_in_sync)


def test_the_ca_from_the_environment_in_a_fresh_interpreter(
        service: Service, pki: tuple[Path, Path, Path]) -> None:
    script = ("import jaxpod\n"
              "with jaxpod.connect() as c:\n"
              "    print('SLICES', sorted(s['accelerator_type'] for s in c.cluster()))\n")
    env = {**os.environ, "JAXPOD_ADDRESS": service.address, "JAXPOD_TOKEN": service.token,
           "JAXPOD_TLS_CA": str(pki[0])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SLICES ['v6e-8']" in done.stdout
    status = subprocess.run([sys.executable, "-m", "jaxpod.cli", "status"], env=env,
                            capture_output=True, text=True, timeout=120)  # the CLI too
    assert status.returncode == 0, status.stderr[-3000:]
    assert "v6e-8" in status.stdout


def test_clients_without_the_ca_are_refused(service: Service, tmp_path: Path) -> None:
    with pytest.raises(jaxpod.ServiceUnavailableError):
        jaxpod.connect(service.address, token=service.token)  # plain text
    with pytest.raises(jaxpod.ServiceUnavailableError):  # the system's roots lack our CA
        jaxpod.connect(service.address, token=service.token, tls_ca=True)
    other_ca = make_ca(tmp_path / "other", "another CA")[0]
    with pytest.raises(jaxpod.ServiceUnavailableError):
        jaxpod.connect(service.address, token=service.token, tls_ca=str(other_ca))
    with pytest.raises(ValueError, match="cannot read the CA certificate"):
        jaxpod.connect(service.address, token=service.token, tls_ca=str(tmp_path / "none"))


def test_the_http_api_is_served_over_https(service: Service,
                                           pki: tuple[Path, Path, Path]) -> None:
    assert service.http_url.startswith("https://")
    trusting = ssl.create_default_context(cafile=str(pki[0]))
    with httpx.Client(base_url=service.http_url, verify=trusting, timeout=30) as api:
        reply = api.get("/api/v1/cluster",
                        headers={"Authorization": f"Bearer {service.token}"})
        assert reply.status_code == 200, reply.text
        assert [s["accelerator_type"] for s in reply.json()["slices"]] == ["v6e-8"]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{service.http_address}/healthz", timeout=10)


@pytest.mark.parametrize("given", ["--tls-cert", "--tls-key"])
def test_half_a_tls_configuration_is_refused(given: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPOD_TLS")}
    done = subprocess.run([sys.executable, "-m", "jaxpod.cli", "serve", "--port", "0",
                           given, str(tmp_path / "x.pem")], env=env, capture_output=True,
                          text=True, timeout=120)
    missing = "--tls-key" if given == "--tls-cert" else "--tls-cert"
    assert done.returncode != 0
    assert f"{given} was given without {missing}" in done.stderr, done.stderr[-2000:]
