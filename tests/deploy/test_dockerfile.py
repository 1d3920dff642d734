"""deploy/Dockerfile, checked statically (no registry is reachable from CI to build it):
a multi-stage build that installs this package with the extras the pods need, copies
every source folder the package is built from, and runs as the non-root user the
manifests' securityContext names."""

from __future__ import annotations

import re
import tomllib

from deploy_manifests import REPO, coordinator, find, kustomize

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    logical = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_multi_stage_non_root_image_of_this_package() -> None:
    stages = _stages()
    assert len(stages) >= 2, "build and runtime stages"
    build, final = stages[0], stages[-1]
    # gcs: the hosts and the coordinator reach a gs:// checkpoint dir.
    assert any('".[tpu,service,gcs]"' in line for line in build if line.startswith("RUN"))
    assert any(line.startswith("COPY --from=") for line in final)
    # Only the final stage's user matters: a numeric, non-root uid (runAsNonRoot needs
    # a number to check) that equals the pods' runAsUser.
    [user] = [line.split()[1] for line in final if line.startswith("USER")]
    uid = int(user.split(":")[0])
    objects = kustomize("overlays/v4-16")
    pods = [coordinator(objects)["spec"]["template"]["spec"],
            find(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]]
    assert uid != 0 and {p["securityContext"]["runAsUser"] for p in pods} == {uid}


def test_every_source_folder_is_copied_and_none_is_ignored() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {line.split()[1] for line in _stages()[0] if line.startswith("COPY ")}
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"
    assert {"pyproject.toml", "README.md"} <= {
        part for line in _stages()[0] if line.startswith("COPY ") for part in line.split()}
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    assert not ignored & (folders | {"pyproject.toml", "README.md"})
