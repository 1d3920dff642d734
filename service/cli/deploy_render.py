"""Writes the GKE manifests in ``deploy/gke/`` from the topology table.

``jaxpod deploy render --accelerator-type v6e-16 --slices 2 --out DIR`` writes one
kustomize overlay: the KubeRay ``RayCluster``'s TPU worker group for that slice type
(``numOfHosts``, ``google.com/tpu`` per host, the GKE node selectors, the pinned
``jax.distributed`` coordinator port, ``MEGASCALE_*`` for several slices) over the
shared base (``--base``: namespace, service accounts and RBAC, the coordinator
Deployment, its Services, ConfigMap and state volume, the Ray head). Every number comes
from :mod:`jaxpod.service.capacity.topology`, the same table the resolvers and the allocator
use, so the manifests and the code agree by construction; a test fails when the
committed ``deploy/gke`` differs from what this module writes.

What GKE and KubeRay add at admission, and why the manifests leave it out:

* KubeRay builds each Ray container's ``ray start`` from ``rayStartParams`` (and adds
  ``--resources='{"TPU": <google.com/tpu limit>}'``), creates the ``<cluster>-head-svc``
  Service and, for a multi-host group, the ``<cluster>-headless`` Service the TPU hosts
  reach each other through.
* The GKE TPU webhook (``ai-on-gke/kuberay-tpu-webhook``) rejects a worker group whose
  ``numOfHosts`` disagrees with ``gke-tpu-topology`` / chips per host, and injects per
  pod ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``, ``TPU_NAME`` (``<group>-<replica>``)
  and, when ``MEGASCALE_NUM_SLICES`` is set, ``MEGASCALE_SLICE_ID``,
  ``MEGASCALE_COORDINATOR_ADDRESS`` and ``MEGASCALE_PORT`` (8081).
* GKE sets ``TPU_ACCELERATOR_TYPE`` and ``TPU_TOPOLOGY`` in containers that request
  ``google.com/tpu``; Ray turns them into the resources and labels the Ray resolver
  reads.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxpod.service.capacity.resolvers.base import DEFAULT_COORDINATOR_PORT, DEFAULT_MEGASCALE_PORT
from jaxpod.service.capacity.topology import SliceShape, slice_shape
from jaxpod.service.cli.serve import (
    CHECKPOINT_DIR_ENV,
    DEFAULT_HTTP_PORT,
    STATE_DIR_ENV,
    TOKEN_ENV,
)
from jaxpod.worker.host_worker import COORDINATOR_PORT_ENV
from jaxpod.worker.preemption import PREEMPTION_GRACE

#: GKE's ``cloud.google.com/gke-tpu-accelerator`` node label per generation of the table.
GKE_TPU_ACCELERATORS: Mapping[str, str] = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}
ACCELERATOR_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"

NAMESPACE = "jaxpod"
RAY_CLUSTER = "jaxpod"
#: The image of the coordinator and the Ray pods (``deploy/Dockerfile``); retag with
#: ``kustomize edit set image jaxpod=REGISTRY/jaxpod:TAG``.
IMAGE = "jaxpod:0.1.0"
#: The Ray the image installs (``deploy/Dockerfile``'s ``RAY_VERSION``) and KubeRay is told.
RAY_VERSION = "2.60.0"
TOKEN_SECRET = "jaxpod-token"
TOKEN_SECRET_KEY = "token"
STATE_DIR = "/var/lib/jaxpod"
#: Where the TPU hosts write jobs' checkpoints (orbax, straight to the bucket; nothing is
#: mounted for it): the ConfigMap's, set with ``jaxpod deploy render --checkpoint-dir``.
#: The Ray pods' service account needs write access to it (Workload Identity).
CHECKPOINT_DIR = "gs://jaxpod-checkpoints/jobs"
#: KubeRay's GCS port on the head (``<cluster>-head-svc``).
RAY_HEAD_PORT = 6379
GRPC_PORT = 50051
#: The dashboard's port (``jaxpod serve --http-port``) and the probe routes it serves
#: (``service/http/routes.py``; tests/deploy checks these against its router).
HTTP_PORT = DEFAULT_HTTP_PORT
HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
#: The serving certificate cert-manager issues into this Secret (``tls.crt``,
#: ``tls.key``, ``ca.crt``), mounted where ``jaxpod serve --tls-cert/--tls-key`` read it;
#: clients trust the CA in :data:`CA_SECRET`.
TLS_SECRET = "jaxpod-tls"
TLS_DIR = "/etc/jaxpod/tls"
CA_SECRET = "jaxpod-ca"
CERT_MANAGER_API = "cert-manager.io/v1"
#: The ``jax.distributed`` coordinator port on host 0 of a slice, pinned and declared
#: on every TPU pod: JAX's default moved from 8476 to 8482 (jax 0.8.1) and a port
#: nobody declared is one a firewall rule forgets.
COORDINATOR_PORT = DEFAULT_COORDINATOR_PORT
MEGASCALE_PORT = DEFAULT_MEGASCALE_PORT
#: libtpu's own port between the hosts of a slice.
TPU_RUNTIME_PORT = 8471
#: How long Kubernetes waits after SIGTERM before it kills a TPU pod: the worker's
#: preemption grace (a job checkpoints in it) and room for Ray to wind down.
TPU_POD_TERMINATION_GRACE_S = int(PREEMPTION_GRACE.default_s) + 30

#: The overlays committed under ``deploy/gke/overlays``: name -> (type, slices).
OVERLAYS: Mapping[str, tuple[str, int]] = {
    "v4-16": ("v4-16", 1),
    "v5litepod-16": ("v5litepod-16", 1),
    "v6e-16": ("v6e-16", 1),
    "v6e-16x2": ("v6e-16", 2),
}

_LABELS = {"app.kubernetes.io/name": "jaxpod", "app.kubernetes.io/part-of": "jaxpod"}
_COORDINATOR_LABELS = {**_LABELS, "app.kubernetes.io/component": "coordinator"}
_NON_ROOT_POD = {
    "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
_NON_ROOT_CONTAINER = {
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
}
#: The coordinator's pod is a CPU-less Ray node (a driver needs a raylet beside it),
#: then ``jaxpod serve`` replaces the shell. The kubelet expands ``$(VAR)``; the node
#: address is the pod's own (downward API), the one the driver's address lookup finds.
COORDINATOR_ARGS = (
    "ray start --address=$(RAY_ADDRESS) --node-ip-address=$(POD_IP) --num-cpus=0"
    " --disable-usage-stats"
    f" && exec jaxpod serve --address=0.0.0.0:{GRPC_PORT} --http-port={HTTP_PORT}"
    f" --state-dir={STATE_DIR} --platform=tpu"
    f" --tls-cert={TLS_DIR}/tls.crt --tls-key={TLS_DIR}/tls.key"
)


def overlay_name(accelerator_type: str, slices: int = 1) -> str:
    """``v6e-16`` for one slice, ``v6e-16x2`` for two."""
    canonical = slice_shape(accelerator_type).accelerator_type
    return canonical if slices == 1 else f"{canonical}x{slices}"


def worker_group_name(shape: SliceShape) -> str:
    """The TPU worker group's name; the webhook names slices ``<group>-<replica>``."""
    return f"tpu-{shape.accelerator_type}"


