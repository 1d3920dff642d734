"""The coordinator service end to end: a real ``jaxpod serve --local`` process.

One service per module (two simulated v6e-8 slices and a v4-16, a token and a short
default lease), driven over real gRPC on loopback by real clients: health and
reflection, authentication, concurrent sessions and their isolation, lease expiry,
bad input of every kind (each a specific error, after which the service still
serves), freeing values on garbage collection, and a graceful stop on SIGTERM (its
own short-lived service). Every numeric result is compared with numpy.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import itertools
import os
import signal
import subprocess
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families
from serve_process import (
    PROCESSES,
    Service,
    all_gone,
    kill_service,
    running_service,
    start_service,
)

import jaxpod
from jaxpod.client import rpc
from jaxpod.client.handles import RemotePerReplica
from jaxpod.client.remote import RemoteStrategy
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import coordinator_pb2_grpc as pb_grpc
from jaxpod.proto import tensors
from jaxpod.service.capacity.local_cluster import descendants, is_running
from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

SLICES = "v6e-8,v6e-8,v4-16"
DEFAULT_LEASE_S = 3.0
SERVICE_NAME = "jaxpod.v1.Coordinator"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("coordinator") / "serve.log"
    with running_service(log, SLICES, lease_s=DEFAULT_LEASE_S, args=PROCESSES) as running:
        yield running


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    c = service.connect(lease_s=120)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def strategy(client: Any) -> Iterator[RemoteStrategy]:
    """The module's v4-16 strategy: 8 replicas on 2 hosts."""
    s = client.strategy("v4-16", timeout_s=120)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def stub(service: Service) -> Iterator[pb_grpc.CoordinatorStub]:
    with grpc.insecure_channel(service.address, options=tensors.channel_options()) as ch:
        yield pb_grpc.CoordinatorStub(ch)


def _raw_error(call: Any, request: Any, metadata: Any, what: str = "call") -> Any:
    """Makes a raw stub call that must fail; returns the gRPC error and its exception."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60, metadata=metadata)
    return info.value, rpc.error_from(info.value, what)


@dataclass(frozen=True)
class _OpError:
    """A failed stream operation, read like a failed call's ``grpc.RpcError``."""

    failure: pb.OpFailure

    def code(self) -> grpc.StatusCode:
        return rpc.status_code(self.failure.code)

    def details(self) -> str:
        return self.failure.details


def _raw_run(stub: Any, request: pb.RunRequest, metadata: Any) -> Any:
    """Sends one raw ``run`` operation that must fail on a stream of its own; returns
    its failure and the exception it stands for. Its number is 0, below the client's
    (which start at 1): the service waits for a slice's operations by number, so a
    number beyond the client's would let its calls run before their operations."""
    op = pb.SliceOp(op=0, run=request)
    replies = [r for batch in stub.Stream(iter([pb.SliceOps(ops=[op])]), timeout=60,
                                          metadata=metadata) for r in batch.replies]
    assert len(replies) == 1 and replies[0].HasField("failure"), replies
    failure = replies[0].failure
    error = _OpError(failure)
    return error, rpc.error_from_parts(error.code(), failure.details, failure.error,
                                       failure.traceback, "run")


# ---------------------------------------------------------------- step functions
class StepFailedError(Exception):
    """Raised by a step function; defined here, so it travels to the workers by value."""


def _affine(x: jax.Array) -> jax.Array:
    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    return x * 3.0 + ctx.replica_id_in_sync_group


def _square_all_reduce(x: jax.Array) -> jax.Array:
    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce("SUM", x * x)


def _failing_step(x: jax.Array) -> jax.Array:
    raise StepFailedError(f"step refused input of shape {tuple(x.shape)}")


def _sum_rows(x: jax.Array) -> jax.Array:
    return jnp.sum(x, axis=0)


def _assert_serving(strategy: RemoteStrategy, seed: int = 0) -> None:
    """A normal run on ``strategy``, compared with numpy."""
    x = np.random.default_rng(seed).normal(size=(5,)).astype(np.float32)
    got = strategy.experimental_local_results(strategy.run(_affine, args=(x,)))
    assert len(got) == strategy.num_replicas_in_sync
    for replica, part in enumerate(got):
        np.testing.assert_allclose(part, x * 3.0 + replica, rtol=1e-6)


