"""Every user-facing entry point, each run in a fresh interpreter that imports nothing first.

One ``jaxpod serve --local`` (a simulated v4-8, with a token) serves the whole module.
Its fixture first starts a client process that has imported ``jaxpod`` and waits for
an address, then starts the service and hands the client its address the moment the
service prints its ``JAXPOD_LISTENING`` line: the client connects and acquires a slice
while the service is still starting its cluster (the acquire must wait for it, not
fail), runs a step and reduces, and reports its results and which modules it loaded.
The other tests drive the ``jaxpod`` console script: every ``--help``, ``jaxpod demo``
against that service, ``jaxpod cluster --slices v4-8``, and ``jaxpod serve`` refusing
a non-loopback address without a token. A few in-process tests pin the pieces those
rely on: the address rule, the constant-time token check, and how calls that arrive
before the cluster is up wait for it (or fail naming why).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import numpy as np
import pytest

from jaxpod.client import embedded
from jaxpod.errors import AllocationTimeoutError, ServiceUnavailableError
from jaxpod.service.api import server
from jaxpod.service.auth.tokens import Principal, Role, TokenBook
from jaxpod.service.capacity import deferred
from jaxpod.service.capacity.local_cluster import _read_line, descendants, is_running
from jaxpod.service.capacity.requests import ClusterSlice, SliceRequest
from jaxpod.service.cli.serve import check_listen_address
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

SLICE = "v4-8"  # one simulated host of 4 chips: the cheapest slice
JAXPOD = Path(sys.executable).with_name("jaxpod")  # the console script of this venv
IMPORT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 180.0
CLIENT_TIMEOUT_S = 240.0
COMMAND_TIMEOUT_S = 240.0
HELP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 90.0
#: The global batch the fresh client runs its step on: 13 rows, not a multiple of the
#: slice's 4 replicas (so the reduction must leave out the padding rows).
BATCH = (np.arange(13 * 3, dtype=np.float32).reshape(13, 3) - 10.0) / 7.0
#: The modules a client must not load: the engine, the coordinator and Ray.
SERVER_SIDE = ("jaxpod.worker", "jaxpod.service", "ray")

# Runs in a fresh interpreter: imports jaxpod, says so, then waits for the service's
# address and token on stdin (sent the moment the service listens) and uses them at
# once. Prints one RESULT line of JSON.
_CLIENT = r"""
import json
import sys
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

import jaxpod

print("IMPORTED", flush=True)
given = json.loads(sys.stdin.readline())
address = given["address"]
with grpc.insecure_channel(address) as channel:
    status = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=30).status
serving_at_acquire = status == health_pb2.HealthCheckResponse.SERVING

client = jaxpod.connect(address, token=given["token"])
with client:
    started = time.monotonic()
    strategy = client.strategy(given["accelerator_type"])
    acquire_s = time.monotonic() - started
    with strategy:
        dataset = strategy.experimental_distribute_dataset(
            [np.asarray(given["batch"], np.float32)])
        out = strategy.run(lambda rows: rows * 2.0 + 1.0, args=(next(iter(dataset)),))
        total = strategy.reduce("SUM", out, axis=0)
        mean = strategy.reduce("MEAN", out, axis=0)
        replicas = strategy.num_replicas_in_sync
loaded = sorted(m for m in sys.modules
                if m.split(".")[0] == "ray" or m.startswith(tuple(given["forbidden"])))
print("RESULT " + json.dumps({
    "serving_at_acquire": serving_at_acquire, "acquire_s": acquire_s,
    "replicas": replicas, "sum": np.asarray(total).tolist(),
    "mean": np.asarray(mean).tolist(), "loaded": loaded}), flush=True)
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any jaxpod address or token, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAXPOD_TOKEN", "JAXPOD_ADDRESS")}
    return {**env, **extra}


