"""The import contracts of DESIGN §2 (tools/check_imports.sh, import-linter): they hold
on this tree, and they break when a violating import is planted in a copy of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("jaxpod", "worker", "service", "client", "proto")
ENTRY_POINTS = {"__init__", "cli", "_demo"}


def _check(source_root: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LINT_IMPORTS=str(Path(sys.executable).with_name("lint-imports")))
    if source_root is not None:
        env["JAXPOD_SOURCE_ROOT"] = str(source_root)
    return subprocess.run(["bash", str(ROOT / "tools" / "check_imports.sh")], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_contracts_hold() -> None:
    result = _check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "planted", "contract"), [
    ("client/rpc.py", "import jaxpod.worker.engine",
     "the client imports only jaxpod/ and proto/"),
    ("client/remote.py", "import ray", "the client imports only jaxpod/ and proto/"),
    ("worker/infeed.py", "from jaxpod.service import sessions",
     "workers never import the service"),
    ("jaxpod/errors.py", "from jaxpod.proto import tensors",
     "what every part shares (jaxpod/) imports no part"),
    ("service/capacity/resolvers/ray.py", "from jaxpod.service.capacity import local_cluster",
     "the simulated cluster depends on the Ray resolver"),
    ("service/slices/group_engine.py", "from jaxpod.service import sessions",
     "the service's packages import only those below them"),
    ("service/jobs/runner.py", "from jaxpod.service.api import coordinator",
     "the service's packages import only those below them"),
    ("service/sessions.py", "from jaxpod.proto import tensors",
     "protobuf stays at the edges"),
    ("service/jobs/store.py", "import fastapi", "the core never loads the web stack"),
    ("service/jobs/manager.py", "from jaxpod.proto import coordinator_pb2",
     "jobs see bytes, not messages"),
])
def test_a_violating_import_breaks_its_contract(tmp_path: Path, module: str, planted: str,
                                                contract: str) -> None:
    for part in PARTS:
        shutil.copytree(ROOT / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{planted}  # planted by the test\n")
    result = _check(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), result.stdout
    assert module.removesuffix(".py").replace("/", ".") in result.stdout  # names the culprit


def test_the_shared_contract_lists_every_shared_module() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    shared = next(c for c in config["contracts"] if c["name"].startswith("what every part"))
    modules = {f"jaxpod.{p.stem}" for p in (ROOT / "jaxpod").glob("*.py")
               if p.stem not in ENTRY_POINTS}
    modules |= {f"jaxpod.{p.parent.name}" for p in (ROOT / "jaxpod").glob("*/__init__.py")}
    assert set(shared["source_modules"]) == modules
