"""The benchmark scripts as files: checks that need no run of them."""

from __future__ import annotations

import sys
from pathlib import Path

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
