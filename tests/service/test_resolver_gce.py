"""The GCE resolver against a real HTTP metadata server on 127.0.0.1 (never the real one)."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from jaxpod.service.capacity.resolvers.base import MegascaleInfo
from jaxpod.service.capacity.resolvers.gce import GceResolver, HttpMetadataGetter, parse_tpu_env

PREFIX = "/computeMetadata/v1/instance/attributes/"
TPU_ENV = """ACCELERATOR_TYPE: 'v4-16'
CHIPS_PER_HOST_BOUNDS: '2,2,1'
NODE_ID: 'my-tpu'
TOPOLOGY: '2x2x2'
WORKER_ID: '1'
ZONE: 'us-central2-b'
"""
V4_16 = {
    "accelerator-type": "v4-16",
    "agent-worker-number": "1",
    "worker-network-endpoints": "10.130.0.5,10.130.0.6",
    "tpu-env": TPU_ENV,
    "instance-id": "1234567890",
}


class FakeMetadataServer:
    """Serves ``attributes`` like the GCE metadata server; 403 without the flavor header."""

    def __init__(self) -> None:
        self.attributes: dict[str, str] = {}
        self.status: int | None = None  # force this status on every request
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                flavor = self.headers.get("Metadata-Flavor")
                server.requests.append((self.path, flavor))
                key = self.path.removeprefix(PREFIX)
                if server.status is not None:
                    self._reply(server.status, "boom")
                elif flavor != "Google":
                    self._reply(403, "missing Metadata-Flavor header")
                elif self.path.startswith(PREFIX) and key in server.attributes:
                    self._reply(200, server.attributes[key])
                else:
                    self._reply(404, "not found")

            def _reply(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def resolver(self) -> GceResolver:
        return GceResolver(HttpMetadataGetter(self.host))


@pytest.fixture
def metadata() -> Iterator[FakeMetadataServer]:
    server = FakeMetadataServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(timeout=10)


def test_single_slice(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update(V4_16)
    info = metadata.resolver().resolve()
    assert info.environment == "gce"
    assert metadata.host in info.source
    (s,) = info.slices
    assert (s.name, s.accelerator_type, s.topology, s.num_hosts, s.chips_per_host) == (
        "my-tpu", "v4-16", "2x2x2", 2, 4)
    assert s.host_addresses == ("10.130.0.5", "10.130.0.6")
    assert (info.current_slice, info.worker_id, info.megascale) == ("my-tpu", 1, None)
    assert s.coordinator_address == "10.130.0.5:8482"
    assert metadata.requests and all(f == "Google" for _, f in metadata.requests)


def test_old_endpoint_format_and_instance_id_name(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update(V4_16)
    metadata.attributes["worker-network-endpoints"] = (
        "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3")
    metadata.attributes["tpu-env"] = "TOPOLOGY: '2x2x2'\n"
    info = metadata.resolver().resolve()
    assert info.slices[0].host_addresses == ("10.0.0.2", "10.0.0.3")
    assert info.slices[0].name == "1234567890"


def test_multi_slice(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update(V4_16)
    metadata.attributes["tpu-env"] = TPU_ENV + (
        "MEGASCALE_NUM_SLICES: '4'\nMEGASCALE_SLICE_ID: '3'\n"
        "MEGASCALE_COORDINATOR_ADDRESS: '10.0.9.9'\n")
    assert metadata.resolver().resolve().megascale == MegascaleInfo(4, 3, "10.0.9.9", 8081)


def test_missing_accelerator_type(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update({k: v for k, v in V4_16.items() if k != "accelerator-type"})
    with pytest.raises(ValueError, match="GCE metadata attribute 'accelerator-type' is not set"):
        metadata.resolver().resolve()


def test_malformed_endpoints(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update(V4_16)
    metadata.attributes["worker-network-endpoints"] = "a:b,c:d"
    with pytest.raises(ValueError, match=r"'worker-network-endpoints'=.* is malformed"):
        metadata.resolver().resolve()


def test_host_count_mismatch(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update(V4_16)
    metadata.attributes["worker-network-endpoints"] = "10.0.0.1"
    with pytest.raises(ValueError, match=r"'worker-network-endpoints'=.*lists 1 host\(s\)"):
        metadata.resolver().resolve()


def test_server_error_names_the_url(metadata: FakeMetadataServer) -> None:
    metadata.status = 500
    with pytest.raises(ConnectionError, match=r"HTTP 500 for http://127\.0\.0\.1:\d+/"):
        metadata.resolver().resolve()


def test_unreachable_server_names_the_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConnectionError, match="JAXPOD_GCE_METADATA_TIMEOUT_S"):
        GceResolver(HttpMetadataGetter(host, timeout_s=2)).resolve()


def test_gce_metadata_ip_selects_the_server(metadata: FakeMetadataServer) -> None:
    metadata.attributes.update(V4_16)
    resolver = GceResolver(environ={"GCE_METADATA_IP": metadata.host})
    assert resolver.is_present()
    assert resolver.resolve().slices[0].name == "my-tpu"


def test_parse_tpu_env() -> None:
    values = parse_tpu_env(TPU_ENV + "EMPTY: ''\nno colon here\n")
    assert values["TOPOLOGY"] == "2x2x2"
    assert values["NODE_ID"] == "my-tpu"
    assert values["EMPTY"] == ""
    assert "no colon here" not in values
