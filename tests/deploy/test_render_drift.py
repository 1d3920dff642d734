"""``deploy/gke`` is exactly what ``jaxpod deploy render`` writes from the topology
table: edit the generator (``service/cli/deploy_render.py``), then run
``jaxpod deploy render --all --out deploy/gke``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from deploy_manifests import GKE

from jaxpod.service.cli import deploy_render as dr

FIX = "jaxpod deploy render --all --out deploy/gke"


def test_committed_manifests_equal_the_generated_ones() -> None:
    expected = dr.render_tree()
    committed = {str(p.relative_to(GKE)): p.read_text()
                 for p in sorted(GKE.rglob("*")) if p.is_file()}
    missing = sorted(set(expected) - set(committed))
    extra = sorted(set(committed) - set(expected))
    differ = sorted(k for k in set(expected) & set(committed) if expected[k] != committed[k])
    assert not (missing or extra or differ), (
        f"deploy/gke drifted from the generator: missing {missing}, not generated "
        f"{extra}, different {differ}. Regenerate with `{FIX}`.")


def test_cli_writes_one_overlay(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jaxpod.cli", "deploy", "render", "--accelerator-type",
         "v6e-16", "--slices", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kustomization.yaml", "raycluster-tpu.yaml"]
    assert done.stdout.split() == [str(tmp_path / "kustomization.yaml"),
                                   str(tmp_path / "raycluster-tpu.yaml")]
    for name, text in dr.render_overlay("v6e-16", 2).items():
        assert (tmp_path / name).read_text() == text
        assert (GKE / "overlays" / "v6e-16x2" / name).read_text() == text


def test_unknown_type_and_bad_slices_are_refused() -> None:
    with pytest.raises(ValueError, match="Known types"):
        dr.render_overlay("v9-16")
    with pytest.raises(ValueError, match="at least 1"):
        dr.render_overlay("v4-16", 0)
    done = subprocess.run(
        [sys.executable, "-m", "jaxpod.cli", "deploy", "render", "--accelerator-type",
         "v4-17", "--out", "/nonexistent"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Unknown TPU accelerator type 'v4-17'" in done.stderr


def test_coordinator_port_is_configurable() -> None:
    files = dr.render_overlay("v4-16", coordinator_port=8476)
    text = files["raycluster-tpu.yaml"]
    assert "containerPort: 8476" in text and "value: '8476'" in text
    assert "--coordinator-port 8476" in text.splitlines()[0]


def test_checkpoint_bucket_is_set_in_the_config(tmp_path: Path) -> None:
    """The base's ConfigMap names the bucket the TPU hosts write checkpoints to (the
    coordinator reads it as JAXPOD_CHECKPOINT_DIR); a path only one machine sees is
    refused, saying why."""
    done = subprocess.run(
        [sys.executable, "-m", "jaxpod.cli", "deploy", "render", "--base",
         "--checkpoint-dir", "gs://team-bucket/jaxpod", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=True)
    assert str(tmp_path / "config.yaml") in done.stdout.split()
    config = (tmp_path / "config.yaml").read_text()
    assert "JAXPOD_CHECKPOINT_DIR: gs://team-bucket/jaxpod" in config
    assert "--checkpoint-dir gs://team-bucket/jaxpod" in config.splitlines()[0]
    committed = (GKE / "base" / "config.yaml").read_text()
    assert f"JAXPOD_CHECKPOINT_DIR: {dr.CHECKPOINT_DIR}" in committed
    refused = subprocess.run(
        [sys.executable, "-m", "jaxpod.cli", "deploy", "render", "--base",
         "--checkpoint-dir", "/var/lib/jaxpod/checkpoints", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "must be a bucket every pod reaches" in refused.stderr