def _header(command: str) -> str:
    return f"# Generated by `{command}` from jaxpod's topology table. Do not edit.\n"


def _dump(objects: list[dict[str, Any]] | dict[str, Any], command: str) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # shared label dicts written out in full, not as &anchors

    docs = objects if isinstance(objects, list) else [objects]
    body = "---\n".join(yaml.dump(d, Dumper=Dumper, sort_keys=False, width=100)
                         for d in docs)
    return _header(command) + body


def _meta(name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "labels": dict(labels or _LABELS)}


# ---------------------------------------------------------------------------- overlay
def render_overlay(
    accelerator_type: str, slices: int = 1, *, coordinator_port: int = COORDINATOR_PORT
) -> dict[str, str]:
    """The files of one overlay: ``{file name: text}``.

    Args:
      accelerator_type: a type of the topology table, e.g. ``v4-16``.
      slices: how many such slices the RayCluster holds (``MEGASCALE_*`` when > 1).
      coordinator_port: the ``jax.distributed`` coordinator port to pin.

    Raises:
      ValueError: an unknown type, a generation GKE has no node label for here, or a
        slice count below 1.
    """
    shape = slice_shape(accelerator_type)
    if slices < 1:
        raise ValueError(f"--slices {slices}: a RayCluster needs at least 1 slice.")
    if shape.generation.name not in GKE_TPU_ACCELERATORS:
        raise ValueError(f"No GKE node label known for {shape.generation.name} TPUs.")
    command = (f"jaxpod deploy render --accelerator-type {shape.accelerator_type}"
               + (f" --slices {slices}" if slices > 1 else "")
               + (f" --coordinator-port {coordinator_port}"
                  if coordinator_port != COORDINATOR_PORT else ""))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["../../base"],
        "patches": [{"path": "raycluster-tpu.yaml"}],
    }
    patch = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": RAY_CLUSTER},
        # A strategic merge on a custom resource replaces lists whole: the overlay
        # owns the complete worker group.
        "spec": {"workerGroupSpecs": [_worker_group(shape, slices, coordinator_port)]},
    }
    return {
        "kustomization.yaml": _dump(kustomization, command),
        "raycluster-tpu.yaml": _dump(patch, command),
    }


