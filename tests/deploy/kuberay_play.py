"""Plays rendered manifests on this machine: starts what Kubernetes would start.

From the ``RayCluster``: the head pod's and each TPU host pod's ``ray start``, built
from ``rayStartParams`` and the container's resources exactly as KubeRay builds it
(a port of ``ray-operator/controllers/ray/common/pod.go`` at the CRD's commit:
``setMissingRayStartParams``, ``generateRayStartCommand``, ``convertParamMap``, and the
``ulimit`` prefix), with the environment KubeRay, GKE and the GKE TPU webhook
(``ai-on-gke/kuberay-tpu-webhook``) give each pod. From the coordinator
``Deployment``: its container's command and args, with ``$(VAR)`` expanded as the
kubelet does, and its env from ConfigMap and Secret.

What differs from a cluster, and only this (the play in ``test_play_local.py`` applies
each substitution by exact text, so a manifest whose shape changes makes the play fail
rather than run something else):

* Each pod gets an address of its own in 127.0.0.0/8 (the coordinator 127.0.0.2, the
  head 127.0.0.3, TPU hosts from 127.0.0.4): its downward-API ``status.podIP`` and,
  for the KubeRay pods, Ray's ``--node-ip-address``; pod DNS names (the head Service,
  the TPU hosts' headless names) become those addresses. Ray's GCS and raylets then
  bind loopback only, and no address is the literal 127.0.0.1 that ``ray start``
  rewrites to the machine's network address. (The simulated cluster's
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` cannot be used here: under it ``ray start
  --address`` refuses to join a cluster.)
* Ports each pod owns in its own network namespace but that would collide on one
  machine (the GCS, Ray's dashboard, agent, metrics and client ports, the
  coordinator's gRPC and HTTP ports) become free ones. The ``jax.distributed``
  coordinator port is **not** substituted: it is what the play checks.
* Each KubeRay pod's own ``/tmp/ray`` (Ray's ``--temp-dir``; by default a node takes
  the head's, and on one machine their Unix sockets would collide), the state volume,
  the checkpoint bucket (``gs://``, which every pod reaches) and each pod's ``/tmp``
  become temporary folders.
* Chips become CPU devices (``JAX_PLATFORMS=cpu``, ``--platform=cpu``), and a TPU
  host's ``num-cpus`` (KubeRay derives 8 from the CPU limit) becomes 1 on this 2-core
  machine. The TPU pods start one after another (a raylet has 30 s to register, which
  four at once on a busy 2-core machine can miss), after the head's GCS answers (as
  KubeRay's wait-gcs-ready init container makes them).

Every process runs in a session of its own (as a pod's processes share a PID
namespace); :meth:`Pod.stop` sends SIGTERM as the kubelet does, then SIGKILLs by pid
whatever of that session or process tree is left. Nothing is stopped by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpod.service.capacity.local_cluster import LOOPBACK, descendants, is_running

Obj = dict[str, Any]

# KubeRay's defaults (ray-operator/controllers/ray/utils/constant.go).
DEFAULT_GCS_PORT = 6379
DEFAULT_METRICS_PORT = 8080
DEFAULT_DASHBOARD_AGENT_LISTEN_PORT = 52365
CLUSTER_DOMAIN = "cluster.local"
# pod.go's customAcceleratorToRayResourceMap.
ACCELERATOR_TO_RAY_RESOURCE = {"aws.amazon.com/neuroncore": "neuron_cores",
                               "google.com/tpu": "TPU"}
# utils.IsGPUResourceKey: ends with "gpu", or an NVIDIA MIG slice.
_GPU_RESOURCE = re.compile(r"(.*gpu|.*nvidia\.com/mig-\d+g\.\d+gb)$")
_BOOLEAN_VALUED = ("log-color", "include-dashboard", "include-log-monitor")
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10,
             "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}


def quantity(value: str | int) -> float:
    """A Kubernetes resource quantity (``8``, ``500m``, ``32Gi``) as a number."""
    match = _QUANTITY.match(str(value))
    assert match and match[2] in _SUFFIXES, f"unsupported quantity {value!r}"
    return float(match[1]) * _SUFFIXES[match[2]]


def _value(q: str | int) -> int:
    """``resource.Quantity.Value()``: rounded up to an integer."""
    import math

    return math.ceil(quantity(q))


# ------------------------------------------------------------------ KubeRay's ray start
def head_service_fqdn(cluster: Obj) -> str:
    """``GenerateFQDNServiceName``: ``<cluster>-head-svc.<ns>.svc.cluster.local``."""
    head = cluster["spec"]["headGroupSpec"].get("headService", {}) or {}
    name = head.get("metadata", {}).get("name") or f"{cluster['metadata']['name']}-head-svc"
    return f"{name}.{cluster['metadata']['namespace']}.svc.{CLUSTER_DOMAIN}"


def head_port(cluster: Obj) -> str:
    """``GetHeadPort``: the head's ``port`` start param, else 6379."""
    return str(cluster["spec"]["headGroupSpec"]["rayStartParams"].get("port",
                                                                      DEFAULT_GCS_PORT))


