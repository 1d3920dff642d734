"""The simulated local TPU cluster (the embedded default, one v4-16) and the Ray resolver."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import ray
from ray.util.tpu import get_num_ready_tpu_slices, get_tpu_nodes_for_slice

from jaxpod.service.capacity.allocator import SliceAllocator
from jaxpod.service.capacity.local_cluster import (
    LocalTPUCluster,
    NodeOptions,
    descendants,
    is_running,
    plan_slices,
)
from jaxpod.service.capacity.resolvers import TPUClusterResolver, auto
from jaxpod.service.capacity.resolvers.ray import RayResolver
from jaxpod.service.cli.cluster import run_cluster
from jaxpod.timeouts import wait_for

CLUSTER_SLICES = "v4-16"  # the embedded default: 2 hosts x 4 chips
SLICE = "sim-0-v4-16"


def _tpu_nodes() -> list[dict[str, Any]]:
    return sorted((n for n in ray.nodes() if n["Alive"] and "TPU" in n["Resources"]),
                  key=lambda n: n["Labels"]["ray.io/tpu-worker-id"])


def test_hosts_advertise_what_real_tpu_hosts_do(ray_cluster: LocalTPUCluster) -> None:
    nodes = _tpu_nodes()
    assert len(nodes) == 2
    for worker_id, node in enumerate(nodes):
        expected_resources = {"TPU": 4.0, "CPU": 1.0, "accelerator_type:TPU-V4": 1.0,
                              SLICE: 1.0, "node:127.0.0.1": 1.0}
        if worker_id == 0:
            expected_resources["TPU-v4-16-head"] = 1.0
        resources = {k: v for k, v in node["Resources"].items()
                     if k not in ("memory", "object_store_memory")}
        assert resources == expected_resources
        labels = {k: v for k, v in node["Labels"].items() if k != "ray.io/node-id"}
        assert labels == {
            "ray.io/accelerator-type": "TPU-V4",
            "ray.io/tpu-slice-name": SLICE,
            "ray.io/tpu-worker-id": str(worker_id),
            "ray.io/tpu-topology": "2x2x2",
            "ray.io/tpu-pod-type": "v4-16",
        }
        assert node["NodeManagerAddress"] == "127.0.0.1"


def test_rays_own_tpu_utilities_see_one_ready_slice(ray_cluster: LocalTPUCluster) -> None:
    assert get_num_ready_tpu_slices("2x2x2", "TPU-V4") == 1
    assert len(get_tpu_nodes_for_slice(SLICE)) == 2


def test_ray_resolver_from_the_driver(ray_cluster: LocalTPUCluster) -> None:
    info = RayResolver().resolve()
    assert info.environment == "ray"
    assert ray_cluster.address in info.source
    (s,) = info.slices
    assert (s.name, s.accelerator_type, s.topology, s.num_hosts, s.complete) == (
        SLICE, "v4-16", "2x2x2", 2, True)
    assert [h.node_id for h in s.hosts] == [n["NodeID"] for n in _tpu_nodes()]
    assert (info.current_slice, info.worker_id, info.notes) == (None, None, ())


def test_auto_picks_ray_when_connected(ray_cluster: LocalTPUCluster,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID",
                 "GCE_METADATA_IP"):
        monkeypatch.delenv(name, raising=False)
    assert auto().environment == "ray"
    r = TPUClusterResolver()
    assert (r.slice_name, r.num_hosts, r.worker_id, r.num_accelerators()) == (
        SLICE, 2, None, {"TPU": 4})


@ray.remote(num_cpus=0)
def _inside_host() -> dict[str, Any]:
    """What a worker on a simulated host sees: GKE variables, Ray's view, JAX on CPU."""
    import jax

    from jaxpod.service.capacity.resolvers.gke import GkeResolver
    from jaxpod.service.capacity.resolvers.ray import RayResolver

    gke = GkeResolver().resolve()
    on_ray = RayResolver().resolve()
    return {
        "auto": TPUClusterResolver().environment,
        "gke": (gke.current_slice, gke.worker_id, gke.slices[0].num_hosts),
        "ray": (on_ray.current_slice, on_ray.worker_id),
        "jax": (jax.local_device_count(), jax.devices()[0].platform),
    }