def _worker_group(shape: SliceShape, slices: int, coordinator_port: int) -> dict[str, Any]:
    chips = str(shape.chips_per_host)
    env: list[dict[str, Any]] = [
        {"name": COORDINATOR_PORT_ENV, "value": str(coordinator_port)},
        # The hosts keep JAX's compilation cache beside the checkpoints, a bucket every
        # host reaches: a restarted attempt loads its programs instead of compiling.
        {"name": CHECKPOINT_DIR_ENV, "valueFrom": {"configMapKeyRef": {
            "name": "jaxpod-config", "key": CHECKPOINT_DIR_ENV}}},
    ]
    ports = [
        {"name": "jax-coord", "containerPort": coordinator_port},
        {"name": "tpu-runtime", "containerPort": TPU_RUNTIME_PORT},
    ]
    if slices > 1:
        # The webhook sees MEGASCALE_NUM_SLICES and adds the slice id, slice 0's
        # worker 0 as coordinator and MEGASCALE_PORT per replica.
        env.append({"name": "MEGASCALE_NUM_SLICES", "value": str(slices)})
        ports.append({"name": "megascale", "containerPort": MEGASCALE_PORT})
    container = {
        "name": "ray-worker",
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "env": env,
        "ports": ports,
        "resources": {
            "requests": {"cpu": "8", "memory": "32Gi", TPU_RESOURCE: chips},
            "limits": {"cpu": "8", "memory": "32Gi", TPU_RESOURCE: chips},
        },
        "securityContext": _NON_ROOT_CONTAINER,
    }
    return {
        "groupName": worker_group_name(shape),
        "replicas": slices,
        "minReplicas": slices,
        "maxReplicas": slices,
        "numOfHosts": shape.num_hosts,
        "rayStartParams": {},
        "template": {
            "metadata": {"labels": {**_LABELS, "app.kubernetes.io/component": "tpu-host"}},
            "spec": {
                "serviceAccountName": "jaxpod-ray",
                "automountServiceAccountToken": False,
                "securityContext": _NON_ROOT_POD,
                "terminationGracePeriodSeconds": TPU_POD_TERMINATION_GRACE_S,
                "nodeSelector": {
                    ACCELERATOR_SELECTOR: GKE_TPU_ACCELERATORS[shape.generation.name],
                    TOPOLOGY_SELECTOR: shape.topology,
                },
                # GKE taints TPU nodes; it adds this itself for pods requesting
                # google.com/tpu, stated here so the manifests say where pods may go.
                "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists",
                                 "effect": "NoSchedule"}],
                "containers": [container],
            },
        },
    }


