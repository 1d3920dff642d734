"""The GKE manifests, checked offline: every overlay renders with ``kubectl kustomize``,
every object is valid for its schema, and what they say agrees with the code.

Schemas: core kinds with kubernetes-validate (strict: unknown fields fail) at a pinned
Kubernetes version; the KubeRay ``RayCluster`` with jsonschema against its CRD's
``openAPIV3Schema`` (closed the same way), and its pod templates as core
``PodTemplate``s. Semantics: the numbers GKE's TPU webhook and scheduler check (hosts x
chips per host = the slice's chips, selectors and topology), no Secret value inline,
probes on routes and ports the service serves, and the ``jax.distributed``
coordinator port the workers use.
"""

from __future__ import annotations

import math
import re
import shlex

import jsonschema
import kubernetes_validate
import pytest
from deploy_manifests import (
    CERT_MANAGER_SCHEMAS,
    KUBERNETES_VERSION,
    REPO,
    Obj,
    container,
    coordinator,
    env_values,
    find,
    kustomize,
    overlays,
    ports,
    raycluster_schema,
    worker_group,
)

from jaxpod.service.capacity.resolvers.base import DEFAULT_COORDINATOR_PORT, DEFAULT_MEGASCALE_PORT
from jaxpod.service.capacity.topology import parse_topology, slice_shape
from jaxpod.service.cli import deploy_render as dr
from jaxpod.service.cli.serve import TOKEN_ENV
from jaxpod.worker.host_worker import COORDINATOR_PORT_ENV
from jaxpod.worker.preemption import PREEMPTION_GRACE

TREES = ["base", *(f"overlays/{name}" for name in overlays())]
OVERLAYS = [f"overlays/{name}" for name in overlays()]


def _validate_core(obj: Obj) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(
            f"{obj['kind']}/{obj['metadata'].get('name')}: {e.message} at "
            f"{'.'.join(str(p) for p in e.path)}") from e


@pytest.mark.parametrize("tree", TREES)
def test_every_object_is_valid(tree: str) -> None:
    objects = kustomize(tree)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
            "PersistentVolumeClaim", "Deployment", "Service", "RayCluster", "Certificate",
            "Issuer"} <= kinds
    for obj in objects:
        if obj["kind"] in CERT_MANAGER_SCHEMAS:
            jsonschema.validate(obj, CERT_MANAGER_SCHEMAS[obj["kind"]],
                                cls=jsonschema.Draft7Validator)
        elif obj["kind"] == "RayCluster":
            jsonschema.validate(obj, raycluster_schema(), cls=jsonschema.Draft7Validator)
            spec = obj["spec"]
            for template in [spec["headGroupSpec"]["template"],
                             *(g["template"] for g in spec.get("workerGroupSpecs", []))]:
                # The pod templates KubeRay stamps pods from, checked as core objects.
                _validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                                "metadata": {"name": "t"}, "template": template})
        else:
            _validate_core(obj)
        assert obj["metadata"].get("namespace", dr.NAMESPACE) == dr.NAMESPACE


