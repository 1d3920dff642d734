"""A real ``jaxpod serve --local`` child process for tests: start, stop, kill.

Shared by the service suites; each test module starts its own (its slices, lease and
state dir), over loopback with a random token.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import jaxpod
from jaxpod.client.embedded import read_announcement
from jaxpod.service.capacity.local_cluster import descendants, is_running
from jaxpod.timeouts import Deadline, wait_for

START_TIMEOUT_S = 240.0
#: ``start_service`` arguments for simulated hosts as plain processes, which start in a
#: second or two where a local Ray cluster takes several: for tests of what the service
#: does the same on either provider (TLS, roles, hostile input...).
PROCESSES = ("--provider", "processes")
STOP_TIMEOUT_S = 90.0


@dataclass
class Service:
    """A ``jaxpod serve --local`` child process."""

    address: str
    token: str
    process: subprocess.Popen[bytes]
    log_path: Path
    #: The HTTP dashboard's ``host:port`` (``JAXPOD_LISTENING``'s ``"http"``).
    http_address: str = ""
    #: The CA certificate (PEM) of a service started with TLS.
    tls_ca: bytes | None = None

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://{self.http_address}"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def log_tail(self, limit: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"

    def connect(self, **kwargs: Any) -> Any:
        if self.tls_ca is not None:
            kwargs.setdefault("tls_ca", self.tls_ca)
        return jaxpod.connect(self.address, token=self.token, **kwargs)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(folder: Path, common: str, address: str = "127.0.0.1"
            ) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signs for ``address`` and localhost: the CA's PEM,
    the certificate's and its key's, written in ``folder``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("jaxpod serve"))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address(address)), x509.DNSName("localhost")]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def chromium_path() -> str:
    """Debian's headless-capable Chromium, which the browser tests drive (Playwright)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, ("the browser tests need Debian's chromium (`apt-get install chromium`; "
                   ".ci/run installs it)")
    return found


def start_service(log_path: Path, slices: str | None, lease_s: float | None = None,
                  env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                  ray_address: str | None = None, tls_ca: bytes | None = None) -> Service:
    """Starts the service and waits until it is SERVING: on its own simulated cluster
    of ``slices``, or joining the Ray cluster at ``ray_address`` (which outlives it);
    ``args`` are added to its command line (e.g. ``--state-dir``; ``--tls-cert`` and
    ``--tls-key`` with ``tls_ca``, the CA that signed the certificate)."""
    token = secrets.token_hex(16)
    where = ["--local", "--slices", str(slices)] if ray_address is None else []
    # --http-port 0: services of parallel tests must not share a fixed HTTP port.
    command = [sys.executable, "-m", "jaxpod.cli", "serve", *where, "--port", "0",
               "--http-port", "0", "--stop-on-stdin-eof"]
    if lease_s is not None:
        command += ["--lease", str(lease_s)]
    command += list(args)
    full_env = {**os.environ, **(env or {}), "JAXPOD_TOKEN": token}
    full_env.pop("JAXPOD_ADDRESS", None)
    if ray_address is not None:
        full_env["RAY_ADDRESS"] = ray_address
    with log_path.open("ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=log, env=full_env, start_new_session=True)
    service = Service("", token, process, log_path, tls_ca=tls_ca)
    try:
        deadline = Deadline(START_TIMEOUT_S)
        service.address, service.http_address = listening_addresses(process, deadline)
        with (grpc.secure_channel(service.address, grpc.ssl_channel_credentials(tls_ca))
              if tls_ca is not None else grpc.insecure_channel(service.address)) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                assert process.poll() is None, f"service exited:\n{service.log_tail()}"
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            assert wait_for(serving, deadline.remaining(), max_poll_s=0.5), (
                f"service not SERVING within {START_TIMEOUT_S}s:\n{service.log_tail()}")
    except BaseException:
        kill_service(service)
        raise
    return service


def listening_address(process: subprocess.Popen[bytes], deadline: Deadline) -> str:
    return listening_addresses(process, deadline)[0]


def listening_addresses(process: subprocess.Popen[bytes], deadline: Deadline
                        ) -> tuple[str, str]:
    """The gRPC and HTTP ``host:port`` the service announces (HTTP: empty if none)."""
    announced = read_announcement(process, deadline)
    assert announced is not None, (
        f"the service never announced its address (exit {process.poll()})")
    assert announced["pid"] == process.pid
    return str(announced["address"]), str(announced.get("http", ""))


def close_pipes(service: Service) -> None:
    for pipe in (service.process.stdin, service.process.stdout):
        if pipe:
            pipe.close()


def kill_service(service: Service) -> None:
    if service.process.poll() is None:
        service.process.kill()
        service.process.wait()
    close_pipes(service)


def all_gone(tree: dict[int, str], timeout_s: float) -> list[int]:
    """Pids of ``tree`` still running after ``timeout_s`` (empty: all exited)."""
    wait_for(lambda: not any(is_running(p, s) for p, s in tree.items()), timeout_s)
    return [p for p, s in tree.items() if is_running(p, s)]


@contextlib.contextmanager
def running_service(log_path: Path, slices: str | None, **kwargs: Any) -> Iterator[Service]:
    """:func:`start_service` (same arguments), stopped by :func:`stop_service` on exit."""
    service = start_service(log_path, slices, **kwargs)
    try:
        yield service
    finally:
        stop_service(service)


@contextlib.contextmanager
def processes_service(folder: Path, slices: str, env: dict[str, str] | None = None
                      ) -> Iterator[Service]:
    """:func:`running_service` on worker processes (``--provider processes``), its log
    and state dir in ``folder``."""
    with running_service(folder / "serve.log", slices, env=env,
                         args=(*PROCESSES, "--state-dir", str(folder / "state"))) as service:
        yield service


def stop_service(service: Service) -> None:
    """SIGTERM; asserts a clean exit with every process it started gone."""
    process = service.process
    started = descendants(process.pid)
    try:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"service ignored SIGTERM for {STOP_TIMEOUT_S}s:\n{service.log_tail()}"
            ) from None
        assert code == 0, f"service exited with {code}:\n{service.log_tail()}"
        survivors = all_gone(started, 30)
        assert not survivors, f"processes of the service survived its exit: {survivors}"
    finally:
        kill_service(service)
        for pid, start in started.items():
            if is_running(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)




def crash_service(service: Service) -> None:
    """SIGKILLs the service and then every process it started, as a machine failure
    would: nothing of it gets to clean up."""
    started = descendants(service.process.pid)
    kill_service(service)
    for pid, start in started.items():
        if is_running(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    survivors = all_gone(started, 30)
    assert not survivors, f"processes of the killed service survived: {survivors}"