def ray_start_command(head: bool, ray_start_params: Mapping[str, str],
                      resources: Obj, fqdn: str, port: str) -> str:
    """The container args KubeRay writes for a Ray pod without a ``ray start`` of its own."""
    params = set_missing_ray_start_params(head, ray_start_params, fqdn, port)
    return "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; " + (
        generate_ray_start_command(head, params, resources))


def set_missing_ray_start_params(head: bool, ray_start_params: Mapping[str, str],
                                 fqdn: str, port: str) -> dict[str, str]:
    """``setMissingRayStartParams``."""
    params = dict(ray_start_params)
    if not head:
        params.setdefault("address", f"{fqdn}:{port}")
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(DEFAULT_METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
    return params


def generate_ray_start_command(head: bool, ray_start_params: Mapping[str, str],
                               resources: Obj) -> str:
    """``generateRayStartCommand``: CPUs, memory and accelerators from the limits."""
    params = dict(ray_start_params)
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    if "num-cpus" not in params:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu and quantity(cpu):
            params["num-cpus"] = str(_value(cpu))
    if "memory" not in params and limits.get("memory") and quantity(limits["memory"]):
        params["memory"] = str(_value(limits["memory"]))
    _add_accelerators(params, limits)
    kind = "ray start --head" if head else "ray start"
    return f"{kind} {_flags(params)}"


def _add_accelerators(params: dict[str, str], limits: Obj) -> None:
    """``addWellKnownAcceleratorResources``."""
    try:
        resources = json.loads(params.get("resources", "{}").strip("'\"` "))
    except ValueError:
        return  # KubeRay logs the error and leaves the params as they are
    added = any(r in resources for r in ACCELERATOR_TO_RAY_RESOURCE.values())
    for key in sorted(limits):
        value = limits[key]
        if "num-gpus" not in params and _GPU_RESOURCE.match(key) and quantity(value):
            params["num-gpus"] = str(_value(value))
        if not added and key in ACCELERATOR_TO_RAY_RESOURCE and quantity(value):
            name = ACCELERATOR_TO_RAY_RESOURCE[key]
            if name not in resources:
                resources[name] = quantity(value)
                # Go's json.Marshal of a map[string]float64: sorted, no spaces, 4 not 4.0.
                body = ",".join(f'"{k}":{_go_float(v)}' for k, v in sorted(resources.items()))
                params["resources"] = "'{" + body + "}'"
            added = True


def _go_float(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


def _flags(params: Mapping[str, str]) -> str:
    """``convertParamMap``: sorted; ``true`` is a bare switch, ``false`` is dropped."""
    out = ""
    for option in sorted(params):
        argument = params[option]
        if argument.lower() in ("true", "false") and option not in _BOOLEAN_VALUED:
            if argument.lower() == "true":
                out += f" --{option} "
        else:
            out += f" --{option}={argument} "
    return out


def kuberay_env(cluster: Obj, group: str, pod_name: str, head: bool, fqdn: str, port: str,
                command: str) -> dict[str, str]:
    """The variables KubeRay's ``setContainerEnvVars`` adds to a Ray container."""
    env = {
        "RAY_CLUSTER_NAME": cluster["metadata"]["name"],
        "RAY_CLOUD_INSTANCE_ID": pod_name,
        "RAY_NODE_TYPE_NAME": group,
        "KUBERAY_GEN_RAY_START_CMD": command.split("; ", 1)[1],
        "RAY_PORT": port,
        "RAY_ADDRESS": f"{fqdn}:{port}",
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
        "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
    }
    if not head:
        env["FQ_RAY_IP"] = fqdn
        env["RAY_IP"] = fqdn.split(".")[0]
    return env


# --------------------------------------------------------------- the GKE TPU webhook
def headless_service(cluster: Obj) -> str:
    return f"{cluster['metadata']['name']}-headless"


def tpu_webhook_env(cluster: Obj, group: Obj, replica: int, worker_id: int,
                    container_env: Mapping[str, str]) -> dict[str, str]:
    """What ``kuberay-tpu-webhook`` (``mutatePod``) injects into a TPU container."""
    name, hosts = group["groupName"], int(group.get("numOfHosts", 1))
    env: dict[str, str] = {}
    if "MEGASCALE_NUM_SLICES" in container_env:
        env.setdefault("MEGASCALE_SLICE_ID", str(replica))
        env.setdefault("MEGASCALE_COORDINATOR_ADDRESS", f"{name}-0-0.{headless_service(cluster)}")
        env.setdefault("MEGASCALE_PORT", "8081")
    if hosts > 1:
        env["TPU_WORKER_HOSTNAMES"] = ",".join(
            f"{name}-{replica}-{h}.{headless_service(cluster)}" for h in range(hosts))
    env["TPU_WORKER_ID"] = str(worker_id)
    env["TPU_NAME"] = f"{name}-{replica}"
    return {k: v for k, v in env.items() if not container_env.get(k)}


def gke_tpu_env(node_selector: Mapping[str, str]) -> dict[str, str]:
    """What GKE sets in a container requesting ``google.com/tpu`` on the node pool the
    selectors pick: the pool's accelerator type and topology (Ray reads both). The
    type is worked out from the node labels alone, as GKE knows it, not from the
    overlay's name."""
    import math

    from jaxpod.service.capacity.topology import GENERATIONS, parse_topology
    from jaxpod.service.cli.deploy_render import GKE_TPU_ACCELERATORS

    topology = node_selector["cloud.google.com/gke-tpu-topology"]
    [name] = [g for g, label in GKE_TPU_ACCELERATORS.items()
              if label == node_selector["cloud.google.com/gke-tpu-accelerator"]]
    [generation] = [g for g in GENERATIONS if g.name == name]
    chips = math.prod(parse_topology(topology))
    return {"TPU_ACCELERATOR_TYPE": f"{name}-{generation.type_number_for(chips)}",
            "TPU_TOPOLOGY": topology}


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion in command and args (``$$`` escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


# ------------------------------------------------------------------------------ local
#: Ports the play hands out: below Linux's ephemeral range (32768-60999), where the
#: random ports Ray's processes bind (port 0) come from, and above Ray's worker ports
#: (10002-19999). A port picked free in the ephemeral range could be taken by a Ray
#: process of a pod started in between, before its own process binds it.
PLAY_PORTS = range(20000, 32768)


class FreePorts:
    """Ports of :data:`PLAY_PORTS` free on loopback, each handed out once: ports picked
    before any of their processes binds one must still differ (Ray refuses to start
    when two of its components are given one port)."""

    def __init__(self) -> None:
        self._given: set[int] = set()

    def take(self) -> int:
        for _ in range(200):
            port = random.choice(PLAY_PORTS)
            if port in self._given:
                continue
            with socket.socket() as s:
                try:
                    s.bind((LOOPBACK, port))
                except OSError:
                    continue
            self._given.add(port)
            return port
        raise OSError(f"no free port in {PLAY_PORTS} on {LOOPBACK} after 200 tries")


def pod_ip(index: int) -> str:
    """Pod ``index``'s address, 127.0.0.<index + 2>: never 127.0.0.1, which Ray's
    ``ray start`` rewrites to the machine's network address."""
    return f"127.0.0.{index + 2}"


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected {old!r} once in {text!r}"
    return text.replace(old, new)


@dataclass
class Pod:
    """One pod's main process, in a session of its own."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    known: dict[int, str] = field(default_factory=dict)

    def log_tail(self, limit: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-limit:]
        return "(no log)"

    def processes(self) -> dict[int, str]:
        """Live processes of this pod: its session and its tree, with start times."""
        found = dict(descendants(self.process.pid))
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == self.process.pid:
                found[int(stat.parent.name)] = fields[19]
        found.pop(self.process.pid, None)
        self.known.update(found)
        return found

    def wait_started(self, timeout_s: float) -> None:
        """Waits for ``ray start`` to report the node up (its "Ray runtime started")."""
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log_tail(1_000_000):
            assert self.process.poll() is None, (
                f"pod {self.name} exited ({self.process.returncode}):\n{self.log_tail()}")
            assert time.monotonic() < deadline, (
                f"pod {self.name}: no Ray node within {timeout_s:g}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, grace_s: float) -> list[int]:
        """As a pod deletion: SIGTERM to the main process, SIGKILL after ``grace_s``;
        once it is gone, what is left of the pod is SIGKILLed by pid (the kernel does
        that to a container's PID namespace when its first process exits). Returns the
        pids that survived (normally none)."""
        self.processes()
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.processes()
        for pid, start in self.known.items():
            if is_running(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(
                is_running(p, s) for p, s in self.known.items()):
            time.sleep(0.1)
        return [p for p, s in self.known.items() if is_running(p, s)]


def pod_dir(workdir: Path, index: int) -> Path:
    """Pod ``index``'s own folder (short: Unix socket paths under it are limited)."""
    return workdir / f"p{index}"


def start_pod(name: str, argv: list[str], env: Mapping[str, str], workdir: Path,
              index: int) -> Pod:
    """Starts a pod's container process with exactly ``env`` plus a PATH with this venv;
    its HOME, working directory and TMPDIR are the pod's own folder."""
    home = pod_dir(workdir, index)
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    full = {"PATH": path, "HOME": str(home), "TMPDIR": str(tmp), "LANG": "C.UTF-8", **env}
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   env=full, cwd=home, start_new_session=True)
    return Pod(name, process, log)


#: ``utils.GetContainerCommand``: the command KubeRay gives a Ray container.
RAY_CONTAINER_COMMAND = ["/bin/bash", "-c", "--"]