@pytest.mark.parametrize("tree", OVERLAYS)
def test_slice_numbers_match_the_topology_table(tree: str) -> None:
    accelerator_type, slices = dr.OVERLAYS[tree.split("/")[1]]
    shape = slice_shape(accelerator_type)
    group = worker_group(kustomize(tree))
    pod = group["template"]["spec"]
    worker = container(pod, "ray-worker")
    limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
    chips_per_host = int(limits[dr.TPU_RESOURCE])
    # GKE schedules a TPU pod only when request equals limit.
    assert int(requests[dr.TPU_RESOURCE]) == chips_per_host == shape.chips_per_host
    assert group["numOfHosts"] * chips_per_host == shape.chips
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == slices
    selectors = pod["nodeSelector"]
    assert selectors[dr.TOPOLOGY_SELECTOR] == shape.topology
    assert selectors[dr.ACCELERATOR_SELECTOR] == dr.GKE_TPU_ACCELERATORS[shape.generation.name]
    assert {"key": dr.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in (
        pod["tolerations"])
    # The TPU webhook's own admission rule (checkWorkersMatchTopology): hosts =
    # chips of the topology / chips requested per pod.
    topology_chips = math.prod(parse_topology(selectors[dr.TOPOLOGY_SELECTOR]))
    assert max(topology_chips // chips_per_host, 1) == group["numOfHosts"]
    # What GKE would call the node pool's slice is the overlay's type again.
    [generation] = [g for g, label in dr.GKE_TPU_ACCELERATORS.items()
                    if label == selectors[dr.ACCELERATOR_SELECTOR]]
    number = topology_chips * (shape.cores_per_chip if generation in ("v4", "v5p") else 1)
    assert slice_shape(f"{generation}-{number}") == shape


@pytest.mark.parametrize("tree", OVERLAYS)
def test_coordinator_and_megascale_ports_are_pinned_and_declared(tree: str) -> None:
    _, slices = dr.OVERLAYS[tree.split("/")[1]]
    group = worker_group(kustomize(tree))
    worker = container(group["template"]["spec"], "ray-worker")
    env, declared = env_values(worker), ports(worker)
    # The variable HostWorker.reserve_port reads (tests/deploy/test_play_local.py
    # shows worker 0 listening on it).
    assert int(env[COORDINATOR_PORT_ENV]) == declared["jax-coord"] == DEFAULT_COORDINATOR_PORT
    if slices > 1:
        assert env["MEGASCALE_NUM_SLICES"] == str(slices)
        assert declared["megascale"] == DEFAULT_MEGASCALE_PORT
        # Left to the webhook, per replica: setting them here would give every slice
        # the same id.
        assert not {"MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS"} & set(env)
    else:
        assert not [k for k in env if k.startswith("MEGASCALE_")]
    # SIGTERM (maintenance, preemption) leaves the worker its grace to checkpoint.
    assert group["template"]["spec"]["terminationGracePeriodSeconds"] > (
        PREEMPTION_GRACE.default_s)
    # Never the simulated cluster's loopback switch on a real cluster (DESIGN §4).
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env


def test_no_secret_value_is_inline() -> None:
    for tree in TREES:
        objects = kustomize(tree)
        assert not [o for o in objects if o["kind"] == "Secret"], "a Secret in the manifests"
        text = repr(objects)
        assert not re.search(r"(?i)bearer|token_hex", text)
        for obj in objects:
            for key in obj.get("data", {}) or {}:
                assert not re.search(r"(?i)token|secret|password|key", key), (obj, key)
        c = container(coordinator(objects)["spec"]["template"]["spec"], "jaxpod")
        [token] = [e for e in c["env"] if e["name"] == TOKEN_ENV]
        assert token == {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": dr.TOKEN_SECRET, "key": dr.TOKEN_SECRET_KEY}}}
        for obj in objects:
            for secretive in re.findall(r"'name': '([A-Z_]*(?:TOKEN|SECRET|PASSWORD)[A-Z_]*)',"
                                        r" 'value'", repr(obj)):
                raise AssertionError(f"{secretive} has an inline value in {obj['kind']}")


def _served_routes() -> tuple[int, int, set[str]]:
    """The gRPC port, the HTTP port and the probe routes `jaxpod serve` serves: its
    flag defaults and the dashboard's own health router."""
    from jaxpod.service.cli.serve import DEFAULT_ADDRESS, DEFAULT_HTTP_PORT
    from jaxpod.service.http.routes import health

    grpc_port = int(DEFAULT_ADDRESS.rsplit(":", 1)[1])
    return grpc_port, DEFAULT_HTTP_PORT, {r.path for r in health.routes}  # type: ignore[attr-defined]


def test_probes_and_services_point_at_what_the_service_serves() -> None:
    objects = kustomize("base")
    grpc_port, http_port, routes = _served_routes()
    pod = coordinator(objects)["spec"]["template"]["spec"]
    c = container(pod, "jaxpod")
    declared = ports(c)
    assert declared == {"grpc": grpc_port, "http": http_port}
    # The command really listens on the declared gRPC port.
    script = c["args"][0]
    serve = shlex.split(script.split("exec ", 1)[1])
    assert serve[:2] == ["jaxpod", "serve"]
    address = next(a.split("=", 1)[1] for a in serve if a.startswith("--address="))
    assert int(address.rsplit(":", 1)[1]) == grpc_port
    assert f"--http-port={http_port}" in serve
    for probe, path in (("startupProbe", dr.READYZ_PATH), ("readinessProbe", dr.READYZ_PATH),
                        ("livenessProbe", dr.HEALTHZ_PATH)):
        get = c[probe]["httpGet"]
        assert get["path"] == path and path in routes
        assert declared[get["port"]] == http_port
        assert get["scheme"] == "HTTPS"  # the service serves HTTP over TLS, below
    for name, port_name in (("jaxpod-grpc", "grpc"), ("jaxpod-http", "http")):
        service = find(objects, "Service", name)
        assert service["spec"]["selector"] == pod_labels(objects)
        [port] = service["spec"]["ports"]
        assert port["targetPort"] == port_name and port["port"] == declared[port_name]


def pod_labels(objects: tuple[Obj, ...]) -> dict[str, str]:
    return dict(coordinator(objects)["spec"]["template"]["metadata"]["labels"])


def test_coordinator_wiring() -> None:
    objects = kustomize("base")
    deployment = coordinator(objects)
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    c = container(pod, "jaxpod")
    # Everything it names exists: service account, ConfigMap, claim.
    find(objects, "ServiceAccount", pod["serviceAccountName"])
    config = find(objects, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes["state"]["persistentVolumeClaim"]["claimName"]
    find(objects, "PersistentVolumeClaim", claim)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert config["data"]["JAXPOD_STATE_DIR"] == mounts["state"]
    assert f"--state-dir={mounts['state']}" in c["args"][0]
    # RAY_ADDRESS is KubeRay's head Service and GCS port.
    cluster = find(objects, "RayCluster")
    head_port = cluster["spec"]["headGroupSpec"]["rayStartParams"].get("port", "6379")
    assert config["data"]["RAY_ADDRESS"] == f"{cluster['metadata']['name']}-head-svc:{head_port}"
    assert "$(RAY_ADDRESS)" in c["args"][0]
    # The Ray node's address is the pod's own, from the downward API.
    assert "--node-ip-address=$(POD_IP)" in c["args"][0]
    [pod_ip] = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for limits in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][limits])


def test_rbac_is_least_privilege() -> None:
    objects = kustomize("base")
    kinds = {o["kind"] for o in objects}
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds
    role = find(objects, "Role")
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert "secrets" not in rule["resources"]
    binding = find(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    for account in (o for o in objects if o["kind"] == "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False
    for pod in (coordinator(objects)["spec"]["template"]["spec"],
                find(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]):
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_image_and_ray_version_agree_with_the_dockerfile() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    [ray_version] = re.findall(r"^ARG RAY_VERSION=(\S+)$", text, re.MULTILINE)
    cluster = find(kustomize("overlays/v4-16"), "RayCluster")
    assert cluster["spec"]["rayVersion"] == ray_version == dr.RAY_VERSION
    images = set(re.findall(r"'image': '([^']+)'", repr(kustomize("overlays/v4-16"))))
    assert images == {dr.IMAGE}


def test_the_coordinator_serves_tls_with_the_certificate_cert_manager_issues() -> None:
    objects = kustomize("base")
    pod = coordinator(objects)["spec"]["template"]["spec"]
    c = container(pod, "jaxpod")
    serve = shlex.split(c["args"][0].split("exec ", 1)[1])
    flags = dict(a.split("=", 1) for a in serve if a.startswith("--tls-"))
    # The files it reads are the mounted Secret's, which the serving Certificate fills.
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == dr.TLS_DIR]
    assert mount["readOnly"] is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]["secretName"]
    assert flags == {"--tls-cert": f"{dr.TLS_DIR}/tls.crt", "--tls-key": f"{dr.TLS_DIR}/tls.key"}
    # Readable by the pod's group (fsGroup), not by others.
    assert volume["secret"]["defaultMode"] & 0o007 == 0 and pod["securityContext"]["fsGroup"]
    serving = find(objects, "Certificate", secret)
    assert serving["spec"]["secretName"] == secret
    assert "server auth" in serving["spec"]["usages"]
    # It names every way a client reaches the service: each Service, short and
    # qualified, and localhost for a port-forward.
    names = set(serving["spec"]["dnsNames"])
    for service in (o for o in objects if o["kind"] == "Service"):
        name = service["metadata"]["name"]
        assert {name, f"{name}.{dr.NAMESPACE}", f"{name}.{dr.NAMESPACE}.svc",
                f"{name}.{dr.NAMESPACE}.svc.cluster.local"} <= names
    assert "localhost" in names
    # The issuer chain resolves: serving <- CA issuer <- CA certificate <- self-signed.
    ca_issuer = find(objects, "Issuer", serving["spec"]["issuerRef"]["name"])
    ca = find(objects, "Certificate", ca_issuer["spec"]["ca"]["secretName"])
    assert ca["spec"]["isCA"] is True and ca["spec"]["secretName"] == dr.CA_SECRET
    assert "selfSigned" in find(objects, "Issuer", ca["spec"]["issuerRef"]["name"])["spec"]