def _label(client: Any) -> str:
    return tensors.holder_label(client.session_id)


def _holders(client: Any) -> dict[str, str]:
    return {s["name"]: s["holder"] for s in client.cluster()}


# ----------------------------------------------------------------------- shutdown
# First in the module, so its own service runs before the shared one starts.
def _idle_step(state: Any, batch: Any) -> Any:
    return state, {}


def test_graceful_shutdown_finishes_calls_in_flight(tmp_path: Path) -> None:
    # A grace far longer than the test waits: the service must exit once the calls in
    # flight are done, while an op stream and a job watch stay open and idle.
    own = start_service(tmp_path / "serve.log", "v6e-8", args=PROCESSES,
                         env={"JAXPOD_SHUTDOWN_GRACE_S": "3600"})
    in_flight_s = 120.0
    started = descendants(own.process.pid)  # for clean-up, should the test fail early
    c = own.connect(lease_s=120)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        s = c.strategy("v6e-8", num_replicas=2, timeout_s=120)

        # In flight 1: a result stream (64 MiB), of which only the first message is read.
        n = 8 * 1024 * 1024

        def ramp() -> jax.Array:
            ctx = jaxpod.get_replica_context()
            assert ctx is not None
            return jnp.arange(n, dtype=jnp.float32) + ctx.replica_id_in_sync_group

        value = s.run(ramp)
        stream = c.stub.LocalResults(
            pb.ValueRequest(session_id=c.session_id, slice_id=s.slice_id,
                            value=pb.Tree(value=pb.ValueRef(id=value.id, slice_id=s.slice_id))),
            timeout=120, metadata=c.metadata)
        first = next(stream)
        assert first.HasField("skeleton")

        # In flight 2: a run whose step function (traced on the worker) waits for a file.
        started_file, release_file = tmp_path / "started", tmp_path / "release"
        gated = _gated_step(str(started_file), str(release_file))
        in_flight = pool.submit(s.run, gated, (np.arange(4, dtype=np.float32),))
        assert wait_for(lambda: started_file.exists() or in_flight.done(), 120)
        assert not in_flight.done(), in_flight.exception()

        # Open and idle: a watch of a job queued behind the strategy's slice.
        job = c.submit(_idle_step, steps=1, accelerator_type="v6e-8")
        watch = c.stub.WatchJob(pb.JobRequest(job_id=job.id), timeout=120,
                                metadata=c.metadata)
        assert next(watch).state == "PENDING"

        # Open and idle: another session's acquire, waiting for the slice the strategy
        # holds for as long as it allows (an hour).
        waiting = pool.submit(own.connect(lease_s=120).strategy, "v6e-8", num_replicas=2,
                              timeout_s=3600)
        assert wait_for(lambda: "waits for a free slice" in own.log_tail(10**7)
                        or waiting.done(), 60)
        assert not waiting.done(), waiting.exception()

        started.update(descendants(own.process.pid))  # now with the slice's host worker
        assert started, "the service started no host worker?"
        own.process.send_signal(signal.SIGTERM)
        # The watch ends as the service starts to stop, saying so: the client's
        # job.wait() takes UNAVAILABLE as a service going away and reconnects.
        seen = []
        with pytest.raises(grpc.RpcError) as ended:
            seen += [status.state for status in watch]
        assert all(state == "PENDING" for state in seen), seen
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        assert "the service is stopping" in (ended.value.details() or ""), ended.value
        with pytest.raises(jaxpod.ServiceUnavailableError,
                           match="AcquireSlice: the service is stopping"):
            waiting.result(timeout=60)

        def refused() -> BaseException | None:
            try:
                c.stub.ClusterStatus(pb.Empty(), timeout=10, metadata=c.metadata)
            except grpc.RpcError as e:
                error = rpc.error_from(e, "cluster")
                if isinstance(error, jaxpod.ServiceUnavailableError | jaxpod.SessionError):
                    return error
                # A call that lands while the server is entering shutdown may be
                # cancelled instead (reported as a plain JaxpodError); nothing else.
                assert e.code() == grpc.StatusCode.CANCELLED, error
            return None

        assert wait_for(refused, 30), "new calls still accepted 30s after SIGTERM"
        with pytest.raises((jaxpod.ServiceUnavailableError, jaxpod.SessionError)):
            c.cluster()
        with pytest.raises((jaxpod.ServiceUnavailableError, jaxpod.SessionError)):
            s.run(_affine, args=(np.ones(2, np.float32),))
        with pytest.raises(jaxpod.ServiceUnavailableError):
            own.connect()
        assert own.process.poll() is None  # still finishing the calls in flight
        assert not in_flight.done()

        release_file.touch()
        result = in_flight.result(timeout=in_flight_s)
        assert isinstance(result, RemotePerReplica)
        assert (result.shape, result.dtype) == ((4,), np.dtype(np.float32))
        parts = tensors.read_result(itertools.chain([first], stream))
        assert len(parts) == 2
        for replica, part in enumerate(parts):
            np.testing.assert_array_equal(part, np.arange(n, dtype=np.float32) + replica)

        try:  # the strategy's op stream is still open, with nothing in flight
            code = own.process.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the service waited on idle calls instead of exiting "
                                 f"once the calls in flight were done:\n{own.log_tail()}"
                                 ) from None
        assert code == 0, own.log_tail()
        survivors = all_gone(started, 30)
        assert not survivors, f"processes of the service survived its exit: {survivors}"
    finally:
        (tmp_path / "release").touch()
        pool.shutdown(wait=True, cancel_futures=True)
        c.close()
        kill_service(own)
        for pid, start in started.items():
            if is_running(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _gated_step(started: str, release: str) -> Any:
    def gated(x: jax.Array) -> jax.Array:
        # Runs while the worker traces the step: the Run call stays in flight.
        Path(started).touch()
        if not wait_for(lambda: os.path.exists(release), 120):
            raise TimeoutError(f"{release} never appeared")
        return x * 2.0 + 1.0

    return gated


# ------------------------------------------------------------- health, auth
def test_health_and_reflection(service: Service) -> None:
    with grpc.insecure_channel(service.address) as channel:  # no token: both are open
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        described = descriptor_pool.DescriptorPool(database).FindServiceByName(SERVICE_NAME)
        ours = pb.DESCRIPTOR.services_by_name["Coordinator"]
        assert sorted(described.methods_by_name) == sorted(ours.methods_by_name)
        assert described.methods_by_name["Stream"].output_type.full_name == "jaxpod.v1.SliceReplies"


def test_token_is_required(service: Service, monkeypatch: pytest.MonkeyPatch,
                           stub: pb_grpc.CoordinatorStub) -> None:
    monkeypatch.delenv("JAXPOD_TOKEN", raising=False)
    with pytest.raises(jaxpod.AuthenticationError, match="refused the token") as wrong:
        jaxpod.connect(service.address, token="not-the-token")
    assert "taken from jaxpod.connect(token=...)" in "\n".join(wrong.value.__notes__)
    with pytest.raises(jaxpod.AuthenticationError, match="carried none") as missing:
        jaxpod.connect(service.address)
    assert "No token was given" in "\n".join(missing.value.__notes__)
    monkeypatch.setenv("JAXPOD_TOKEN", "also-wrong")
    with pytest.raises(jaxpod.AuthenticationError, match="refused the token") as from_env:
        jaxpod.connect(service.address)
    assert "taken from $JAXPOD_TOKEN" in "\n".join(from_env.value.__notes__)
    for metadata in ((), (("authorization", "Bearer wrong"),),
                     (("authorization", service.token),)):  # not as a bearer token
        error, mapped = _raw_error(stub.ClusterStatus, pb.Empty(), metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert isinstance(mapped, jaxpod.AuthenticationError)
    # Streaming methods are guarded too.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Fetch(pb.ValueRequest(), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # And with the token, the same call succeeds.
    reply = stub.ClusterStatus(pb.Empty(), timeout=30, metadata=service.metadata)
    assert sorted(s.accelerator_type for s in reply.slices) == sorted(SLICES.split(","))


def test_default_lease_comes_from_the_service(service: Service) -> None:
    with service.connect() as c:
        assert c.lease_s == pytest.approx(DEFAULT_LEASE_S)
        assert c.server_version == jaxpod.__version__


# ------------------------------------------------------------ sessions
def test_concurrent_clients_are_isolated(service: Service, client: Any,
                                         strategy: RemoteStrategy) -> None:
    clients = [service.connect(lease_s=120) for _ in range(2)]
    barrier = threading.Barrier(2, timeout=120)
    rng = np.random.default_rng(1)
    inputs = [[rng.normal(size=(6,)).astype(np.float32) for _ in range(3)] for _ in range(2)]

    def work(index: int) -> tuple[RemoteStrategy, Any, list[Any]]:
        s = clients[index].strategy("v6e-8", num_replicas=2, timeout_s=120)
        barrier.wait()  # both hold a slice; now run at the same time
        results: list[Any] = []
        last = None
        for x in inputs[index]:
            if index == 0:
                last = s.run(_affine, args=(x,))
                results.append(s.gather(last, axis=0))
            else:
                last = s.run(_square_all_reduce, args=(x,))
                results.append(s.reduce("SUM", last))
        return s, last, results

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(work, i) for i in range(2)]
            (sa, _va, ra), (sb, vb, rb) = (f.result(timeout=240) for f in futures)
        for x, got in zip(inputs[0], ra, strict=True):
            np.testing.assert_allclose(got, np.concatenate([x * 3.0, x * 3.0 + 1.0]),
                                       rtol=1e-6)
        for x, got in zip(inputs[1], rb, strict=True):
            np.testing.assert_allclose(got, 4.0 * x * x, rtol=1e-5)

        # One client cannot use another's values or slices.
        with pytest.raises(jaxpod.HandleError, match=r"(?i)values cannot move between strategies"):
            sa.run(_affine, args=(vb,))
        ca, cb = clients
        # The service checks too, whatever a client sends.
        foreign = pb.Tree(tuple=pb.Sequence(items=[
            pb.Tree(value=pb.ValueRef(id=vb.id, slice_id=sb.slice_id))]))
        error, mapped = _raw_run(ca.stub, pb.RunRequest(
            session_id=ca.session_id, slice_id=sa.slice_id, function_id="x",
            args=foreign, kwargs=tensors.encode({})), ca.metadata)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert isinstance(mapped, jaxpod.HandleError)
        assert f"lives on slice {sb.slice_id}" in str(mapped)
        error, mapped = _raw_run(ca.stub, pb.RunRequest(
            session_id=ca.session_id, slice_id=sb.slice_id, function_id="x",
            args=tensors.encode(()), kwargs=tensors.encode({})), ca.metadata)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert isinstance(mapped, jaxpod.HandleError)
        assert "not held by this session" in str(mapped)
        # B's value is untouched by A's attempts.
        np.testing.assert_allclose(sb.reduce("SUM", vb), rb[-1], rtol=1e-6)

        holders = _holders(client)
        v6e = {name: h for name, h in holders.items() if "v6e-8" in name}
        assert sorted(v6e.values()) == sorted([_label(ca), _label(cb)])
        assert [h for name, h in holders.items() if "v4-16" in name] == [_label(client)]
        # status names holders without giving away their session ids (which authorize)
        assert not {c.session_id for c in (client, ca, cb)} & set(holders.values())
        assert holders == _holders(ca) == _holders(cb)
    finally:
        for c in clients:
            c.close()
    # Closing a client releases its slice (its CloseSession returns once released;
    # the lease, 120 s, would take far longer than this deadline).
    def released() -> bool:
        return all(h == "" for name, h in _holders(client).items() if "v6e-8" in name)

    assert wait_for(released, 30), (_holders(client), service.log_tail(4000))
    _assert_serving(strategy)


def test_lease_expiry_releases_the_slice(service: Service, client: Any) -> None:
    blocker = client.strategy("v6e-8", num_replicas=2, timeout_s=120)  # the other v6e-8
    doomed = service.connect(lease_s=1.5)
    replacement = None
    try:
        assert doomed.lease_s == pytest.approx(1.5)
        s = doomed.strategy("v6e-8", num_replicas=2, timeout_s=120)
        _assert_serving(s)
        held = [n for n, h in _holders(client).items() if h == _label(doomed)]
        assert len(held) == 1 and "v6e-8" in held[0]
        name = held[0]
        assert all(h for n, h in _holders(client).items() if "v6e-8" in n)  # none free

        # The client goes silent without closing its session (as if its process hung).
        doomed._closed.set()
        doomed._heartbeat.join(timeout=30)
        assert not doomed._heartbeat.is_alive()
        assert wait_for(lambda: _holders(client)[name] == "", 60), (
            f"slice {name} still held after the lease ran out:\n{service.log_tail()}")
        error, mapped = _raw_error(client.stub.Heartbeat,
                                   pb.SessionRequest(session_id=doomed.session_id),
                                   client.metadata)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert isinstance(mapped, jaxpod.SessionError)
        assert "lease expired" in str(mapped)

        # The only free v6e-8 is the released one: another client gets it and runs.
        replacement = client.strategy("v6e-8", num_replicas=2, timeout_s=60)
        assert _holders(client)[name] == _label(client)
        _assert_serving(replacement, seed=3)
    finally:
        doomed._channel.close()
        blocker.close()
        if replacement is not None:
            replacement.close()


# ------------------------------------------------------------------- bad input
def test_unpicklable_step_function(strategy: RemoteStrategy) -> None:
    lock = threading.Lock()

    def locked(x: jax.Array) -> jax.Array:
        with lock:
            return x

    with pytest.raises(TypeError, match="cannot be pickled"):
        strategy.run(locked, args=(np.ones(2, np.float32),))
    _assert_serving(strategy)


def test_unsupported_arguments_name_their_path(strategy: RemoteStrategy,
                                               client: Any) -> None:
    with pytest.raises(TypeError, match=r"args\[1\]\['x'\]: values of type builtins.object"):
        strategy.run(_affine, args=(np.ones(2, np.float32), {"x": object()}))
    with pytest.raises(TypeError, match=r"kwargs\['y'\]\[0\]"):
        strategy.run(_affine, args=(np.ones(2, np.float32),), kwargs={"y": [object()]})
    # Malformed trees built by hand are refused by the service, which names the problem.
    ids = {"session_id": client.session_id, "slice_id": strategy.slice_id}
    for tree, message in (
            (pb.Tree(tuple=pb.Sequence(items=[pb.Tree(streamed=pb.Tensor(dtype="float32"))])),
             "A streamed node cannot be an argument"),
            (pb.Tree(tuple=pb.Sequence(items=[pb.Tree(tensor=pb.Tensor(
                dtype="float32", shape=[4], data=b"\0" * 12))])), "needs 16 bytes"),
            (pb.Tree(tuple=pb.Sequence(items=[pb.Tree(blob=999)])),
             "Uploaded tensor #999 is not held")):
        error, mapped = _raw_run(client.stub, pb.RunRequest(
            **ids, function_id="f", args=tree, kwargs=tensors.encode({})), client.metadata)
        assert message in error.details()
        assert isinstance(mapped, ValueError), mapped
    _assert_serving(strategy)


def test_freed_handle_is_refused(client: Any, strategy: RemoteStrategy) -> None:
    value = strategy.run(_affine, args=(np.ones(3, np.float32),))
    client.stub.Free(pb.FreeRequest(session_id=client.session_id,
                                    slice_id=strategy.slice_id,
                                    dropped=pb.Dropped(value_ids=[value.id])),
                     timeout=30, metadata=client.metadata)
    with pytest.raises(jaxpod.HandleError, match=f"Value #{value.id} is not held"):
        strategy.run(_affine, args=(value,))
    with pytest.raises(jaxpod.HandleError, match=f"Value #{value.id} is not held"):
        strategy.reduce("SUM", value)
    # A handle forged from an id that was never handed out fares no better.
    forged = RemotePerReplica(strategy, pb.ValueRef(
        id=10**9, slice_id=strategy.slice_id, shape=[3], dtype="float32"))
    with pytest.raises(jaxpod.HandleError, match=f"Value #{10**9} is not held"):
        strategy.experimental_local_results(forged)
    _assert_serving(strategy)


def test_calls_after_close(service: Service, client: Any, strategy: RemoteStrategy) -> None:
    c = service.connect(lease_s=120)
    s = c.strategy("v6e-8", num_replicas=2, timeout_s=120)
    value = s.run(_affine, args=(np.ones(2, np.float32),))
    slice_id, session_id = s.slice_id, c.session_id

    s.close()
    with pytest.raises(jaxpod.SessionError, match="strategy is closed"):
        s.run(_affine, args=(np.ones(2, np.float32),))
    with pytest.raises(jaxpod.SessionError):
        s.reduce("SUM", value)
    # The service refuses the released slice too, not only the client.
    error, mapped = _raw_run(c.stub, pb.RunRequest(
        session_id=session_id, slice_id=slice_id, function_id="f",
        args=tensors.encode(()), kwargs=tensors.encode({})), c.metadata)
    assert isinstance(mapped, jaxpod.HandleError) and "was released" in str(mapped)
    with pytest.raises(jaxpod.HandleError, match=r"(?i)values cannot move between strategies"):
        strategy.run(_affine, args=(value,))

    c.close()
    assert session_id not in _holders(client).values()
    with pytest.raises(jaxpod.SessionError, match="client is closed"):
        c.cluster()
    with pytest.raises(jaxpod.SessionError, match="client is closed"):
        c.strategy("v6e-8")
    error, mapped = _raw_error(client.stub.Heartbeat, pb.SessionRequest(session_id=session_id),
                               client.metadata)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(mapped, jaxpod.SessionError)
    _assert_serving(strategy)


def test_messages_over_the_size_limit(service: Service, client: Any,
                                      strategy: RemoteStrategy) -> None:
    big = np.ones(70 * 1024 * 1024 // 8, dtype=np.float64)  # 70 MiB

    def captures_big(x: jax.Array) -> jax.Array:
        return x + big[0]

    with pytest.raises(jaxpod.MessageTooLargeError, match="pass that array as an argument"):
        strategy.run(captures_big, args=(np.ones(2, np.float32),))

    # The service's own limit: a request over 64 MiB from a channel without one.
    with grpc.insecure_channel(service.address) as channel:
        raw = pb_grpc.CoordinatorStub(channel)
        error, mapped = _raw_error(raw.DefineFunction, pb.DefineFunctionRequest(
            session_id=client.session_id, slice_id=strategy.slice_id,
            payload=b"\0" * (tensors.MAX_MESSAGE_BYTES + 1024)), service.metadata)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(mapped, jaxpod.MessageTooLargeError)

    # Large arrays as arguments are fine: they are uploaded in chunks.
    x = np.random.default_rng(2).normal(size=(3 * tensors.CHUNK_BYTES // 16, 4))
    got = strategy.experimental_local_results(strategy.run(_sum_rows, args=(x,)))
    assert len(got) == strategy.num_replicas_in_sync
    for part in got:
        np.testing.assert_allclose(part, x.sum(axis=0), rtol=1e-6)
    _assert_serving(strategy)


def test_an_oversized_upload_is_refused_before_it_is_read(
        service: Service, client: Any, strategy: RemoteStrategy) -> None:
    sent: list[int] = []
    chunk = b"\0" * (1 << 20)

    def upload(dtype: str, shape: tuple[int, ...], chunks: int) -> Iterator[pb.TensorChunk]:
        yield pb.TensorChunk(session_id=client.session_id, dtype=dtype, shape=shape,
                             data=chunk)
        for _ in range(chunks):
            sent.append(len(chunk))
            yield pb.TensorChunk(data=chunk)

    with grpc.insecure_channel(service.address, options=tensors.channel_options()) as channel:
        raw = pb_grpc.CoordinatorStub(channel)
        # 1 TiB declared (8 PiB by int64 wrap-around must not pass either), 1 GiB offered
        for shape in ((1 << 38,), (1 << 31, 1 << 31, 1 << 2)):
            sent.clear()
            error, mapped = _raw_error(raw.Put, upload("float32", shape, 1024),
                                       service.metadata)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert isinstance(mapped, jaxpod.MessageTooLargeError)
            assert "declares" in str(mapped) and str(list(shape)) in str(mapped)
            assert sum(sent) < 256 << 20  # the client stopped long before 1 GiB
        # More bytes than the dtype and shape hold
        error, mapped = _raw_error(raw.Put, upload("float32", (4,), 2), service.metadata)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the 16 bytes" in str(mapped)
    _assert_serving(strategy)


#: Bytes no message parses: a varint cut short, wire type 7, a field declaring 4 GiB
#: that never arrive, a varint of eleven bytes.
UNDECODABLE = (b"\x08", b"\x0f", b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 11)


def test_undecodable_requests_are_invalid_arguments_naming_their_method(
        service: Service, strategy: RemoteStrategy) -> None:
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
    with grpc.insecure_channel(service.address, options=tensors.channel_options()) as channel:
        for method, data in itertools.product(methods, UNDECODABLE):
            path = f"/{SERVICE_NAME}/{method.name}"
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary,
                    (True, True): channel.stream_stream}[(method.client_streaming,
                                                          method.server_streaming)]
            call = kind(path)
            with pytest.raises(grpc.RpcError) as info:
                reply = call(iter([data]) if method.client_streaming else data, timeout=60,
                             metadata=service.metadata)
                if method.server_streaming:
                    list(reply)
            error, mapped = info.value, rpc.error_from(info.value, method.name)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.name, data, error)
            assert isinstance(mapped, jaxpod.MalformedRequestError), (method.name, mapped)
            assert f"{method.name}: the request is not a valid " in str(mapped)
    _assert_serving(strategy)


def test_protocol_and_runtime_version_mismatch(client: Any, strategy: RemoteStrategy) -> None:
    request = pb.OpenSessionRequest(client_version="9.9.9", protocol_version=999,
                                    runtime_versions=client.runtime_versions)
    error, mapped = _raw_error(client.stub.OpenSession, request, client.metadata)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol {tensors.PROTOCOL_VERSION}" in error.details()
    assert "protocol 999 (jaxpod 9.9.9)" in error.details()
    assert isinstance(mapped, jaxpod.VersionMismatchError)

    versions = {**client.runtime_versions, "jax": "0.0.1"}
    error, mapped = _raw_error(client.stub.OpenSession, pb.OpenSessionRequest(
        protocol_version=tensors.PROTOCOL_VERSION, runtime_versions=versions),
        client.metadata)
    assert isinstance(mapped, jaxpod.VersionMismatchError)
    assert f"jax: client 0.0.1, service {jax.__version__}" in str(mapped)
    _assert_serving(strategy)


def test_user_exception_comes_back_as_its_own_class(strategy: RemoteStrategy) -> None:
    with pytest.raises(StepFailedError, match=r"step refused input of shape \(3,\)") as info:
        strategy.run(_failing_step, args=(np.ones(3, np.float32),))
    assert type(info.value) is StepFailedError
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert "Remote traceback" in notes
    assert "_failing_step" in notes
    _assert_serving(strategy)


# ---------------------------------------------------------------------- memory
def _memory(strategy: RemoteStrategy) -> list[dict[str, int]]:
    return [{k: h[k] for k in ("num_values", "device_bytes", "num_iterators")}
            for h in strategy.stats()]


RESULT_RPCS = ("Reduce", "Gather", "LocalResults", "Fetch")


def _result_rpc_calls(service: Service) -> dict[str, int]:
    """How many calls of each result-streaming RPC the service has answered."""
    text = httpx.get(f"{service.http_url}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {service.token}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counted = dict.fromkeys(RESULT_RPCS, 0)
    for sample in families["jaxpod_rpc_duration_seconds"].samples:
        if sample.name.endswith("_count") and sample.labels["method"] in counted:
            counted[sample.labels["method"]] += int(sample.value)
    return counted


@pytest.mark.parametrize("floats", [4, tensors.INLINE_BYTES // 4 + 8], ids=["small", "large"])
def test_small_results_ride_the_op_stream_and_large_ones_stream_in_chunks(
        service: Service, strategy: RemoteStrategy, floats: int) -> None:
    """A result whose size (known from the handles) fits inline comes back on the
    slice's op stream, calling no result RPC; a larger one streams from its RPC. Both
    are the numpy answer."""
    replicas = strategy.num_replicas_in_sync
    # Small integers: every sum is exact in float32, so the answers are too.
    x = np.random.default_rng(floats).integers(-100, 100, floats).astype(np.float32)
    value = strategy.run(_affine, args=(x,))
    want = np.stack([x * 3 + r for r in range(replicas)])
    before = _result_rpc_calls(service)
    np.testing.assert_array_equal(strategy.reduce("SUM", value, axis=None), want.sum(axis=0))
    np.testing.assert_array_equal(strategy.gather(value, axis=0), want.reshape(-1))
    np.testing.assert_array_equal(np.stack(strategy.experimental_local_results(value)), want)
    np.testing.assert_array_equal(value.array, want)
    calls = {m: n - before[m] for m, n in _result_rpc_calls(service).items()}
    assert calls == dict.fromkeys(RESULT_RPCS, 0 if floats == 4 else 1), calls


def test_stats_count_each_operation_and_its_time(strategy: RemoteStrategy) -> None:
    x = np.ones(3, np.float32)
    strategy.run(_affine, args=(x,))  # defines _affine first
    before = strategy.stats()
    out = strategy.run(_affine, args=(x,))
    after = strategy.stats()
    for b, a in zip(before, after, strict=True):
        assert a["operations"] == b["operations"] + 1  # the run; stats do not count
        assert a["busy_s"] > b["busy_s"]
    np.testing.assert_allclose(out.array[:, 0], 3.0 + np.arange(strategy.num_replicas_in_sync),
                               rtol=1e-6)


def test_values_are_freed_when_garbage_collected(strategy: RemoteStrategy) -> None:
    gc.collect()
    base = _memory(strategy)
    assert len(base) == strategy.num_hosts == 2
    x = np.arange(1024, dtype=np.float32)

    def back_to_base() -> bool:
        gc.collect()
        return _memory(strategy) == base

    for round_ in range(5):  # every round's frees must arrive, not just most
        values = [strategy.run(_affine, args=(x + i,)) for i in range(10)]
        grown = strategy.stats()
        for before, now in zip(base, grown, strict=True):
            assert now["num_values"] == before["num_values"] + 10
            assert now["device_bytes"] >= before["device_bytes"] + 10 * 4 * x.nbytes
        np.testing.assert_allclose(strategy.reduce("SUM", values[-1]),
                                   8 * (x + 9) * 3.0 + sum(range(8)), rtol=1e-6)
        del values
        assert wait_for(back_to_base, 30), (round_, base, _memory(strategy))


def test_a_value_collected_while_the_strategy_holds_its_lock_is_still_freed(
        strategy: RemoteStrategy) -> None:
    # The garbage collector runs finalizers on whatever thread allocates, also inside
    # the strategy's own critical sections: a finalizer that took the strategy's lock
    # there deadlocked a CI run. Collect a value right inside that lock.
    gc.collect()
    base = _memory(strategy)
    value = strategy.run(_affine, args=(np.arange(8, dtype=np.float32),))
    ref = weakref.ref(value)
    with strategy._lock:
        del value
        gc.collect()  # its finalizer runs here, under the lock
        assert ref() is None
    assert wait_for(lambda: gc.collect() >= 0 and _memory(strategy) == base, 30)