def test_workers_on_simulated_hosts(ray_cluster: LocalTPUCluster) -> None:
    """Bundles of an allocation land on their hosts, which look like TPU pods to code there."""
    with SliceAllocator().allocate("v4-16", timeout_s=30) as allocation:
        (s,) = allocation.slices
        refs = [_inside_host.options(scheduling_strategy=s.scheduling_strategy(h.worker_id))
                .remote() for h in s.hosts]
        seen = ray.get(refs, timeout=120)
    for worker_id, view in enumerate(seen):
        assert view["auto"] == "gke"
        assert view["gke"] == (SLICE, worker_id, 2)
        assert view["ray"] == (SLICE, worker_id)
        assert view["jax"] == (4, "cpu")  # one virtual device per chip


def test_cli_table(ray_cluster: LocalTPUCluster, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cluster(argparse.Namespace(address=ray_cluster.address)) == 0
    out = capsys.readouterr().out
    assert out.startswith("environment: ray (ray at 127.0.0.1:")
    header, *rows = out.splitlines()[1:4]
    assert header.split() == ["SLICE", "TYPE", "TOPOLOGY", "STATE", "WORKER", "ADDRESS",
                              "CHIPS", "TPU", "FREE", "NODE"]
    for worker_id, row in enumerate(rows):
        assert row.split()[:8] == [SLICE, "v4-16", "2x2x2", "idle", str(worker_id),
                                   "127.0.0.1", "4", "4"]
    assert "1 slice(s), 2 host(s)" in out
    assert run_cluster(argparse.Namespace(address=ray_cluster.address, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in data["slices"]] == [SLICE]


def _python(code: str, **kwargs: object) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], text=True,
                            env=env, **kwargs)  # type: ignore[call-overload]


def test_cli_with_its_own_simulated_slices() -> None:
    proc = _python("""
        import argparse, sys
        from jaxpod.service.cli.cluster import run_cluster
        sys.exit(run_cluster(argparse.Namespace(slices="v4-8")))
    """, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "sim-0-v4-8  v4-8  2x2x1     idle   0" in out


def test_parent_death_leaves_no_process() -> None:
    """A driver killed with SIGKILL takes its simulated cluster down with it."""
    proc = _python("""
        import sys
        from jaxpod.service.capacity.local_cluster import LocalTPUCluster
        cluster = LocalTPUCluster("v4-8").start()
        print(cluster.pid, flush=True)
        sys.stdin.read()
    """, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with proc:
        assert proc.stdout is not None
        launcher = int(proc.stdout.readline())
        tree = descendants(proc.pid)
        assert launcher in tree and len(tree) > 3  # launcher, gcs, raylets, agents, ...
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert wait_for(lambda: not any(is_running(p, s) for p, s in tree.items()), 60.0), [
        p for p, s in tree.items() if is_running(p, s)]


def test_plan_slices() -> None:
    planned = plan_slices("v4-16, v4-8,v6e-16")
    assert [(s.name, s.shape.num_hosts) for s in planned] == [
        ("sim-0-v4-16", 2), ("sim-1-v4-8", 1), ("sim-2-v6e-16", 4)]
    assert planned[0].host_env(1) == {
        "TPU_NAME": "sim-0-v4-16", "TPU_WORKER_ID": "1", "TPU_ACCELERATOR_TYPE": "v4-16",
        "TPU_TOPOLOGY": "2x2x2", "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
        "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}
    with pytest.raises(ValueError, match="names no slice"):
        plan_slices(" , ")
    with pytest.raises(ValueError, match="Unknown TPU accelerator type 'v9-8'"):
        plan_slices("v4-8,v9-8")


def test_failed_start_reports_the_launcher_log() -> None:
    cluster = LocalTPUCluster("v4-8", options=NodeOptions(object_store_mb=1))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code .*minimum allowed"):
        cluster.start()
    assert not cluster.running and cluster.pid is None