# ------------------------------------------------------------------------------- base
def check_checkpoint_dir(url: str) -> str:
    """``url`` if every pod can reach it (a ``gs://`` bucket); else a clear error."""
    if not url.startswith("gs://") or len(url) <= len("gs://"):
        raise ValueError(
            f"--checkpoint-dir {url!r}: on GKE the TPU hosts write checkpoints and the "
            "coordinator lists them from other machines, so it must be a bucket every "
            "pod reaches, e.g. gs://my-bucket/jaxpod (the Ray pods' service account "
            "needs write access to it).")
    return url


def render_base(checkpoint_dir: str = CHECKPOINT_DIR) -> dict[str, str]:
    """The files of ``deploy/gke/base``: ``{file name: text}`` (``checkpoint_dir``: the
    ``gs://`` URL the hosts write checkpoints to)."""
    command = "jaxpod deploy render --base" + (
        f" --checkpoint-dir {checkpoint_dir}" if checkpoint_dir != CHECKPOINT_DIR else "")
    files = {
        "namespace.yaml": [{"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(NAMESPACE)}],
        "serviceaccounts.yaml": _service_accounts(),
        "rbac.yaml": _rbac(),
        "config.yaml": [_config_map(check_checkpoint_dir(checkpoint_dir)), _state_volume()],
        "coordinator.yaml": [_coordinator()],
        "services.yaml": _services(),
        "certificates.yaml": _certificates(),
        "raycluster.yaml": [_ray_cluster()],
    }
    out = {name: _dump(objects, command) for name, objects in files.items()}
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": list(files),
        # Teaches `kustomize edit set image` where a RayCluster keeps its images.
        "configurations": ["kustomizeconfig.yaml"],
    }
    image_paths = {
        "images": [
            {"path": f"spec/{group}/template/spec/containers/image", "kind": "RayCluster"}
            for group in ("headGroupSpec", "workerGroupSpecs")
        ]
    }
    out["kustomization.yaml"] = _dump(kustomization, command)
    out["kustomizeconfig.yaml"] = _dump(image_paths, command)
    return out


def _service_accounts() -> list[dict[str, Any]]:
    # Neither pod calls the Kubernetes API, so neither mounts a token.
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name),
         "automountServiceAccountToken": False}
        for name in ("jaxpod-coordinator", "jaxpod-ray")
    ]


