"""The rendered GKE manifests, as the tests of ``tests/deploy`` read them.

``kubectl kustomize`` builds each overlay exactly as ``kubectl apply -k`` would; the
objects are then looked up by kind and name. kubectl is a hard requirement (``.ci/run``
installs it): a missing kubectl fails here, it never skips.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from jaxpod.service.cli import deploy_render

REPO = Path(__file__).resolve().parents[2]
GKE = REPO / "deploy" / "gke"
CRD = REPO.parent / "shared" / "schemas" / "kuberay-ray.io_rayclusters.yaml"
#: The Kubernetes version core objects are validated against (GKE's regular channel
#: at the time of writing); kubernetes-validate is pinned in pyproject.toml.
KUBERNETES_VERSION = "1.33"

Obj = dict[str, Any]


@cache
def kustomize(directory: str) -> tuple[Obj, ...]:
    """The objects ``kubectl kustomize DIR`` renders (DIR relative to deploy/gke)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: install it (Debian package kubectl); .ci/run does"
    done = subprocess.run([kubectl, "kustomize", str(GKE / directory)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def find(objects: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    matches = [o for o in objects
               if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return copy.deepcopy(matches[0])


def overlays() -> list[str]:
    return list(deploy_render.OVERLAYS)


def worker_group(objects: tuple[Obj, ...]) -> Obj:
    groups = find(objects, "RayCluster")["spec"]["workerGroupSpecs"]
    assert len(groups) == 1, groups
    return dict(groups[0])


def coordinator(objects: tuple[Obj, ...]) -> Obj:
    return find(objects, "Deployment", "jaxpod-coordinator")


def container(pod_spec: Obj, name: str) -> Obj:
    [found] = [c for c in pod_spec["containers"] if c["name"] == name]
    return dict(found)


def env_values(c: Obj) -> dict[str, str]:
    """A container's plain ``value`` variables (not ``valueFrom``)."""
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def ports(c: Obj) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in c.get("ports", [])}


@cache
def raycluster_schema() -> Obj:
    """The CRD's ``ray.io/v1`` openAPIV3Schema, closed: a field the schema does not
    name fails (the API server would drop it, or reject it under strict field
    validation), as kubernetes-validate's strict mode does for core kinds."""
    crd = yaml.safe_load(CRD.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _close(schema)
    return dict(schema)


def _close(node: Any) -> None:
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for value in node.values():
            _close(value)
    elif isinstance(node, list):
        for value in node:
            _close(value)


def _object(spec: Obj, kind: str) -> Obj:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "cert-manager.io/v1"},
                           "kind": {"const": kind},
                           "metadata": {"type": "object", "required": ["name"]},
                           "spec": spec}}


_STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1}}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s))+$"}
#: The fields of cert-manager's ``cert-manager.io/v1`` Certificate and Issuer that the
#: base uses, as its documentation defines them (https://cert-manager.io/docs/reference/
#: api-docs/), closed like the other schemas: a misspelt field fails. Only this subset:
#: the CRDs themselves are not vendored here.
CERT_MANAGER_SCHEMAS: dict[str, Obj] = {
    "Certificate": _object({
        "type": "object", "required": ["secretName", "issuerRef"],
        "properties": {
            "secretName": {"type": "string", "minLength": 1},
            "commonName": {"type": "string", "maxLength": 64},
            "dnsNames": _STRINGS, "ipAddresses": _STRINGS,
            "isCA": {"type": "boolean"}, "duration": _DURATION, "renewBefore": _DURATION,
            "usages": {"type": "array", "items": {"enum": [
                "signing", "digital signature", "content commitment", "key encipherment",
                "key agreement", "data encipherment", "cert sign", "crl sign",
                "encipher only", "decipher only", "any", "server auth", "client auth",
                "code signing", "email protection", "s/mime", "ipsec end system",
                "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
                "microsoft sgc", "netscape sgc"]}},
            "privateKey": {"type": "object", "properties": {
                "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                "size": {"type": "integer"},
                "encoding": {"enum": ["PKCS1", "PKCS8"]},
                "rotationPolicy": {"enum": ["Never", "Always"]}}},
            "issuerRef": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                "group": {"type": "string"}}},
        }}, "Certificate"),
    "Issuer": _object({
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "properties": {"selfSigned": {"type": "object", "properties": {
                           "crlDistributionPoints": _STRINGS}},
                       "ca": {"type": "object", "required": ["secretName"], "properties": {
                           "secretName": {"type": "string", "minLength": 1}}}},
    }, "Issuer"),
}
for _schema in CERT_MANAGER_SCHEMAS.values():
    _close(_schema)
