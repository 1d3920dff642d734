"""Hostile input to a real ``jaxpod serve --local``: generated messages to every method.

Hypothesis sends at least 2,000 messages over all the coordinator's methods, with the
service's token (the token check comes first and is tested elsewhere): random bytes,
bytes no message parses, fields declaring lengths that never arrive, and valid
requests with bytes flipped or cut. Every answer must be a status that says what was
wrong (never ``UNKNOWN`` or ``INTERNAL``), and afterwards a normal client must still
get correct results (compared with numpy).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import PROCESSES, Service, running_service

from jaxpod.client import rpc
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors

pytestmark = pytest.mark.multiprocess

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
METHODS = tuple(pb.DESCRIPTOR.services_by_name["Coordinator"].methods)
MESSAGES = 2_000
#: Statuses that say the service did not know what went wrong.
UNEXPLAINED = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("hostile") / "serve.log", "v6e-8",
                         args=PROCESSES) as s:
        yield s


@pytest.fixture(scope="module")
def channel(service: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(service.address, options=tensors.channel_options()) as ch:
        yield ch


def _valid(method: Any) -> bytes:
    """A request the method could take, its string fields filled in."""
    message = getattr(pb, method.input_type.name)()
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING and not field.is_repeated:
            setattr(message, field.name, "x" * 8)
    return bytes(message.SerializeToString())


def _flipped(data: bytes, at: int, value: int) -> bytes:
    if not data:
        return bytes([value])
    at %= len(data)
    return data[:at] + bytes([value]) + data[at + 1:]


@st.composite
def requests(draw: st.DrawFn) -> tuple[Any, bytes]:
    method = draw(st.sampled_from(METHODS))
    valid = _valid(method)
    data = draw(st.one_of(
        st.binary(max_size=64),
        # a length-delimited field declaring up to 4 GiB that never arrive
        st.tuples(st.integers(1, 15), st.binary(max_size=8)).map(
            lambda t: bytes([t[0] << 3 | 2]) + b"\xff\xff\xff\xff\x0f" + t[1]),
        st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)).map(
            lambda t: _flipped(valid, *t)),
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),
        st.binary(max_size=16).map(lambda junk: valid + junk),
    ))
    return method, data


def _call(channel: grpc.Channel, method: Any, data: bytes, metadata: Any
          ) -> grpc.StatusCode:
    """Sends ``data``; returns the status (an operation's failure code on the op
    stream, whose call itself succeeds)."""
    path = f"/{SERVICE_NAME}/{method.name}"
    if method.client_streaming and method.server_streaming:
        batches = list(channel.stream_stream(
            path, response_deserializer=pb.SliceReplies.FromString)(
            iter([data]), timeout=60, metadata=metadata))
        failed = [r.failure.code for b in batches for r in b.replies if r.HasField("failure")]
        return rpc.status_code(failed[0]) if failed else grpc.StatusCode.OK
    if method.client_streaming:
        channel.stream_unary(path)(iter([data]), timeout=60, metadata=metadata)
    elif method.server_streaming:
        list(channel.unary_stream(path)(data, timeout=60, metadata=metadata))
    else:
        channel.unary_unary(path)(data, timeout=60, metadata=metadata)
    return grpc.StatusCode.OK


def test_generated_hostile_messages_get_explained_refusals(
        service: Service, channel: grpc.Channel) -> None:
    sent: list[tuple[str, grpc.StatusCode]] = []

    @settings(max_examples=MESSAGES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def send(request: tuple[Any, bytes]) -> None:
        method, data = request
        try:
            code = _call(channel, method, data, service.metadata)
            assert code not in UNEXPLAINED, (method.name, data, code)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            assert code not in UNEXPLAINED, (method.name, data, e)
        sent.append((method.name, code))

    send()
    print(f"sent {len(sent)} generated messages to {len({m for m, _ in sent})} methods; "
          f"answers: {sorted({c.name for _, c in sent})}")
    assert len(sent) >= MESSAGES
    assert {m for m, _ in sent} == {m.name for m in METHODS}

    # A normal client is served, correctly, after all of it.
    with service.connect() as client, client.strategy("v6e-8") as strategy:
        x = np.arange(6, dtype=np.float32)
        got = strategy.reduce("SUM", strategy.run(lambda v: v * 2, args=(x,)), axis=None)
        np.testing.assert_allclose(got, x * 2 * strategy.num_replicas_in_sync)
