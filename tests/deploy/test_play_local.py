"""The smallest overlay (v4-16: 2 TPU hosts), played on this machine.

Reads the rendered ``RayCluster`` and coordinator ``Deployment`` and starts what
Kubernetes would: the head pod's ``ray start`` as KubeRay builds it, one process per
TPU host pod with the environment KubeRay, GKE and the TPU webhook give it, and the
coordinator container's own command (see ``kuberay_play`` for what is substituted
and why), over TLS with a certificate made as cert-manager would issue it. The
coordinator's probes must pass as the kubelet runs them (HTTPS ``/readyz`` and
``/healthz``); a client trusting the CA then runs a job through it, as README "Jobs"
does, and the result must equal numpy's; worker 0 must serve ``jax.distributed`` on
the pinned port. Everything is stopped by pid afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from deploy_manifests import (
    container,
    coordinator,
    env_values,
    find,
    kustomize,
    worker_group,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kuberay_play import (
    RAY_CONTAINER_COMMAND,
    FreePorts,
    Pod,
    expand,
    gke_tpu_env,
    head_port,
    head_service_fqdn,
    kuberay_env,
    pod_dir,
    pod_ip,
    ray_start_command,
    replace_once,
    start_pod,
    tpu_webhook_env,
)
from serve_process import make_ca

import jaxpod
from jaxpod.service.capacity.local_cluster import LOOPBACK
from jaxpod.service.cli import deploy_render as dr
from jaxpod.timeouts import wait_for
from jaxpod.worker.host_worker import COORDINATOR_PORT_ENV

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

OVERLAY = "v4-16"
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 20.0


class Play:
    """The pods of one played overlay."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ports = FreePorts()
        self.pods: list[Pod] = []
        self.grpc_address = ""
        self.token = secrets.token_hex(16)  # what `kubectl create secret` would hold
        self.tls_ca = b""  # the CA of the certificate cert-manager would have issued
        self.coordinator_port = 0
        self.http_port = 0

    def start(self) -> None:
        objects = kustomize(f"overlays/{OVERLAY}")
        cluster = find(objects, "RayCluster")
        gcs = self.ports.take()
        # Pod DNS -> each pod's loopback address; per-pod ports -> free ones.
        head_ip = pod_ip(1)
        fqdn, port = head_ip, str(gcs)
        assert head_port(cluster) == "6379" and head_service_fqdn(cluster).startswith(
            "jaxpod-head-svc.")
        head_spec = cluster["spec"]["headGroupSpec"]
        head = container(head_spec["template"]["spec"], "ray-head")
        params = {**head_spec["rayStartParams"], "port": port, "dashboard-host": head_ip,
                  "node-ip-address": head_ip, **self._temp_dir(),
                  **self._ray_ports(), "dashboard-port": str(self.ports.take()),
                  "ray-client-server-port": str(self.ports.take())}
        command = ray_start_command(True, params, head["resources"], fqdn, port)
        env = {**env_values(head), **kuberay_env(cluster, "headgroup", "jaxpod-head", True,
                                                   fqdn, port, command)}
        self._start("head", [*RAY_CONTAINER_COMMAND, command], env)
        # KubeRay's wait-gcs-ready init container holds the other Ray pods until the
        # head's GCS answers (on a cluster the coordinator would restart until it does).
        assert wait_for(lambda: _accepts(head_ip, gcs), START_TIMEOUT_S, max_poll_s=0.5), (
            f"the head's GCS never came up:\n{self.pods[0].log_tail()}")

        group = worker_group(objects)
        pod_spec = group["template"]["spec"]
        worker = container(pod_spec, "ray-worker")
        # The coordinator port is not substituted: it is the one under test.
        self.coordinator_port = int(env_values(worker)[COORDINATOR_PORT_ENV])
        assert _port_free(self.coordinator_port), (
            f"port {self.coordinator_port} is taken on this machine; the play needs it")
        hosts = int(group["numOfHosts"])
        for replica in range(int(group["replicas"])):
            ips = [pod_ip(2 + replica * hosts + h) for h in range(hosts)]
            for host in range(hosts):
                name = f"{group['groupName']}-{replica}-{host}"
                # A TPU host's CPUs: 1 here (KubeRay would derive 8 from the limit).
                params = {**group["rayStartParams"], **self._ray_ports(), "num-cpus": "1",
                          "node-ip-address": ips[host], **self._temp_dir()}
                command = ray_start_command(False, params, worker["resources"], fqdn, port)
                base = env_values(worker)
                webhook = tpu_webhook_env(cluster, group, replica, host, base)
                names = webhook["TPU_WORKER_HOSTNAMES"].split(",")
                assert names == [f"{group['groupName']}-{replica}-{h}.jaxpod-headless"
                                 for h in range(hosts)]
                webhook["TPU_WORKER_HOSTNAMES"] = ",".join(ips)
                env = {**base, **kuberay_env(cluster, group["groupName"], name, False, fqdn,
                                             port, command),
                       **gke_tpu_env(pod_spec["nodeSelector"]),
                       **webhook, "JAX_PLATFORMS": "cpu"}
                self._start(name, [*RAY_CONTAINER_COMMAND, command], env)
                # One Ray node at a time: Ray gives a raylet 30 s to register, and
                # several starting at once on a busy 2-core machine can miss that.
                self.pods[-1].wait_started(START_TIMEOUT_S)
        self._start_coordinator(objects, f"{head_ip}:{gcs}")

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.pods.append(start_pod(name, argv, env, self.workdir, len(self.pods)))

    def _temp_dir(self) -> dict[str, str]:
        # Each pod's own /tmp/ray: without it, every node of the cluster takes the
        # head's, and on one machine their Unix sockets collide.
        return {"temp-dir": str(pod_dir(self.workdir, len(self.pods)) / "tmp" / "ray")}

    def _ray_ports(self) -> dict[str, str]:
        return {"dashboard-agent-listen-port": str(self.ports.take()),
                "metrics-export-port": str(self.ports.take())}

    def _start_coordinator(self, objects: tuple[dict, ...], gcs: str) -> None:
        pod = coordinator(objects)["spec"]["template"]["spec"]
        c = container(pod, "jaxpod")
        config = find(objects, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])
        env = dict(config["data"])
        env["RAY_ADDRESS"] = replace_once(env["RAY_ADDRESS"], "jaxpod-head-svc:6379",
                                          gcs)
        for var in c["env"]:
            source = var["valueFrom"]
            if "secretKeyRef" in source:  # the token Secret, by reference
                ref = source["secretKeyRef"]
                assert (ref["name"], ref["key"]) == (dr.TOKEN_SECRET, dr.TOKEN_SECRET_KEY)
                env[var["name"]] = self.token
            else:  # the downward API: this pod's address
                assert source == {"fieldRef": {"fieldPath": "status.podIP"}}, var
                env[var["name"]] = pod_ip(0)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        state = self.workdir / "state"
        state.mkdir()
        env["JAXPOD_STATE_DIR"] = replace_once(env["JAXPOD_STATE_DIR"], mounts["state"],
                                               str(state))
        # The bucket every TPU pod writes checkpoints to: a folder every process here sees.
        checkpoints = self.workdir / "checkpoints"
        env["JAXPOD_CHECKPOINT_DIR"] = replace_once(
            env["JAXPOD_CHECKPOINT_DIR"], dr.CHECKPOINT_DIR, str(checkpoints))
        grpc_port, self.http_port = self.ports.take(), self.ports.take()
        script = expand(c["args"][0], env)
        script = replace_once(script, f"--address=0.0.0.0:{dr.GRPC_PORT}",
                              f"--address={pod_ip(0)}:{grpc_port}")
        script = replace_once(script, f"--http-port={dr.HTTP_PORT}",
                              f"--http-port={self.http_port}")
        script = replace_once(script, f"--state-dir={mounts['state']}", f"--state-dir={state}")
        script = replace_once(script, "--platform=tpu", "--platform=cpu")
        # cert-manager's Secret, mounted: a certificate for this pod's address, signed
        # by a CA the clients trust (here made for the test).
        ca, cert, key = make_ca(self.workdir / "tls", "jaxpod play CA", pod_ip(0))
        self.tls_ca = ca.read_bytes()
        script = replace_once(script, f"--tls-cert={dr.TLS_DIR}/tls.crt", f"--tls-cert={cert}")
        script = replace_once(script, f"--tls-key={dr.TLS_DIR}/tls.key", f"--tls-key={key}")
        self.grpc_address = f"{pod_ip(0)}:{grpc_port}"
        self._start("coordinator", [*c["command"], script], env)

    def wait_serving(self) -> None:
        credentials = grpc.ssl_channel_credentials(self.tls_ca)
        with grpc.secure_channel(self.grpc_address, credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                for pod in self.pods:
                    assert pod.process.poll() is None, (
                        f"pod {pod.name} exited ({pod.process.returncode}):\n{pod.log_tail()}")
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                except grpc.RpcError:
                    return False
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            assert wait_for(serving, START_TIMEOUT_S, max_poll_s=1.0), (
                f"coordinator not SERVING within {START_TIMEOUT_S}s:\n"
                f"{self.pods[-1].log_tail()}")

    def stop(self) -> list[str]:
        """Coordinator first, then the TPU hosts, then the head, as a delete would."""
        survivors = []
        for pod in reversed(self.pods):
            left = pod.stop(STOP_GRACE_S)
            if left:
                survivors.append(f"{pod.name}: {left}")
        return survivors


def _http_status(url: str, ca: bytes) -> int:
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cadata=ca.decode())
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}),  # never a proxy
                                         urllib.request.HTTPSHandler(context=context))
    try:
        with direct.open(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _listeners(port: int) -> set[int]:
    """Pids of this user's processes listening on TCP ``port`` (IPv4 or IPv6), from
    /proc: the sockets' inodes in /proc/net/tcp*, then whose fds point at them."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(f"socket:[{inode}]")
    pids = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                pids.add(int(fd_dir.parent.name))
    return pids


@pytest.fixture
def play() -> Iterator[Play]:
    # Short: Ray's Unix sockets live under each pod's TMPDIR (108-byte path limit).
    workdir = Path(tempfile.mkdtemp(prefix="jp-", dir="/tmp"))
    played = Play(workdir)
    try:
        played.start()
        played.wait_serving()
        yield played
    finally:
        survivors = played.stop()
        logs = {p.name: p.log_tail(1500) for p in played.pods}
        shutil.rmtree(workdir, ignore_errors=True)
        assert not survivors, f"processes survived SIGKILL: {survivors}; logs: {logs}"


def _step_fn(state, batch):  # type: ignore[no-untyped-def]
    ctx = jaxpod.get_replica_context()
    mask = ctx.valid_row_mask.astype(batch["x"].dtype)
    err = (batch["x"] @ state["w"] - batch["y"]) * mask
    grad = ctx.all_reduce("SUM", batch["x"].T @ err) / ctx.all_reduce("SUM", mask.sum())
    return {"w": state["w"] - 0.1 * grad}, {"loss": err ** 2}


def test_the_v4_16_overlay_runs_a_job(play: Play) -> None:
    rng = np.random.default_rng(0)
    true_w = np.array([1.0, -2.0, 0.5], np.float32)
    batches = []
    for _ in range(3):
        x = rng.normal(size=(16, 3)).astype(np.float32)
        batches.append({"x": x, "y": x @ true_w})
    steps = 12
    # The Deployment's probes, as the kubelet runs them: GETs on the routes, scheme and
    # named port of the coordinator container (HTTPS: the service serves TLS).
    coordinator_pod = coordinator(kustomize(f"overlays/{OVERLAY}"))["spec"]["template"]["spec"]
    probed = container(coordinator_pod, "jaxpod")
    host = play.grpc_address.rsplit(":", 1)[0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = probed[probe]["httpGet"]
        url = f"{get['scheme'].lower()}://{host}:{play.http_port}{get['path']}"
        assert wait_for(lambda url=url: _http_status(url, play.tls_ca) == 200, START_TIMEOUT_S,
                        max_poll_s=1.0), f"{probe} {url}: {_http_status(url, play.tls_ca)}"
    client = jaxpod.connect(play.grpc_address, token=play.token, tls_ca=play.tls_ca)
    try:
        # The TPU pods join on their own time, as on a cluster.
        assert wait_for(lambda: [s["accelerator_type"] for s in client.cluster()] == ["v4-16"],
                        START_TIMEOUT_S, max_poll_s=1.0), client.cluster()
        job = client.submit(_step_fn, steps=steps, accelerator_type="v4-16", steps_per_run=4,
                            initial_state={"w": np.zeros(3, np.float32)}, dataset=batches,
                            outputs={"loss": "MEAN"}, name="deploy-play")
        result = job.result(timeout=240)
        # Worker 0 of the warm slice still serves jax.distributed on the pinned port.
        listeners = _listeners(play.coordinator_port)
        host0 = play.pods[1]
        assert host0.name.endswith("-0-0")
        assert listeners and listeners <= set(host0.processes()), (
            f"port {play.coordinator_port}: listeners {listeners}, not worker 0's")
    finally:
        with contextlib.suppress(Exception):
            client.close()
    w = np.zeros(3, np.float32)
    losses = []
    for step in range(steps):
        b = batches[step % len(batches)]
        err = b["x"] @ w - b["y"]
        losses.append(np.mean(err ** 2))
        w = w - np.float32(0.1) * (b["x"].T @ err) / np.float32(len(err))
    np.testing.assert_allclose(result.state["w"], w, rtol=1e-5, atol=1e-6)
    recorded = dict(result.metrics["loss"])
    np.testing.assert_allclose(recorded[steps], losses[-1], rtol=1e-5)
