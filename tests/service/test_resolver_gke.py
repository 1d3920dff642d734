"""The GKE resolver: TPU_* and MEGASCALE_* environment variables."""

from __future__ import annotations

import pytest

from jaxpod.service.capacity.resolvers import TPUClusterResolver
from jaxpod.service.capacity.resolvers.base import MegascaleInfo
from jaxpod.service.capacity.resolvers.gke import GkeResolver

V4_16 = {
    "TPU_ACCELERATOR_TYPE": "v4-16",
    "TPU_TOPOLOGY": "2x2x2",
    "TPU_WORKER_ID": "1",
    "TPU_WORKER_HOSTNAMES": "slice-a-0.svc,slice-a-1.svc",
    "TPU_NAME": "slice-a",
}


def test_single_slice() -> None:
    info = GkeResolver(V4_16).resolve()
    assert info.environment == "gke"
    assert (info.current_slice, info.worker_id, info.megascale) == ("slice-a", 1, None)
    (s,) = info.slices
    assert (s.name, s.accelerator_type, s.topology, s.num_hosts) == (
        "slice-a", "v4-16", "2x2x2", 2)
    assert s.host_addresses == ("slice-a-0.svc", "slice-a-1.svc")
    assert [h.worker_id for h in s.hosts] == [0, 1]
    assert s.coordinator_address == "slice-a-0.svc:8482"


def test_tpu_cluster_resolver_surface() -> None:
    r = TPUClusterResolver(resolver=GkeResolver(V4_16))
    assert (r.environment, r.slice_name, r.accelerator_type, r.topology) == (
        "gke", "slice-a", "v4-16", "2x2x2")
    assert (r.num_hosts, r.worker_id, r.task_id) == (2, 1, 1)
    assert r.host_addresses == ("slice-a-0.svc", "slice-a-1.svc")
    assert r.coordinator_address == r.master() == "slice-a-0.svc:8482"
    assert r.num_accelerators() == {"TPU": 4}
    assert r.cluster_spec() == {"worker": ["slice-a-0.svc", "slice-a-1.svc"]}


def test_v6e_counts_chips() -> None:
    env = {
        "TPU_ACCELERATOR_TYPE": "v6e-16",
        "TPU_TOPOLOGY": "4x4",
        "TPU_WORKER_ID": "3",
        "TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4",
    }
    r = TPUClusterResolver(resolver=GkeResolver(env))
    assert (r.num_hosts, r.worker_id, r.num_accelerators()) == (4, 3, {"TPU": 4})
    assert r.slice_name == "gke-v6e-16"  # TPU_NAME unset: derived


def test_single_host_needs_no_host_list() -> None:
    info = GkeResolver({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}).resolve()
    (s,) = info.slices
    assert (s.num_hosts, s.chips_per_host, s.host_addresses, info.worker_id) == (
        1, 8, ("localhost",), 0)


def test_chips_per_host_bounds_resolve_a_two_vm_v6e_8() -> None:
    env = {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_TOPOLOGY": "2x4",
           "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_WORKER_ID": "0",
           "TPU_WORKER_HOSTNAMES": "h0,h1"}
    (s,) = GkeResolver(env).resolve().slices
    assert (s.num_hosts, s.chips_per_host) == (2, 4)


def test_multi_slice_megascale() -> None:
    env = {**V4_16, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
           "MEGASCALE_COORDINATOR_ADDRESS": "slice-0-0.svc:8080", "MEGASCALE_PORT": "9000"}
    r = TPUClusterResolver(resolver=GkeResolver(env))
    assert r.megascale == MegascaleInfo(2, 1, "slice-0-0.svc", 9000)
    # Multi-slice: JAX's coordinator is slice 0's worker 0, not this slice's.
    assert r.coordinator_address == "slice-0-0.svc:8482"


@pytest.mark.parametrize("hostnames", ["h0,,h1", "h0, ,h1", "h0;h1", "", "h0,h1,", "h 0,h1",
                                       "h0:8470,h1:8470"])
def test_malformed_hostnames_name_the_variable(hostnames: str) -> None:
    env = {**V4_16, "TPU_WORKER_HOSTNAMES": hostnames}
    with pytest.raises(ValueError, match=r"TPU_WORKER_HOSTNAMES=.* is malformed"):
        GkeResolver(env).resolve()


def test_host_count_must_match_accelerator_type() -> None:
    env = {**V4_16, "TPU_WORKER_HOSTNAMES": "h0,h1,h2"}
    with pytest.raises(ValueError, match=r"TPU_WORKER_HOSTNAMES=.*lists 3 host\(s\), but the "
                                         r"accelerator type has 2"):
        GkeResolver(env).resolve()


def test_multi_host_without_host_list() -> None:
    env = {k: v for k, v in V4_16.items() if k != "TPU_WORKER_HOSTNAMES"}
    with pytest.raises(ValueError, match="TPU_WORKER_HOSTNAMES is not set, but a v4-16 slice"):
        GkeResolver(env).resolve()


@pytest.mark.parametrize("worker_id", ["2", "-1", "x", ""])
def test_bad_worker_id(worker_id: str) -> None:
    with pytest.raises(ValueError, match="TPU_WORKER_ID"):
        GkeResolver({**V4_16, "TPU_WORKER_ID": worker_id}).resolve()


def test_topology_must_match_type() -> None:
    with pytest.raises(ValueError, match=r"TPU_ACCELERATOR_TYPE='v4-16', TPU_TOPOLOGY='2x2x4'"):
        GkeResolver({**V4_16, "TPU_TOPOLOGY": "2x2x4"}).resolve()


def test_unknown_type_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"TPU_ACCELERATOR_TYPE='v9-16'.*Known types"):
        GkeResolver({**V4_16, "TPU_ACCELERATOR_TYPE": "v9-16"}).resolve()


def test_missing_type() -> None:
    env = {k: v for k, v in V4_16.items() if k != "TPU_ACCELERATOR_TYPE"}
    with pytest.raises(ValueError, match="TPU_ACCELERATOR_TYPE is not set"):
        GkeResolver(env).resolve()


@pytest.mark.parametrize(("extra", "variable"), [
    ({"MEGASCALE_NUM_SLICES": "2"}, "MEGASCALE_COORDINATOR_ADDRESS is not set"),
    ({"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "2",
      "MEGASCALE_COORDINATOR_ADDRESS": "c"}, "MEGASCALE_SLICE_ID='2'"),
    ({"MEGASCALE_NUM_SLICES": "0"}, "MEGASCALE_NUM_SLICES='0'"),
    ({"MEGASCALE_SLICE_ID": "1"}, "MEGASCALE_NUM_SLICES is not"),
])
def test_bad_megascale(extra: dict[str, str], variable: str) -> None:
    with pytest.raises(ValueError, match=variable):
        GkeResolver({**V4_16, **extra}).resolve()


def test_presence() -> None:
    assert GkeResolver(V4_16).is_present()
    assert GkeResolver({"TPU_WORKER_ID": "0"}).is_present()
    assert not GkeResolver({"HOME": "/root"}).is_present()


def test_named_slice_must_exist() -> None:
    with pytest.raises(ValueError, match=r"No TPU slice named 'other'.*'slice-a'"):
        TPUClusterResolver("other", resolver=GkeResolver(V4_16))