def _log_tail(path: Path, limit: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


@dataclass
class Launch:
    """The module's service and what the client that raced its start reported."""

    service: embedded.EmbeddedService
    log_path: Path
    client_returncode: int
    client_stdout: str
    client_stderr: str

    def client_result(self) -> dict[str, Any]:
        lines = [line for line in self.client_stdout.splitlines()
                 if line.startswith("RESULT ")]
        assert self.client_returncode == 0 and len(lines) == 1, (
            f"the fresh client failed (exit {self.client_returncode}):\n"
            f"{self.client_stdout}\n{self.client_stderr[-6000:]}\n"
            f"service log:\n{_log_tail(self.log_path)}")
        result: dict[str, Any] = json.loads(lines[0].split(" ", 1)[1])
        return result


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """Starts the fresh client, then the service; the client acquires the moment the
    service listens. Yields once the client is done (its slice released)."""
    folder = tmp_path_factory.mktemp("entry_points")
    log_path = folder / "serve.log"
    with (folder / "client.err").open("w+") as client_err:
        client = subprocess.Popen([sys.executable, "-c", _CLIENT], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=client_err, env=_clean_env())
        service: embedded.EmbeddedService | None = None
        try:
            assert client.stdout is not None
            first = _read_line(client.stdout, IMPORT_TIMEOUT_S)
            assert first == "IMPORTED", (
                f"the client did not import jaxpod within {IMPORT_TIMEOUT_S}s "
                f"(read {first!r}, exit {client.poll()})")
            # On Ray: its cluster takes seconds to start, the window this test needs
            # (the embedded default, plain processes, serves almost at once).
            with mock.patch.dict(os.environ, {embedded.PROVIDER_ENV: "ray"}):
                service = embedded.start(SLICE, log_path=str(log_path),
                                         timeout_s=START_TIMEOUT_S, quiet=True,
                                         wait_serving=False)
            given = {"address": service.address, "token": service.token,
                     "accelerator_type": SLICE, "batch": BATCH.tolist(),
                     "forbidden": list(SERVER_SIDE)}
            stdout, _ = client.communicate((json.dumps(given) + "\n").encode(),
                                           timeout=CLIENT_TIMEOUT_S)
            client_err.seek(0)
            launch = Launch(service, log_path, client.returncode,
                            stdout.decode(errors="replace"), client_err.read())
        except BaseException:
            client.kill()
            client.communicate()
            if service is not None:
                service.stop()
            raise
    assert service is not None
    try:
        yield launch
    finally:
        _stop(service, log_path)


def _stop(service: embedded.EmbeddedService, log_path: Path) -> None:
    """SIGTERM; asserts a clean exit with every process it started gone."""
    started = descendants(service.process.pid)
    try:
        service.stop(STOP_TIMEOUT_S)
        assert service.process.returncode == 0, (
            f"service exited with {service.process.returncode}:\n{_log_tail(log_path)}")
        wait_for(lambda: not any(is_running(p, s) for p, s in started.items()), 30.0)
        survivors = [p for p, s in started.items() if is_running(p, s)]
        assert not survivors, f"processes of the service survived its exit: {survivors}"
    finally:
        for pid, start in started.items():
            if is_running(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _jaxpod(*args: str, env: dict[str, str] | None = None,
            timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Runs the console script (a fresh interpreter) to completion."""
    assert JAXPOD.is_file(), f"no `jaxpod` console script next to {sys.executable}"
    return subprocess.run([str(JAXPOD), *args], capture_output=True, text=True,
                          env=env if env is not None else _clean_env(), timeout=timeout_s,
                          stdin=subprocess.DEVNULL, check=False)


# ------------------------------------------------------------------ the client
def test_fresh_client_acquires_while_the_service_starts(launched: Launch) -> None:
    result = launched.client_result()
    # The acquire really landed in the window between listening and serving...
    assert result["serving_at_acquire"] is False, (
        "the service was already SERVING when the client acquired, so this run did not "
        "exercise an acquire that has to wait for the cluster")
    # ... and it waited for the cluster instead of failing, then worked.
    assert result["replicas"] == 4  # a v4-8: one host of 4 chips, a replica per chip
    expected = BATCH * 2.0 + 1.0
    np.testing.assert_allclose(result["sum"], expected.sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(result["mean"], expected.mean(axis=0), rtol=1e-5)
    # A client loads neither the engine, nor the coordinator, nor Ray.
    assert result["loaded"] == [], f"the client loaded server-side modules: {result['loaded']}"


# ------------------------------------------------------------------ the CLI
@pytest.mark.parametrize(("command", "expected"), [
    ((), ("usage: jaxpod", "demo", "cluster", "serve")),
    (("serve",), ("usage: jaxpod serve", "--address", "--port", "--local", "--slices",
                  "JAXPOD_TOKEN")),
    (("cluster",), ("usage: jaxpod cluster", "--slices", "--address", "--json")),
    (("demo",), ("usage: jaxpod demo", "--steps", "--accelerator-type", "--address")),
], ids=["jaxpod", "serve", "cluster", "demo"])
def test_help(command: tuple[str, ...], expected: tuple[str, ...]) -> None:
    done = _jaxpod(*command, "--help", timeout_s=HELP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines
    missing = [word for word in expected if word not in text]
    assert not missing, f"`jaxpod {' '.join(command)} --help` lacks {missing}:\n{done.stdout}"


def test_demo_trains_on_the_running_service(launched: Launch) -> None:
    service = launched.service
    done = _jaxpod("demo", "--address", service.address, "--steps", "2",
                   env=_clean_env(JAXPOD_TOKEN=service.token))
    assert done.returncode == 0, (
        f"jaxpod demo exited with {done.returncode}:\n{done.stdout}\n{done.stderr[-6000:]}")
    losses = [(int(m.group(1)), float(m.group(2)))
              for m in re.finditer(r"^step\s+(\d+)\s+loss\s+(\S+)$", done.stdout, re.M)]
    assert [step for step, _ in losses] == [1, 2], done.stdout
    assert all(math.isfinite(loss) for _, loss in losses), done.stdout
    assert f"service {service.address}" in done.stdout
    assert re.search(r"^done: 2 steps in ", done.stdout, re.M), done.stdout


def test_cluster_prints_the_simulated_slice_and_its_host() -> None:
    done = _jaxpod("cluster", "--slices", SLICE)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-6000:]}"
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("SLICE"))
    columns = re.split(r"\s{2,}", lines[header].strip())  # cells: 2 spaces apart
    rows = [dict(zip(columns, line.split(), strict=True))
            for line in lines[header + 1:] if line.startswith("sim-")]
    assert len(rows) == 1, done.stdout
    (row,) = rows
    assert row["TYPE"] == SLICE and SLICE in row["SLICE"], done.stdout
    assert (row["WORKER"], row["ADDRESS"], row["CHIPS"]) == ("0", "127.0.0.1", "4")
    assert "1 slice(s), 1 host(s)" in lines, done.stdout


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
def test_serve_refuses_a_public_address_without_a_token(address: str) -> None:
    # The time-out is a safety net: the refusal comes before anything starts.
    done = _jaxpod("serve", "--address", address, timeout_s=HELP_TIMEOUT_S)
    assert done.returncode != 0
    assert "JAXPOD_LISTENING" not in done.stdout
    assert "JAXPOD_TOKEN" in done.stderr and repr(address) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # the message, not a stack


# ------------------------------------------------------------ in-process pieces
@pytest.mark.parametrize("address", [
    "127.0.0.1:50051", "127.8.9.10:0", "localhost:0", "LOCALHOST:1", "[::1]:0", "::1:0",
    "unix:/tmp/jaxpod.sock"])
def test_loopback_addresses_need_no_token(address: str) -> None:
    check_listen_address(address, None)  # no error


@pytest.mark.parametrize("address", [
    "0.0.0.0:50051", "[::]:0", "10.1.2.3:0", "192.168.0.7:0", "example.com:0", ":0",
    "localhost.example.com:0", "[::ffff:0.0.0.0]:0"])
def test_other_addresses_need_a_token(address: str) -> None:
    with pytest.raises(ValueError, match="JAXPOD_TOKEN") as info:
        check_listen_address(address, None)
    assert repr(address) in str(info.value)  # what was received
    assert "loopback" in str(info.value)  # why
    check_listen_address(address, "a-secret")  # with a token it is allowed


def test_the_token_check_finds_tokens_by_hash_and_checks_roles() -> None:
    book = TokenBook([(Principal("admin", Role.ADMIN), hashlib.sha256(b"s3cret").digest()),
                      (Principal("eve", Role.VIEWER), hashlib.sha256(b"v1ew").digest())])
    check = server._Authorize(book)
    allowed = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details: Any) -> Any:
        return allowed

    def handler(method: str, metadata: tuple[tuple[str, str], ...]) -> Any:
        details: Any = types.SimpleNamespace(method=method, invocation_metadata=metadata)
        return asyncio.run(check.intercept_service(continuation, details))

    status, acquire = "/jaxpod.v1.Coordinator/ClusterStatus", "/jaxpod.v1.Coordinator/AcquireSlice"
    for token in ("s3cret", "v1ew"):
        assert handler(status, (("authorization", f"Bearer {token}"),)) is allowed
    for wrong in ((("authorization", "Bearer s3creT"),), (("authorization", "s3cret"),),
                  (("authorization", "Bearer "),), ()):
        assert handler(status, wrong) is not allowed, wrong
    assert handler(acquire, (("authorization", "Bearer s3cret"),)) is allowed
    assert handler(acquire, (("authorization", "Bearer v1ew"),)) is not allowed  # a viewer
    assert handler("/jaxpod.v1.Coordinator/NoSuchMethod",
                   (("authorization", "Bearer s3cret"),)) is not allowed  # no role: refused
    assert handler("/grpc.health.v1.Health/Check", ()) is allowed  # probes are open


class _Provider:
    """A slice provider that records what it was asked."""

    def __init__(self) -> None:
        self.requests: list[SliceRequest] = []

    def acquire(self, request: SliceRequest, slice_id: str,
                cancel: Any = None) -> Any:
        self.requests.append(request)
        return f"held {slice_id}"

    def cluster(self) -> list[ClusterSlice]:
        return [ClusterSlice(name="sim-0-v4-8", accelerator_type="v4-8", num_hosts=1)]

    def close(self) -> None:
        pass


def _in_thread(fn: Any) -> tuple[threading.Event, list[Any]]:
    """Runs ``fn`` on a thread; the event is set when it returned or raised."""
    done, outcome = threading.Event(), []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as e:
            outcome.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, outcome


def test_calls_before_the_cluster_is_up_wait_for_it() -> None:
    slices, provider = deferred.DeferredSlices(), _Provider()
    request = SliceRequest(accelerator_type="v4-8", timeout_s=60.0)
    acquired, acquire = _in_thread(lambda: slices.acquire(request, "slice-1"))
    listed, cluster = _in_thread(slices.cluster)
    assert not acquired.wait(0.3) and not listed.wait(0.01)  # waiting, not failing
    slices.ready(provider)
    assert acquired.wait(30) and listed.wait(30)
    assert acquire == ["held slice-1"]
    assert [s.name for s in cluster[0]] == ["sim-0-v4-8"]
    # The allocation gets what is left of the acquire's own time-out.
    (forwarded,) = provider.requests
    assert forwarded.accelerator_type == "v4-8"
    assert 0 < forwarded.timeout_s < 60.0
    # Once ready, calls go straight through, their requests untouched.
    assert slices.acquire(request, "slice-2") == "held slice-2"
    assert provider.requests[-1] is request


def test_calls_fail_naming_why_the_cluster_did_not_come_up() -> None:
    slices = deferred.DeferredSlices()
    request = SliceRequest(accelerator_type="v4-8", timeout_s=60.0)
    acquired, acquire = _in_thread(lambda: slices.acquire(request, "slice-1"))
    slices.failed(ConnectionError("jaxpod serve: set RAY_ADDRESS"))
    assert acquired.wait(30)
    with pytest.raises(ServiceUnavailableError) as info:
        slices.cluster()
    for error in (acquire[0], info.value):
        assert isinstance(error, ServiceUnavailableError), error
        assert "ConnectionError: jaxpod serve: set RAY_ADDRESS" in str(error)
    slices.ready(_Provider())  # too late: the failure stands
    with pytest.raises(ServiceUnavailableError, match="did not come up"):
        slices.acquire(request, "slice-2")


def test_waiting_for_the_cluster_is_bounded_by_named_time_outs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slices = deferred.DeferredSlices()
    with pytest.raises(AllocationTimeoutError, match="JAXPOD_ALLOCATION_TIMEOUT_S"):
        slices.acquire(SliceRequest(accelerator_type="v4-8", timeout_s=0.2), "s")
    monkeypatch.setenv(deferred.CLUSTER_READY_TIMEOUT.env_var, "0.2")
    with pytest.raises(ServiceUnavailableError, match=deferred.CLUSTER_READY_TIMEOUT.env_var):
        slices.cluster()