def _rbac() -> list[dict[str, Any]]:
    # The most the coordinator may read: its own RayCluster, nothing else, no writes.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta("jaxpod-coordinator"),
        "rules": [{"apiGroups": ["ray.io"], "resources": ["rayclusters"],
                   "resourceNames": [RAY_CLUSTER], "verbs": ["get", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta("jaxpod-coordinator"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "jaxpod-coordinator"},
        "subjects": [{"kind": "ServiceAccount", "name": "jaxpod-coordinator",
                      "namespace": NAMESPACE}],
    }
    return [role, binding]


def _config_map(checkpoint_dir: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta("jaxpod-config"),
        "data": {
            # KubeRay's head Service; a short name resolves in the pod's own namespace.
            "RAY_ADDRESS": f"{RAY_CLUSTER}-head-svc:{RAY_HEAD_PORT}",
            STATE_DIR_ENV: STATE_DIR,
            # Every TPU host writes its shards here; the coordinator lists the steps.
            CHECKPOINT_DIR_ENV: checkpoint_dir,
        },
    }


def _state_volume() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta("jaxpod-state"),
        "spec": {"accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "20Gi"}}},
    }


def _coordinator() -> dict[str, Any]:
    container = {
        "name": "jaxpod",
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c"],
        "args": [COORDINATOR_ARGS],
        "envFrom": [{"configMapRef": {"name": "jaxpod-config"}}],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": TOKEN_SECRET, "key": TOKEN_SECRET_KEY}}},
        ],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT},
                  {"name": "http", "containerPort": HTTP_PORT}],
        # Ready once the Ray cluster is up, which can take a while on first start (TPU
        # node pools scaling up): a long start-up budget. Over HTTPS (the kubelet does
        # not verify the certificate); its gRPC probe cannot speak TLS.
        "startupProbe": {"httpGet": {"path": READYZ_PATH, "port": "http", "scheme": "HTTPS"},
                         "periodSeconds": 10, "failureThreshold": 60},
        "readinessProbe": {"httpGet": {"path": READYZ_PATH, "port": "http",
                                       "scheme": "HTTPS"},
                           "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": HEALTHZ_PATH, "port": "http",
                                      "scheme": "HTTPS"},
                          "periodSeconds": 20, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"},
                      "limits": {"cpu": "4", "memory": "8Gi"}},
        "securityContext": _NON_ROOT_CONTAINER,
        "volumeMounts": [{"name": "state", "mountPath": STATE_DIR},
                         {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
                         {"name": "ray-tmp", "mountPath": "/tmp/ray"},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta("jaxpod-coordinator", _COORDINATOR_LABELS),
        "spec": {
            "replicas": 1,
            # One writer of jobs.sqlite on a ReadWriteOnce volume: never two pods.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _COORDINATOR_LABELS},
            "template": {
                "metadata": {"labels": _COORDINATOR_LABELS},
                "spec": {
                    "serviceAccountName": "jaxpod-coordinator",
                    "automountServiceAccountToken": False,
                    "securityContext": _NON_ROOT_POD,
                    # Lets running jobs checkpoint and Ray drain before SIGKILL.
                    "terminationGracePeriodSeconds": 60,
                    "containers": [container],
                    "volumes": [
                        {"name": "state", "persistentVolumeClaim": {"claimName": "jaxpod-state"}},
                        {"name": "tls", "secret": {"secretName": TLS_SECRET,
                                                   "defaultMode": 0o440}},
                        {"name": "ray-tmp", "emptyDir": {}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
                    ],
                },
            },
        },
    }


def _services() -> list[dict[str, Any]]:
    def service(name: str, port_name: str, port: int, protocol: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(name, _COORDINATOR_LABELS),
            "spec": {"selector": _COORDINATOR_LABELS,
                     "ports": [{"name": port_name, "port": port, "targetPort": port_name,
                                "appProtocol": protocol}]},
        }

    return [service("jaxpod-grpc", "grpc", GRPC_PORT, "grpc"),
            service("jaxpod-http", "http", HTTP_PORT, "https")]


def service_dns_names() -> list[str]:
    """The names clients reach the coordinator by in the cluster (both Services, each
    short and qualified), and ``localhost`` for ``kubectl port-forward``."""
    names = [f"{name}{suffix}" for name in ("jaxpod-grpc", "jaxpod-http")
             for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc",
                            f".{NAMESPACE}.svc.cluster.local")]
    return [*names, "localhost"]


def _certificates() -> list[dict[str, Any]]:
    """cert-manager's CA bootstrap, namespaced: a self-signed issuer signs a CA
    (``jaxpod-ca``), whose issuer signs the coordinator's serving certificate
    (``jaxpod-tls``), renewed by cert-manager before it expires. A team with its own
    issuer patches ``jaxpod-tls``'s ``issuerRef`` and drops the rest."""
    def certificate(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": CERT_MANAGER_API, "kind": "Certificate",
                "metadata": _meta(name), "spec": {"secretName": name, **spec}}

    def issuer(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": CERT_MANAGER_API, "kind": "Issuer", "metadata": _meta(name),
                "spec": spec}

    key = {"algorithm": "ECDSA", "size": 256}
    return [
        issuer("jaxpod-selfsigned", {"selfSigned": {}}),
        certificate(CA_SECRET, {
            "isCA": True, "commonName": "jaxpod CA", "duration": "87600h",
            "privateKey": key,
            "issuerRef": {"name": "jaxpod-selfsigned", "kind": "Issuer"}}),
        issuer(CA_SECRET, {"ca": {"secretName": CA_SECRET}}),
        certificate(TLS_SECRET, {
            "commonName": "jaxpod-grpc", "dnsNames": service_dns_names(),
            "ipAddresses": ["127.0.0.1"], "duration": "2160h", "renewBefore": "360h",
            "usages": ["server auth", "digital signature"],
            "privateKey": key, "issuerRef": {"name": CA_SECRET, "kind": "Issuer"}}),
    ]


def _ray_cluster() -> dict[str, Any]:
    head = {
        "name": "ray-head",
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "gcs", "containerPort": RAY_HEAD_PORT},
                  {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001}],
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"},
                      "limits": {"cpu": "2", "memory": "8Gi"}},
        "securityContext": _NON_ROOT_CONTAINER,
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta(RAY_CLUSTER),
        "spec": {
            "rayVersion": RAY_VERSION,
            "headGroupSpec": {
                # No work on the head: host workers belong on TPU hosts only.
                "rayStartParams": {"num-cpus": "0"},
                "template": {
                    "metadata": {"labels": {**_LABELS, "app.kubernetes.io/component": "ray-head"}},
                    "spec": {
                        "serviceAccountName": "jaxpod-ray",
                        "automountServiceAccountToken": False,
                        "securityContext": _NON_ROOT_POD,
                        "containers": [head],
                    },
                },
            },
            # Each overlay supplies the TPU worker group of its slice type.
            "workerGroupSpecs": [],
        },
    }


