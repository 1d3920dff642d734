"""The benchmark scripts as files, and the pages that publish their figures
(``.ci/run`` runs every script through ``benchmarks/run_all.py --quick``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_module_shadows_the_standard_library() -> None:
    # The scripts run with benchmarks/ first on sys.path, and so do the child
    # processes they start: a benchmarks/queue.py made every ``import queue`` there
    # (concurrent.futures, orbax) load the benchmark instead.
    names = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert names, f"no benchmark scripts found in {BENCHMARKS}"
    shadowing = sorted(names & set(sys.stdlib_module_names))
    assert not shadowing, (
        f"benchmarks/{{{', '.join(shadowing)}}}.py shadow standard-library modules of "
        "the same name; rename them")


def _publish() -> Any:
    spec = importlib.util.spec_from_file_location("publish", BENCHMARKS / "publish.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_published_pages_show_every_target_met_or_not(tmp_path: Path) -> None:
    publish = _publish()
    area = SimpleNamespace(script="checkpoint", title="Checkpoints", question="Q?")
    growth = SimpleNamespace(script="growth", title="Growth", question="G?")
    hosts, seconds = [1, 2, 4], [1.0, 1.5, 2.5]
    slope = float(np.polyfit(hosts, seconds, 1)[0])
    results = {
        "generated_at": "2026-11-27 10:00 UTC", "command": "python benchmarks/run_all.py",
        "quick": False, "seconds": 12.0, "notes": {},
        "machine": {"cores": 2, "cpu": "x86_64", "memory_gib": 24.0, "system": "Linux",
                    "python": "3.11", "jax": "0.x", "jaxpod": "0.1", "accelerators": "none"},
        "benchmarks": {
            "checkpoint": {"command": "python benchmarks/checkpoint.py", "seconds": 5.0,
                           "exit": 0,
                           "figures": {"job_save_s": 0.4, "plain_save_s": 0.6},
                           "targets": {
                               "save_throughput_vs_orbax": {"value": 1.5, "target": ">= 0.9",
                                                            "met": True},
                               "restore_vs_orbax": {"value": 1.2, "target": "<= 1.1",
                                                    "met": False}}},
            "growth": {"command": "python benchmarks/growth.py", "seconds": 6.0, "exit": 0,
                       "figures": {"hosts": hosts, "cores": 2, "allocation_s": seconds,
                                   "allocation_s_per_host": slope,
                                   "allocation_s_at_64": 1 + 64 * slope,
                                   "allocation_s_at_256": 1 + 256 * slope},
                       "targets": {}}}}
    (tmp_path / "README.md").write_text(f"x\n{publish.SUMMARY_START}\nold\n"
                                        f"{publish.SUMMARY_END}\ny\n")
    written = publish.write_pages(results, tmp_path, [area, growth])
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "**1 of 2 targets met.**" in page
    assert ("| `save_throughput_vs_orbax` | job_save_s = 0.4 | plain_save_s = 0.6 | 1.5 "
            "| >= 0.9 | **met** |") in page
    assert "| `restore_vs_orbax` | - | - | 1.2 | <= 1.1 | **not met** |" in page
    assert f"| `allocation_s` | 1 | 1.5 | 2.5 | {slope:.4g} |" in page
    plot = tmp_path / "docs" / "benchmarks" / "growth.png"
    assert plot in written and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (tmp_path / "README.md").read_text()
    assert "old" not in readme and readme.startswith("x\n") and readme.endswith("y\n")
    assert "job checkpoints saved at 1.5x the throughput" in readme
    assert json.loads((tmp_path / "results.json").read_text()) == results


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(seconds: float, save_s: float, ratio: float, hosts: list[float]) -> dict[str, Any]:
    return {"command": "python benchmarks/checkpoint.py", "ran_at": "2026-12-01 10:00 UTC",
            "seconds": seconds, "exit": 0, "log": "x.log",
            "figures": {"job_save_s": save_s, "state_mib": 64, "hosts": hosts,
                        "note": "text"},
            "targets": {"save_throughput_vs_orbax": {"value": ratio, "target": ">= 0.9",
                                                     "met": ratio >= 0.9}}}


def test_repeated_runs_become_medians_with_their_spread() -> None:
    combine = _module("repeats").combine
    ratios = [0.7, 1.4, 0.95, 0.85, 1.2]
    runs = [_run(10.0 + i, 0.4 + 0.1 * i, r, [1.0 + i, 2.0]) for i, r in enumerate(ratios)]
    entry = combine(runs)
    assert entry["repeats"] == 5 and entry["seconds"] == 12.0
    assert entry["figures"]["job_save_s"] == np.median([0.4 + 0.1 * i for i in range(5)])
    assert entry["figures"]["state_mib"] == 64 and entry["figures"]["note"] == "text"
    assert entry["figures"]["hosts"] == [3.0, 2.0]  # element-wise
    assert entry["spread"]["job_save_s"] == [0.4, 0.4 + 0.1 * 4]
    assert "state_mib" not in entry["spread"]  # the same in every run
    target = entry["targets"]["save_throughput_vs_orbax"]
    # judged again on the median, whatever the runs said
    assert target["value"] == np.median(ratios) == 0.95 and target["met"] is True
    assert entry["spread"]["target:save_throughput_vs_orbax"] == [0.7, 1.4]
    # an exact target holds only if it held in every run: one bad run shows
    exact = [{**r, "targets": {"corrupt": {"value": bad, "target": "== 0", "met": bad == 0}}}
             for r, bad in zip(runs, [0, 0, 2, 0, 0], strict=True)]
    assert combine(exact)["targets"]["corrupt"] == {"value": 2, "target": "== 0",
                                                    "met": False}
    failed = combine([*runs[:2], {**runs[2], "exit": 1, "error": "boom"}])
    assert failed["error"] == "boom" and failed["exit"] == 1 and "figures" not in failed


def test_a_rerun_gets_a_dated_section_of_its_own(tmp_path: Path) -> None:
    publish, repeats = _publish(), _module("repeats")
    area = SimpleNamespace(script="checkpoint", title="Checkpoints", question="Q?")
    full = {"generated_at": "2026-12-01 09:00 UTC", "command": "python benchmarks/run_all.py",
            "quick": False, "seconds": 99.0, "notes": {}, "repeats": 5,
            "machine": {"cores": 2, "cpu": "x86_64", "memory_gib": 24.0, "system": "Linux",
                        "python": "3.11", "jax": "0.x", "jaxpod": "0.1",
                        "accelerators": "none"},
            "benchmarks": {"checkpoint": repeats.combine(
                [_run(10, 0.5, r, [1.0]) for r in (1.0, 1.1, 1.2, 1.3, 1.4)])},
            "reruns": [{"command": "python benchmarks/run_all.py --only checkpoint",
                        "generated_at": "2026-12-01 11:00 UTC", "notes": {},
                        "benchmarks": {"checkpoint": repeats.combine(
                            [_run(10, 0.5, 0.5, [1.0])])}}]}
    publish.write_pages(full, tmp_path, [area])
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    main, rerun = page.split("## Reruns of some scripts")
    assert "**1 of 1 targets met.**" in main  # the rerun's miss is not counted
    assert "| 1.2 [1, 1.4] | >= 0.9 | **met** |" in main
    assert "Each script ran 5 times" in main
    assert "### `python benchmarks/run_all.py --only checkpoint`, 2026-12-01 11:00 UTC" in rerun
    assert "| 0.5 | >= 0.9 | **not met** |" in rerun
