"""The hosts' compilation cache across restarts of a simulated two-host group.

On CPU each process's programs have their own cache key, so JAX's rule that only
the first process writes left the second simulated host compiling every program at
every restart; :func:`jaxpod.worker.compile_cache.enable` with
``every_process_writes`` (what simulated hosts use) lets each write its own. Real
processes, as a restarted attempt's hosts are: a group compiles, a new group of two
new processes loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from host_group import run_group

PROGRAM = Path(__file__).with_name("cache_host_program.py")
DEADLINE_S = 120


def _group(cache: Path, mode: str) -> list[dict[str, object]]:
    """Both hosts of one group, new processes; each one's report."""
    reports = run_group(PROGRAM, [mode], {
        "JAXPOD_COMPILATION_CACHE_DIR": str(cache),
        "JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S": "0.000001"}, deadline_s=DEADLINE_S)
    expected = (np.arange(32, dtype=np.float32).reshape(8, 4) * 3.0).sum(axis=0)
    for report in reports:
        np.testing.assert_allclose(report["total"], expected)
    return sorted(reports, key=lambda r: int(r["process"]))  # type: ignore[call-overload]


@pytest.mark.multiprocess
def test_a_new_group_of_simulated_hosts_loads_every_program(tmp_path: Path) -> None:
    first = _group(tmp_path / "cache", "writes")
    assert all(int(r["compiled"]) > 0 for r in first), first  # type: ignore[call-overload]
    again = _group(tmp_path / "cache", "writes")
    for report in again:  # each host, the second included, loads what it compiled
        assert report["compiled"] == 0 and int(report["loaded"]) > 0, again  # type: ignore[call-overload]


@pytest.mark.multiprocess
def test_with_jaxs_rule_alone_the_second_simulated_host_compiles_again(
        tmp_path: Path) -> None:
    """Why simulated hosts need their own entries: the first process's never serve the
    second (if a JAX release changes this, the workaround can go)."""
    _group(tmp_path / "cache", "first-writes")
    first, second = _group(tmp_path / "cache", "first-writes")
    assert first["compiled"] == 0 and int(second["compiled"]) > 0, (first, second)  # type: ignore[call-overload]