# ------------------------------------------------------------------------ tree and CLI
def render_tree(checkpoint_dir: str = CHECKPOINT_DIR) -> dict[str, str]:
    """Everything under ``deploy/gke``: ``{relative path: text}``."""
    tree = {f"base/{name}": text for name, text in render_base(checkpoint_dir).items()}
    for name, (accelerator_type, slices) in OVERLAYS.items():
        for file, text in render_overlay(accelerator_type, slices).items():
            tree[f"overlays/{name}/{file}"] = text
    return tree


def write(files: Mapping[str, str], out: Path) -> list[Path]:
    """Writes ``files`` under ``out``; returns the paths written."""
    written = []
    for name, text in sorted(files.items()):
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``jaxpod deploy render``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--accelerator-type", metavar="TYPE",
                      help="the TPU slice type of the overlay, e.g. v4-16 or v6e-16")
    what.add_argument("--base", action="store_true", help="write the shared base instead")
    what.add_argument("--all", action="store_true",
                      help="write base/ and every committed overlay under --out "
                           "(e.g. deploy/gke)")
    parser.add_argument("--slices", type=int, default=1,
                        help="slices of that type in the RayCluster (default 1)")
    parser.add_argument("--coordinator-port", type=int, default=COORDINATOR_PORT,
                        help="the jax.distributed coordinator port to pin and declare "
                             f"(default {COORDINATOR_PORT})")
    parser.add_argument("--checkpoint-dir", default=CHECKPOINT_DIR, metavar="URL",
                        help="the gs:// bucket (and path) the TPU hosts write jobs' "
                             f"checkpoints to, in the base's ConfigMap (default "
                             f"{CHECKPOINT_DIR}: replace it with yours)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="directory to write into")


def run_render(args: argparse.Namespace) -> int:
    """Entry point of ``jaxpod deploy render``."""
    if (args.all or args.base) and (args.slices != 1
                                    or args.coordinator_port != COORDINATOR_PORT):
        raise ValueError("--slices and --coordinator-port shape one overlay: use them "
                         "with --accelerator-type, not --base or --all.")
    if args.accelerator_type and args.checkpoint_dir != CHECKPOINT_DIR:
        raise ValueError("--checkpoint-dir goes in the base's ConfigMap: use it with "
                         "--base or --all.")
    if args.all:
        files = render_tree(args.checkpoint_dir)
    elif args.base:
        files = render_base(args.checkpoint_dir)
    else:
        files = render_overlay(args.accelerator_type, args.slices,
                               coordinator_port=args.coordinator_port)
    for path in write(files, args.out):
        print(path)
    return 0
