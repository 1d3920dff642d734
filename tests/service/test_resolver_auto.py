"""auto()'s order and the local resolver (Ray's place in the order: test_local_cluster.py)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from jaxpod.service.capacity.resolvers import (
    AUTO_ORDER,
    ClusterResolver,
    GceResolver,
    GkeResolver,
    LocalResolver,
    TPUClusterResolver,
    auto,
)

GKE_ENV = {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_WORKER_ID": "0"}


def _candidates(environ: dict[str, str]) -> list[ClusterResolver]:
    return [GkeResolver(environ), GceResolver(environ=environ), LocalResolver()]


def test_documented_order() -> None:
    assert AUTO_ORDER == ("gke", "gce", "ray", "local")


def test_gke_wins_over_gce_and_local() -> None:
    environ = {**GKE_ENV, "GCE_METADATA_IP": "127.0.0.1:9"}
    assert auto(_candidates(environ)).environment == "gke"


def test_gce_when_its_metadata_host_is_set() -> None:
    assert auto(_candidates({"GCE_METADATA_IP": "127.0.0.1:9"})).environment == "gce"


def test_local_when_nothing_else() -> None:
    assert auto(_candidates({})).environment == "local"


def test_local_resolver_on_cpu() -> None:
    info = LocalResolver().resolve()
    count = len(jax.local_devices())
    (s,) = info.slices
    assert (s.accelerator_type, s.num_hosts, s.chips_per_host) == (f"cpu-{count}", 1, count)
    assert (info.current_slice, info.worker_id) == ("local", 0)
    r = TPUClusterResolver("local")
    assert (r.environment, r.num_hosts, r.worker_id) == ("local", 1, 0)
    assert r.num_accelerators() == {"CPU": count}


@pytest.mark.parametrize(("kind", "count", "expected"), [
    ("TPU v4", 4, "v4-8"),
    ("TPU v5 lite", 8, "v5litepod-8"),
    ("TPU v5", 4, "v5p-8"),
    ("TPU v6 lite", 4, "v6e-4"),
])
def test_local_resolver_on_tpu_devices(kind: str, count: int, expected: str) -> None:
    devices = [SimpleNamespace(platform="tpu", device_kind=kind)] * count
    r = TPUClusterResolver(resolver=LocalResolver(lambda: devices))
    assert r.accelerator_type == expected
    assert r.num_accelerators() == {"TPU": count}


def test_ambiguous_slice_needs_a_name() -> None:
    from jaxpod.service.capacity.resolvers.base import ClusterInfo, HostInfo, SliceInfo

    def one(name: str) -> SliceInfo:
        return SliceInfo(name, "v4-8", "2x2x1", 4, 1, 1, (HostInfo(0, "h", 4),))

    class TwoSlices:
        environment = "ray"

        def is_present(self) -> bool:
            return True

        def resolve(self) -> ClusterInfo:
            return ClusterInfo("ray", "a test cluster", (one("a"), one("b")))

    r = TPUClusterResolver(resolver=TwoSlices())
    with pytest.raises(ValueError, match=r"has 2 TPU slices \('a', 'b'\).*tpu='<slice name>'"):
        _ = r.slice_name
    assert TPUClusterResolver("b", resolver=TwoSlices()).slice_name == "b"
